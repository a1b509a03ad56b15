"""The ranks as Ray actors (`--distributed-executor-backend ray`): one machine, or several in a Ray cluster.

DiffusionEngine creates `RayExecutor` for that backend; it behaves as the multiprocessing executor
does (base.WorkerGroupExecutor holds their shared lifecycle: deadlines, restarts, status,
shutdown), with the same reports (protocol.py) plus `Placed` and `Log`; only how ranks start and
talk differs:

- One `RankActor` per rank, each in its own bundle of one placement group (one GPU per bundle
  on CUDA, one CPU on CPU; PACK). Bundles on one node get consecutive ranks, so an SP group
  stays within a node where it fits; a rank is known by node id and bundle index (several
  nodes may share an IP). An actor uses the GPU Ray gives it, which it sees as device 0.
- Rendezvous: rank 0 names its node's address and a free port there; Ray hands that address
  to every actor (an ObjectRef argument), so the driver never waits for it.
- In the actor, worker.run_rank runs in a thread: the same load and request loop as a worker
  process. Requests go in by actor calls; reports and the rank's own log records come back by
  long polls, rank 0's uint8 images through Ray's object store. A cancel sets every rank's flag
  by an actor call; the ranks agree on it at the next step over their gloo control group.
- Each actor holds a `lifeline` call that never returns: it fails the moment the actor dies, so
  a death is seen at once, busy or idle, and the whole group is killed and restarted (under
  NCCL the survivors of a death hang rather than fail).
- Ray: this process's connection when it has one, else the cluster at `ray_address`, else a
  private instance on this machine (`address="local"`, never a stray RAY_ADDRESS). Quiet: no
  usage stats, no forwarding of Ray's worker output (VLLM_OMNI_RAY_LOG_TO_DRIVER=1 turns it on).
  Actors on a `ray start` cluster do not inherit this process's environment: its VLLM_OMNI_*
  and VLLM_LOGGING_LEVEL variables travel with each actor (runtime_env).
- The actors and the placement group belong to this process's Ray job: Ray kills them when the
  process ends, however it ends; `shutdown()` kills them at once, removes the group, and stops a
  private instance.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import socket
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

# Read when ray is imported: Ray's native handler of fatal signals would take SIGTERM as well, and
# a process whose SIGTERM it has seen aborts at exit. The server handles SIGTERM itself (exit 0).
os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")

import ray  # noqa: E402
from ray.exceptions import GetTimeoutError, RayActorError  # noqa: E402
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from vllm_omni import envs
from vllm_omni.diffusion.config import OmniDiffusionConfig  # noqa: E402
from vllm_omni.diffusion.executor.base import WorkerGroupExecutor, WorkerStartError  # noqa: E402
from vllm_omni.diffusion.protocol import (  # noqa: E402
    CANCEL_SLOTS,
    Done,
    LoadFailed,
    Log,
    Placed,
    RankPlacement,
    RankReport,
)
from vllm_omni.diffusion.request import DiffusionRequest  # noqa: E402
from vllm_omni.logger import init_logger  # noqa: E402

logger = init_logger(__name__)

POLL_WAIT_S = 1.0  # an actor's poll returns empty after this long without a report
KILL_WAIT_S = 10.0  # a killed group's actors are gone within this (their GPUs are free for the next group)
LOG_TO_DRIVER_ENV = envs.RAY_LOG_TO_DRIVER
# Actor calls run on a pool of this many threads: the lifeline, a poll, and control calls beside them.
ACTOR_THREADS = 4


def forwarded_env() -> dict[str, str]:
    """The variables of this process that every actor gets: vllm_omni's own settings."""
    return {k: v for k, v in os.environ.items() if k.startswith(envs.PREFIX) or k == "VLLM_LOGGING_LEVEL"}


