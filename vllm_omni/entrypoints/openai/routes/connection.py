"""A job waited for while its client's connection is watched: a client that goes away has its job cancelled
(dropped from the queue, or stopped at its next denoising step). Every route that answers with the job's result
waits so: the images routes, chat, and POST /v1/videos/sync."""

from __future__ import annotations

import asyncio

from fastapi import Request

from vllm_omni.diffusion.engine.job import Job
from vllm_omni.diffusion.engine.scheduler import Scheduler


async def wait_watching_client(http: Request, scheduler: Scheduler, job: Job) -> None:
    """Until the job ends; a client that disconnects first has it cancelled (and it still ends)."""
    finished = asyncio.create_task(job.wait())
    gone = asyncio.create_task(_disconnected(http))
    try:
        await asyncio.wait({finished, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not finished.done():
            scheduler.cancel(job.id, "client disconnected")
            await finished
    finally:
        gone.cancel()
        finished.cancel()


async def _disconnected(http: Request) -> None:
    """Returns when the client closes the connection (the body is read: the next message says so)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
