"""The scheduling policies (`--scheduling-policy`): which queued job runs next on a free replica.

The scheduler (scheduler.py) asks `QueuePolicy.next_head` whenever a replica is free and tells it what started;
with interleaving it asks `preempts` whether the head runs inside the call in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm_omni.diffusion.config import SCHEDULING_POLICIES

if TYPE_CHECKING:
    from vllm_omni.diffusion.engine.job import Job

MAX_OVERTAKES = 4  # fair: the most jobs queued after a job that may run before it


class QueuePolicy:
    """The order in which queued jobs run, and (with --max-num-seqs > 1) which run inside a running one (`preempts`).

    - fcfs: arrival order.
    - priority: the lowest `priority` first (vLLM's field and meaning), ties in arrival order.
    - fair: the least estimated work first (`DiffusionRequest.work`: steps x tokens per step x images), ties
      in arrival order; but a job that MAX_OVERTAKES jobs queued after it have overtaken goes next (the oldest
      such first). The bound counts jobs, not time, so the order does not depend on timing.

    The queue (`waiting`) is in arrival order. Jobs that share a batch run with their head (equal batch keys:
    the same priority and work), and under fair a batch takes no job that would overtake one past the bound.
    """

    def __init__(self, name: str) -> None:
        if name not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {name!r}")
        self.name = name

    def _rank(self, job: Job, arrival: int) -> tuple:
        if self.name == "priority":
            return (job.request.priority, arrival)
        if self.name == "fair":
            return (0, arrival) if job.overtaken >= MAX_OVERTAKES else (1, job.request.work, arrival)
        return (arrival,)

    def next_head(self, waiting: Sequence[Job]) -> Job:
        """The job that runs next (`waiting` is not empty)."""
        return min(enumerate(waiting), key=lambda pair: self._rank(pair[1], pair[0]))[1]

    def position(self, job: Job, waiting: Sequence[Job]) -> int:
        """1 + the queued jobs that would run before `job` as things stand (for the log)."""
        ranks = [self._rank(other, arrival) for arrival, other in enumerate(waiting)]
        return 1 + sum(rank < ranks[waiting.index(job)] for rank in ranks)

    def admit(self, jobs: list[Job], waiting: Sequence[Job]) -> list[Job]:
        """`jobs` (a head and the company it may take, in arrival order), cut before the first that would have a
        waiting job overtaken past the bound (fair only; the head itself never does)."""
        if self.name != "fair":
            return jobs
        arrival = {id(job): i for i, job in enumerate(waiting)}
        others = [job for job in waiting if job not in jobs]
        passed = dict.fromkeys(map(id, others), 0)
        for taken, job in enumerate(jobs):
            earlier = [other for other in others if arrival[id(other)] < arrival[id(job)]]
            if taken and any(other.overtaken + passed[id(other)] >= MAX_OVERTAKES for other in earlier):
                return jobs[:taken]
            for other in earlier:
                passed[id(other)] += 1
        return jobs

    def started(self, jobs: list[Job], waiting: Sequence[Job]) -> int:
        """Count the overtakes of `jobs` starting (still in `waiting`): each job left waiting gains the jobs of `jobs`
        queued after it. Returns how many the head overtook."""
        later = 0
        for job in reversed(waiting):
            if job in jobs:
                later += 1
            else:
                job.overtaken += later
        head = waiting.index(jobs[0])
        return sum(job not in jobs for job in list(waiting)[:head])

    def preempts(self, job: Job, running: list[Job]) -> bool:
        """Whether queued `job` runs inside `running` (the innermost engine call in flight on a replica), from that
        call's next denoising step (interleaving, --max-num-seqs > 1): under priority when its priority is lower;
        under fair when its work is less than what `running` has left and `running` was overtaken fewer than
        MAX_OVERTAKES times. Never when `running` has fewer than two steps left or is past its steps (the workers
        take a request only between two steps)."""
        head = running[0]
        steps = head.request.num_inference_steps
        left = steps - steps * head.progress // 100 if head.phase == "denoise" else 0
        if self.name == "fcfs" or left < 2:
            return False
        if self.name == "priority":
            return job.request.priority < head.request.priority
        remaining = sum(other.request.work for other in running) * left / steps
        return head.overtaken < MAX_OVERTAKES and job.request.work < remaining

    def describe(self, job: Job) -> str:
        """The policy's reason for running `job` out of arrival order, for the log."""
        if self.name == "priority":
            return f"priority {job.request.priority}"
        return "least work first" if self.name == "fair" else "first come"
