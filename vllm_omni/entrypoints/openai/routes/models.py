"""GET /health (readiness and worker health, open without the API key), GET /v1/models, and
`check_model`: the served model, as the image and video routes check a request's `model`."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_omni.entrypoints.openai.errors import ApiError
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
    limits = settings.engine.limits
    if engine is not None:
        limits = limits.for_model(engine.spec)  # with the model's own defaults (max_tokens_per_step)
    card = ModelCard(
        id=settings.served_model_name or settings.engine.model,
        created=http.app.state.created,
        root=settings.engine.model,
        task=engine.spec.task if engine is not None else None,
        ready=scheduler.ready and scheduler.health().ok,
        parallel_config=settings.engine.parallel_config.to_dict(),
        default_sampling_params=settings.default_sampling_params,
        limits={k: v for k, v in asdict(limits).items() if v is not None},  # None: the model's, not known yet
        batching=asdict(settings.engine.batching),
        quantization=settings.engine.quantization,
        cache=asdict(settings.engine.step_cache) if settings.engine.step_cache is not None else None,
    )
    return ModelList(data=[card])


def check_model(http: Request, model: str | None, modality: str) -> None:
    """A 400 naming `model` when the request names another model, or the served one makes the other modality."""
    settings = http.app.state.settings
    names = settings.model_names
    if model and model not in names:
        raise ApiError(
            400,
            f"model {model!r} is not served here; this server serves {', '.join(sorted(names))}",
            param="model",
            code="model_not_found",
        )
    engine = http.app.state.scheduler.engine
    served = engine.spec.modality if engine is not None else None  # None: still starting (submit answers 503)
    if served is not None and served != modality:
        name = settings.served_model_name or settings.engine.model
        endpoint = "POST /v1/videos" if served == "video" else "POST /v1/images/generations or /v1/images/edits"
        raise ApiError(
            400,
            f"model {name!r} generates {served}s, not {modality}s: use {endpoint}",
            param="model",
            code="wrong_modality",
        )
