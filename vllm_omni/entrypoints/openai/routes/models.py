"""GET /health (readiness and worker health, open without the API key) and vLLM's GET|POST /ping (the same
readiness, 200 or 503) and GET /version, GET /v1/models (the base model and each
served LoRA adapter), POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes, with
--allow-runtime-lora), and `check_model`: how every generating route reads a request's `model` and `lora`."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from vllm_omni import __version__
from vllm_omni.diffusion.engine.lifecycle import Unavailable
from vllm_omni.diffusion.request import GenerationParams, RequestError
from vllm_omni.entrypoints.openai.errors import ApiError, scheduler_error
from vllm_omni.entrypoints.openai.protocol import (
    AdapterCard,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoraAdapterRequest,
)

router = APIRouter()


@router.get("/health")
async def health(http: Request) -> JSONResponse:
    """200 {"status": "ok"} only while every worker is up; 503 with the state (and why) otherwise."""
    report = http.app.state.scheduler.health()
    return JSONResponse(report.to_dict(), status_code=200 if report.ok else 503)


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(http: Request) -> Response:
    """vLLM's liveness route (SageMaker's too): /health's answer, without its body."""
    return Response(status_code=200 if http.app.state.scheduler.health().ok else 503)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/v1/models", response_model=ModelList)
async def models(http: Request) -> ModelList:
    settings = http.app.state.settings
    scheduler = http.app.state.scheduler
    engine = scheduler.engine
    limits = settings.engine.limits
    if engine is not None:
        limits = limits.for_model(engine.spec)  # with the model's own defaults (max_tokens_per_step)
    base = settings.served_model_name or settings.engine.model
    created = http.app.state.created
    card = ModelCard(
        id=base,
        created=created,
        root=settings.engine.model,
        task=engine.spec.task if engine is not None else None,
        ready=scheduler.ready and scheduler.health().ok,
        parallel_config=settings.engine.parallel_config.to_dict(),
        default_sampling_params=settings.default_sampling_params,
        limits={k: v for k, v in asdict(limits).items() if v is not None},  # None: the model's, not known yet
        batching=asdict(settings.engine.batching),
        quantization=settings.engine.quantization,
        cache=asdict(settings.engine.step_cache) if settings.engine.step_cache is not None else None,
        envelope=_envelope(engine),
    )
    adapters = [
        AdapterCard(id=name, created=created, root=path, parent=base) for name, path in _served_adapters(http).items()
    ]
    return ModelList(data=[card, *adapters])


def _envelope(engine: Any) -> dict[str, Any] | None:
    envelope = engine.envelope if engine is not None else None
    if envelope is None:
        return None
    return {**asdict(envelope), "description": engine.envelope_text()}


def check_model(http: Request, model: str | None, modality: str, lora: Any = None) -> str | dict | None:
    """The request's adapter (for GenerationParams.lora): its `lora`, else the served adapter its `model` names
    (that name), else None. A 404 naming `model` (code model_not_found, as vLLM and OpenAI answer) when it names
    neither the served model nor an adapter; a 400 naming `model` when the served model makes the other modality;
    a 400 naming `lora` when `model` and `lora` name different adapters."""
    settings = http.app.state.settings
    names = settings.model_names
    adapters = _served_adapters(http)
    if model and model not in names and model not in adapters:
        served = sorted(names) + [f"{name} (LoRA adapter)" for name in adapters]
        raise ApiError(
            404,
            f"model {model!r} is not served here; this server serves {', '.join(served)}",
            param="model",
            code="model_not_found",
        )
    engine = http.app.state.scheduler.engine
    served = engine.spec.modality if engine is not None else None  # None: still starting (submit answers 503)
    if served is not None and served != modality:
        name = settings.served_model_name or settings.engine.model
        endpoint = (
            "POST /v1/videos (or /v1/videos/sync)"
            if served == "video"
            else "POST /v1/images/generations or /v1/images/edits"
        )
        raise ApiError(
            400,
            f"model {name!r} generates {served}s, not {modality}s: use {endpoint}",
            param="model",
            code="wrong_modality",
        )
    if isinstance(lora, dict) and "path" in lora:  # else a client could load any file without the admin routes
        raise ApiError(
            400,
            "lora.path is not taken over HTTP: serve the adapter with --lora-modules or POST /v1/load_lora_adapter, "
            "then name it",
            param="lora",
        )
    if not model or model in names:
        return lora
    if lora is None:
        return model
    if isinstance(lora, dict):
        if lora.get("name", model) != model:
            raise ApiError(
                400,
                f"model {model!r} and lora.name {lora['name']!r} name different adapters: give one of them",
                param="lora",
            )
        return {**lora, "name": model}  # `model` names it, `lora` may give its scale
    return lora  # not an object: the engine's check names `lora`


def adapter_error(exc: RequestError, params: GenerationParams) -> RequestError:
    """The engine's verdict on the adapter, naming `model` where the request chose it there (`check_model` passed
    the bare name on)."""
    if exc.param == "lora" and isinstance(params.lora, str):
        return type(exc)(str(exc), "model")
    return exc


def _served_adapters(http: Request) -> dict[str, str]:
    engine = http.app.state.scheduler.engine
    return engine.adapters.served() if engine is not None else {}


# ---- LoRA adapters at run time (vLLM's routes and bodies) ----------------------------------------------------


def runtime_lora_allowed(http: Request) -> None:
    """404 unless the server was started with --allow-runtime-lora (vLLM registers these routes only when allowed;
    here they answer, saying how to allow them); 503 while the engine is not up."""
    if not http.app.state.settings.engine.allow_runtime_lora:
        raise ApiError(
            404,
            f"{http.url.path} is off: start the server with --allow-runtime-lora to load and unload LoRA adapters "
            "while serving",
        )
    try:
        http.app.state.scheduler.check_accepting()
    except Unavailable as exc:
        raise scheduler_error(exc) from None


@router.post("/v1/load_lora_adapter", dependencies=[Depends(runtime_lora_allowed)])
async def load_lora_adapter(body: LoadLoraAdapterRequest, http: Request) -> PlainTextResponse:
    """Serve the adapter at `lora_path` as `lora_name`; a 400 naming `lora_path` (missing, unreadable, another
    model's, rank above --max-lora-rank) or `lora_name` (already served)."""
    engine = http.app.state.scheduler.engine
    # The first replica's engine checks every request (Scheduler.submit), and a request carries its adapter's
    # file to whichever replica runs it: its registry is the server's.
    await asyncio.to_thread(engine.load_lora_adapter, body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", dependencies=[Depends(runtime_lora_allowed)])
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, http: Request) -> PlainTextResponse:
    """Stop serving `lora_name` (404 when it is not served). Requests accepted with it before still run with it."""
    http.app.state.scheduler.engine.unload_lora_adapter(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
