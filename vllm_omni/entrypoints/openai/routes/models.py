"""GET /health (readiness and worker health, open without the API key) and GET /v1/models."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_omni.entrypoints.openai.protocol import ModelCard, ModelList

router = APIRouter()


@router.get("/health")
async def health(http: Request) -> JSONResponse:
    """200 {"status": "ok"} only while every worker is up; 503 with the state (and why) otherwise."""
    report = http.app.state.scheduler.health()
    return JSONResponse(report.to_dict(), status_code=200 if report.ok else 503)


@router.get("/v1/models", response_model=ModelList)
async def models(http: Request) -> ModelList:
    settings = http.app.state.settings
    scheduler = http.app.state.scheduler
    engine = scheduler.engine
    card = ModelCard(
        id=settings.served_model_name or settings.engine.model,
        created=http.app.state.created,
        root=settings.engine.model,
        task=engine.spec.task if engine is not None else None,
        ready=scheduler.ready and scheduler.health().ok,
        parallel_config=settings.engine.parallel_config.to_dict(),
        default_sampling_params=settings.engine.default_sampling_params,
        limits=asdict(settings.engine.limits),
    )
    return ModelList(data=[card])