@contextmanager
def _quiet_ray_start():
    """Ray's start-up warnings that concern a private instance, not the user (token auth on, signals)."""
    noisy = [logging.getLogger(name) for name in ("ray._private.authentication.authentication_token_setup",)]
    noisy.append(logging.getLogger("ray._private.worker"))
    levels = [log.level for log in noisy]
    main_thread = threading.current_thread() is threading.main_thread()
    previous_sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
    for log in noisy:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(noisy, levels):
            log.setLevel(level)
        if main_thread:  # ray.init replaces the SIGTERM handler of the main thread with sys.exit
            signal.signal(signal.SIGTERM, previous_sigterm)


class RaySession:
    """This process's use of Ray for one executor: joined (or started) once, released once.

    A private instance started here is shared by the executors of this process and stopped when
    the last one releases it; a connection the process already had is left as it is.
    """

    _lock = threading.Lock()
    _private_users = 0  # executors using the private instance this process started

    def __init__(self, private: bool, log_to_driver: bool) -> None:
        self.private = private
        self.log_to_driver = log_to_driver
        self._released = False

    @classmethod
    def join(cls, address: str | None, world_size: int) -> RaySession:
        """Use this process's Ray connection if it has one; else join `address`, or start a private instance."""
        log_to_driver = os.environ.get(LOG_TO_DRIVER_ENV, "0").lower() in ("1", "true", "yes")
        with cls._lock:
            if ray.is_initialized():
                private = cls._private_users > 0
                if not private:
                    logger.info("Using this process's Ray connection (ray_address is not used)")
            else:
                os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
                options: dict[str, Any] = dict(
                    namespace="vllm_omni", log_to_driver=log_to_driver, logging_level=logging.WARNING
                )
                if address is None:
                    # "local" starts a new instance whatever RAY_ADDRESS or an earlier `ray start` says.
                    # CPU bundles are logical: let a small machine hold a CPU world larger than its cores.
                    # A private instance serves this machine only: it listens on the loopback address.
                    options.update(
                        address="local",
                        include_dashboard=False,
                        num_cpus=max(os.cpu_count() or 1, world_size),
                        _node_ip_address="127.0.0.1",
                    )
                else:
                    options.update(address=address)
                started = time.perf_counter()
                with _quiet_ray_start():
                    ray.init(**options)
                private = address is None
                logger.info(
                    "Ray %s in %.1f s: %s",
                    "started (a private instance on this machine)" if private else f"joined at {address}",
                    time.perf_counter() - started,
                    {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")},
                )
            if private:
                cls._private_users += 1
        return cls(private, log_to_driver)

    def gpu_count(self) -> int:
        """GPUs in the whole cluster (what a CUDA world may span)."""
        return int(ray.cluster_resources().get("GPU", 0))

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            if self.private:
                RaySession._private_users -= 1
                if RaySession._private_users == 0:
                    ray.shutdown()


class _CancelToken:
    """The cancel tokens the executor flagged last (worker.run_rank reads `[:]`)."""

    def __init__(self) -> None:
        self.tokens: list[int] = [-1] * CANCEL_SLOTS

    def __getitem__(self, index: slice) -> list[int]:
        return self.tokens[index]


class _ReportHandler(logging.Handler):
    """Sends this rank's vllm_omni log records to the driver with its reports (Ray's own output stays here)."""

    def __init__(self, rank: int, reports: queue.Queue) -> None:
        super().__init__()
        self.rank = rank
        self.reports = reports

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
            # Plain data only (arguments and tracebacks may not pickle), named after the rank.
            record = logging.makeLogRecord({**record.__dict__, "msg": message, "args": None, "exc_info": None})
            record.exc_text = None
            record.processName = f"omni-ray-rank-{self.rank}"
            self.reports.put(Log(self.rank, record))
        except Exception:  # noqa: BLE001 - logging must never break the rank
            self.handleError(record)


class RankActor:
    """One rank in a Ray actor: worker.run_rank in a thread, fed and read by the calls below."""

    def __init__(self, rank: int, bundle_index: int, forward_logs: bool) -> None:
        self.rank = rank
        self._requests: queue.Queue = queue.Queue()
        self._reports: queue.Queue = queue.Queue()
        self._cancel_token = _CancelToken()
        self._thread: threading.Thread | None = None
        if forward_logs:
            logging.getLogger("vllm_omni").addHandler(_ReportHandler(rank, self._reports))
        node_id = ray.get_runtime_context().get_node_id()
        where = RankPlacement(rank, node_id, bundle_index, ray.util.get_node_ip_address(), os.getpid())
        self._reports.put(Placed(rank, where))

    def open_rendezvous(self) -> str:
        """Rank 0: the process-group address every rank joins, on this node (a free port here)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"

    def start(self, config: OmniDiffusionConfig, model_path: str, init_method: str) -> None:
        """Join the groups and load in the background; `Ready` or `LoadFailed` follows in the reports."""
        self._thread = threading.Thread(
            target=self._run, args=(config, model_path, init_method), name=f"omni-rank-{self.rank}", daemon=True
        )
        self._thread.start()

    def _run(self, config: OmniDiffusionConfig, model_path: str, init_method: str) -> None:
        from vllm_omni.diffusion.model_source import resolve_model_path
        from vllm_omni.diffusion.worker.worker import run_rank

        try:
            # The driver's folder when this node has it at the same path; else this node's own copy
            # (Hugging Face cache, downloaded there if need be, or a tiny model built here).
            if not (Path(model_path) / "model_index.json").is_file():
                model_path = str(resolve_model_path(config.model, config.download_dir, config.revision))
        except Exception as exc:  # noqa: BLE001 - reported like any load failure
            self._reports.put(LoadFailed(self.rank, f"{type(exc).__name__} on this node: {exc}"))
            return
        gpu = _ray_gpu_index() if config.device == "cuda" else 0
        run_rank(self.rank, config, model_path, init_method, self._requests, self._reports, self._cancel_token, gpu)

    def submit(self, request: DiffusionRequest) -> None:
        self._requests.put(request)

    def flag_cancels(self, cancel_tokens: list[int]) -> None:
        self._cancel_token.tokens = list(cancel_tokens)

    def poll(self, wait_s: float) -> list[RankReport]:
        """The reports so far, waiting up to `wait_s` for the first one."""
        try:
            batch = [self._reports.get(timeout=wait_s)]
        except queue.Empty:
            return []
        while True:
            try:
                batch.append(self._reports.get_nowait())
            except queue.Empty:
                return batch

    def lifeline(self) -> None:
        """Never returns: the driver holds this call, and it fails the moment this actor dies."""
        threading.Event().wait()

    def leave(self, timeout: float) -> bool:
        """An idle rank leaves its loop and closes its process groups; True once it has."""
        self._requests.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True


_RemoteRankActor = ray.remote(RankActor)


def _ray_gpu_index() -> int:
    """The CUDA index of the GPU Ray gave this actor: 0, as Ray makes it the only visible one (unless told not to)."""
    assigned = [str(gpu) for gpu in ray.get_gpu_ids()]
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible.index(assigned[0]) if assigned and assigned[0] in visible else 0


def rank_order(bundle_nodes: dict[int, str], world_size: int) -> list[int]:
    """The bundle index of each rank: a node's bundles take consecutive ranks, nodes in the order of their
    first bundle (an SP group, a run of consecutive ranks, then spans as few nodes as possible)."""
    nodes = [bundle_nodes.get(index, f"unplaced-{index}") for index in range(world_size)]
    first_bundle = {}
    for index, node in enumerate(nodes):
        first_bundle.setdefault(node, index)
    return sorted(range(world_size), key=lambda index: (first_bundle[nodes[index]], index))


def _death_reason(exc: BaseException) -> str:
    """Ray's reason for an actor's death, short ("it was killed by `ray.kill`", "its worker process has died ...")."""
    for line in str(exc).splitlines():
        line = line.strip()
        if line.startswith("The actor is dead because"):
            reason = line.removeprefix("The actor is dead because").split(" Worker exit detail:")[0]
            return reason.strip().rstrip(".")
    return type(exc).__name__


class RayExecutor(WorkerGroupExecutor):
    """One Ray actor per rank, in one placement group; requests go to all of them, rank 0's result comes back."""

    def __init__(self, config: OmniDiffusionConfig, model_path: str, session: RaySession) -> None:
        """Place the bundles and start the actors; `session` is released here if that fails, else at shutdown."""
        super().__init__(config, model_path)
        self._session = session
        self._on_cuda = config.device == "cuda"
        self._actors: list[Any] = []
        self._lifelines: dict[Any, int] = {}  # lifeline call -> rank
        self._polls: dict[Any, int] = {}  # the one poll in flight per live actor -> rank
        self._starts: dict[Any, int] = {}  # start calls not finished yet -> rank (they fail if rank 0 cannot open)
        self._reports: deque[RankReport] = deque()
        self._dead: dict[int, str] = {}  # rank -> how it died
        self._watch_lock = threading.Lock()  # _dead and the lifelines, read by status() from any thread
        self.placements: dict[int, RankPlacement] = {}
        self._pg = None
        try:
            self._pg = self._place_bundles()
            with self._group_lock:
                self._spawn_locked()
        except BaseException:
            self._release()
            raise

    def _place_bundles(self) -> Any:
        """One bundle per rank (a GPU on CUDA, a CPU otherwise), placed within load_timeout_s."""
        resource = "GPU" if self._on_cuda else "CPU"
        have = ray.cluster_resources().get(resource, 0)
        if have < self.world_size:
            shortfall = f"the Ray cluster has {have:g} {resource}(s); the parallel config needs {self.world_size}"
            if self._session.private:  # no node will join a private instance
                raise WorkerStartError(shortfall)
            logger.warning(
                "%s: waiting up to load_timeout_s=%g s for nodes to join", shortfall, self.config.load_timeout_s
            )
        group = placement_group([{resource: 1}] * self.world_size, strategy="PACK")
        try:
            ray.get(group.ready(), timeout=self.config.load_timeout_s)
        except GetTimeoutError:
            remove_placement_group(group)
            raise WorkerStartError(
                f"the Ray cluster could not place {self.world_size} bundle(s) of 1 {resource} within "
                f"load_timeout_s={self.config.load_timeout_s:g} s (free now: {ray.available_resources()})"
            ) from None
        return group

    # ---- the group -----------------------------------------------------------------------------

    def _start_group(self) -> None:
        bundle_nodes = placement_group_table(self._pg).get("bundles_to_node_id", {})
        env = {"env_vars": forwarded_env()}
        self._actors = []
        for rank, bundle_index in enumerate(rank_order(bundle_nodes, self.world_size)):
            actor = _RemoteRankActor.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=bundle_index
                ),
                max_concurrency=ACTOR_THREADS,
                runtime_env=env,
                **({"num_gpus": 1, "num_cpus": 0} if self._on_cuda else {"num_cpus": 1}),
            ).remote(rank, bundle_index, not self._session.log_to_driver)
            self._actors.append(actor)
        # Every start waits (in Ray, not here) for the address rank 0 opens.
        init_method = self._actors[0].open_rendezvous.remote()
        self._starts = {
            actor.start.remote(self.config, self.model_path, init_method): rank
            for rank, actor in enumerate(self._actors)
        }
        with self._watch_lock:
            self._dead = {}
            self._lifelines = {actor.lifeline.remote(): rank for rank, actor in enumerate(self._actors)}
        self._polls = {actor.poll.remote(POLL_WAIT_S): rank for rank, actor in enumerate(self._actors)}
        self._reports.clear()
        self.placements = {}

    def _kill_group(self) -> None:
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        with self._watch_lock:
            lifelines = list(self._lifelines)
        if lifelines:  # gone before the next group claims their bundles (and GPU memory)
            ray.wait(lifelines, num_returns=len(lifelines), timeout=KILL_WAIT_S, fetch_local=False)
        self._actors = []
        self._polls = {}
        self._starts = {}
        self._reports.clear()
        with self._watch_lock:
            self._lifelines = {}
            self._dead = {}

    def _dead_worker(self) -> tuple[int, str] | None:
        with self._watch_lock:
            if self._lifelines:
                ended, _ = ray.wait(
                    list(self._lifelines), num_returns=len(self._lifelines), timeout=0, fetch_local=False
                )
                for ref in ended:
                    rank = self._lifelines.pop(ref)
                    self._dead.setdefault(rank, self._death_text(rank, ref))
            if not self._dead:
                return None
            rank = min(self._dead)
            return rank, self._dead[rank]

    def _death_text(self, rank: int, ended: Any) -> str:
        try:
            ray.get(ended, timeout=KILL_WAIT_S)
            reason = "its lifeline returned"
        except Exception as exc:  # noqa: BLE001 - any end of the lifeline means the actor is gone
            reason = _death_reason(exc)
        return self._died(rank, reason)

    def _died(self, rank: int, reason: str) -> str:
        where = self.placements.get(rank)
        return f"died ({reason}; Ray actor on {where})" if where else f"died ({reason})"

    def _stop_idle_group(self, deadline: float) -> None:
        timeout = max(0.0, deadline - time.monotonic())
        left = [actor.leave.remote(timeout) for actor in self._actors]
        ray.wait(left, num_returns=len(left), timeout=timeout, fetch_local=False)

    def _release(self) -> None:
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception as exc:  # noqa: BLE001 - Ray removes it with this process's job anyway
                logger.warning("Could not remove the placement group: %s", exc)
            self._pg = None
        self._session.release()

    # ---- messages ------------------------------------------------------------------------------

    def _send_request(self, request: DiffusionRequest) -> None:
        shared = ray.put(request)  # once, not once per rank (edits carry their source images)
        for actor in self._actors:
            actor.submit.remote(shared)

    def _flag_cancels(self, cancel_tokens: list[int]) -> None:
        for actor in list(self._actors):
            actor.flag_cancels.remote(cancel_tokens)

    def _next_report(self, timeout: float) -> RankReport:
        deadline = time.monotonic() + timeout
        while not self._reports:
            remaining = deadline - time.monotonic()
            watched = [*self._polls, *self._starts]
            if not watched or remaining < 0:
                raise queue.Empty
            ready, _ = ray.wait(watched, num_returns=1, timeout=remaining)
            if not ready:
                raise queue.Empty
            if ready[0] in self._starts:
                self._take_start(ready[0])
            else:
                self._take_poll(ready[0])
        return self._reports.popleft()

    def _take_start(self, ref: Any) -> None:
        rank = self._starts.pop(ref, None)
        try:
            ray.get(ref, timeout=KILL_WAIT_S)
        except RayActorError:
            pass  # its lifeline tells
        except Exception as exc:  # noqa: BLE001 - e.g. rank 0 could not name the rendezvous: nobody loads
            if rank is not None:
                self._reports.append(LoadFailed(rank, f"{type(exc).__name__}: {exc}"))

    def _take_poll(self, ref: Any) -> None:
        rank = self._polls.pop(ref, None)
        actors = self._actors
        if rank is None or rank >= len(actors):
            return  # the group was killed meanwhile (shutdown does not wait for a request's thread)
        try:
            # Ready, so no wait but the transfer of rank 0's images from its node.
            batch = ray.get(ref, timeout=self.config.stall_timeout_s)
        except RayActorError as exc:
            with self._watch_lock:
                self._dead.setdefault(rank, self._died(rank, _death_reason(exc)))
            return
        except Exception as exc:  # noqa: BLE001 - its reports are lost: as good as dead for this group
            with self._watch_lock:
                self._dead.setdefault(rank, f"lost its reports ({type(exc).__name__}: {exc})")
            return
        self._polls[actors[rank].poll.remote(POLL_WAIT_S)] = rank
        for report in batch:
            match report:
                case Log(record=record):
                    logging.getLogger(record.name).handle(record)
                case Placed(rank=sender, where=where):
                    self.placements[sender] = where
                    logger.info("Rank %d: Ray actor on %s", sender, where)
                case Done(images=images) if images is not None:
                    # Writable, and no longer pinning Ray's shared memory.
                    self._reports.append(dataclasses.replace(report, images=np.array(images)))
                case _:
                    self._reports.append(report)
