"""The videos API's jobs: a record per video, its MP4 on disk, persistence across restarts, eviction.

Built by the server (api_server.py) and used by routes/videos.py; no HTTP here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vllm_omni.diffusion.engine.job import Job, JobError, one_line
from vllm_omni.diffusion.engine.scheduler import Scheduler
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

VideoStatus = Literal["queued", "in_progress", "completed", "failed"]
VIDEO_ID = re.compile(r"^video-[0-9a-f]{16}$")  # the scheduler's ids with prefix "video"
# The names this store writes, and the only ones it reads or deletes: <id>.mp4, <id>.json, and
# their temporaries .<id>.mp4.tmp and .<id>.json.tmp.
_OURS = re.compile(r"^(?P<temporary>\.)?(?P<id>video-[0-9a-f]{16})\.(?P<kind>mp4|json)(?(temporary)\.tmp)$")
_RECORD_VERSION = 1
_NOT_PERSISTED = ("job", "cancelled_by_client", "deleted")
ENCODING_PROGRESS = 99  # the denoising is done, the MP4 is being written


@dataclass(frozen=True)
class VideoStorageSettings:
    directory: Path | None = None  # None: a temporary directory per server, removed when it stops
    max_age_s: int = 24 * 3600  # a finished video (file and record) is kept this long
    max_bytes: int = 10 * 1024**3  # all MP4 files together
    max_videos: int = 1000  # finished videos kept (failed ones count too)

    def __post_init__(self) -> None:
        for name in ("max_age_s", "max_bytes", "max_videos"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(eq=False)
class VideoRecord:
    """One video job as the API shows it; the fields up to `file_bytes` are persisted."""

    id: str
    model: str
    prompt: str
    seconds: str  # as requested, or derived from num_frames / fps
    size: str  # "WxH" as checked (rounded), or "auto" until done; then the real size
    fps: int
    seed: int
    num_frames: int | None  # as checked; then the real count
    created_at: float
    status: VideoStatus = "queued"  # final values only once finished; `state()` gives the live one
    completed_at: float | None = None
    expires_at: float | None = None
    error: JobError | None = None
    width: int | None = None
    height: int | None = None
    timings_ms: dict[str, float] | None = None
    step_cache: dict[str, Any] | None = None
    file_bytes: int = 0
    job: Job | None = field(default=None, repr=False)  # the scheduler's job until the record is final
    cancelled_by_client: bool = field(default=False, repr=False)
    deleted: bool = field(default=False, repr=False)  # gone from the store; its finisher discards what it writes

    @property
    def finished(self) -> bool:
        return self.job is None

    @property
    def ended_at(self) -> float:
        """When it finished, for eviction; a job a restart interrupted has only its creation time."""
        return self.completed_at if self.completed_at is not None else self.created_at

    def state(self) -> tuple[VideoStatus, int]:
        """(status, progress 0-100) now."""
        job = self.job
        if job is None:
            return self.status, 100 if self.status == "completed" else 0
        if job.status == "queued":
            return "queued", 0
        if job.status == "in_progress":
            return "in_progress", job.progress
        return "in_progress", ENCODING_PROGRESS  # the job ended; the record is being finished

    def to_json(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_PERSISTED}
        values["error"] = dataclasses.asdict(self.error) if self.error else None
        return {"version": _RECORD_VERSION, **values}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VideoRecord:
        data = dict(data)
        if data.pop("version", None) != _RECORD_VERSION:
            raise ValueError("unknown record version")
        error = data.pop("error", None)
        if set(data) & set(_NOT_PERSISTED):
            raise ValueError("unknown fields")
        record = cls(**data)
        record.error = JobError(**error) if error else None
        if not isinstance(record.id, str) or not VIDEO_ID.match(record.id):
            raise ValueError(f"bad id {record.id!r}")
        times = (record.created_at, record.completed_at or 0.0, record.expires_at or 0.0)
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in times):
            raise ValueError("bad times")
        if not isinstance(record.file_bytes, int) or record.file_bytes < 0:
            raise ValueError(f"bad file_bytes {record.file_bytes!r}")
        return record


class VideoDirectoryInUse(ValueError):
    pass


class VideoStore:
    """A video job is a scheduler job (the same queue and engine as images) plus a `VideoRecord`
    that outlives it: `add` starts a task that waits for the job whether or not anyone polls, encodes
    the frames (and their sound) to an MP4 (media.encode_video_output, in a thread, while the next job already
    runs) and keeps the file until the video is deleted or evicted.

    Storage, one directory (`--video-dir`; default a fresh temporary one per server, removed when
    it stops): `<id>.mp4` and `<id>.json` (the record) per video, both written to a temporary name
    (`.<id>.mp4.tmp`) and renamed, so a crash never leaves a half file under a video's name, and a
    failed write (a full disk) removes its temporary at once. The directory is locked (flock) while
    a server uses it. Files of ours are exactly those names (`video-` and 16 hex digits); the store
    never deletes anything else. Opening a directory a previous server left:
    - completed videos whose file is there stay listed and downloadable until they expire;
    - jobs that were queued or running end `failed` with code `server_restarted` (never
      `in_progress` forever), keeping their own times: no `completed_at` (when they stopped is not
      known), expiring `max_age_s` after they were created;
    - regular files of ours with no completed record (MP4s, temporaries) are deleted: a leftover
      file is never served under another video's id. A record of ours that cannot be read is left
      alone with its MP4, and an entry of ours that is not a regular file (a directory, a link) is
      skipped, each with a warning.

    Eviction, checked whenever the store is used: a finished video (completed or failed) expires
    `max_age_s` after it finished (file and record go); beyond `max_videos` finished videos, or
    `max_bytes` of files, the oldest finished ones go first (by when they finished, or were created
    where that is not known; the newest video is kept even when it alone passes `max_bytes`).
    Deleting a video whose MP4 is being written removes it at once; the finisher discards the file.
    """

    def __init__(self, settings: VideoStorageSettings, scheduler: Scheduler) -> None:
        self.settings = settings
        self.scheduler = scheduler
        self.directory: Path | None = None
        self._temporary = settings.directory is None
        self._lock_file: Any = None
        self._records: dict[str, VideoRecord] = {}  # in creation order
        self._finishers: set[asyncio.Task] = set()

    # ---- lifecycle ----------------------------------------------------------------------------

    def open(self) -> None:
        """Take the directory (create, lock, read what a previous server left). Raises VideoDirectoryInUse."""
        if self._temporary:
            self.directory = Path(tempfile.mkdtemp(prefix="vllm-omni-videos-"))
        else:
            self.directory = Path(self.settings.directory).expanduser().resolve()
            self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.directory / ".lock", "w")  # noqa: SIM115 - held until close()
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
            raise VideoDirectoryInUse(
                f"video directory {self.directory} is in use by another server; give each server its own --video-dir"
            ) from None
        if not self._temporary:
            self._load()
        logger.info(
            "Videos are kept in %s%s (for %d s after they finish; at most %d videos and %d bytes)",
            self.directory,
            " (temporary: removed at exit)" if self._temporary else "",
            self.settings.max_age_s,
            self.settings.max_videos,
            self.settings.max_bytes,
        )

    async def close(self, grace_s: float = 30.0) -> None:
        """Let videos being finished finish (records of ended jobs are written), then let the directory go."""
        if self._finishers:
            _, pending = await asyncio.wait(set(self._finishers), timeout=grace_s)
            for task in pending:
                task.cancel()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None
        if self._temporary and self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _load(self) -> None:
        entries: dict[str, list[tuple[Path, str]]] = {}  # id -> its entries of ours, with their kind
        for path in sorted(self.directory.iterdir()):
            match = _OURS.match(path.name)
            if match is None:
                continue  # not ours: left alone
            if path.is_symlink() or not path.is_file():
                logger.warning("Skipping %s in the video directory: not a regular file (not written by us)", path)
                continue
            entries.setdefault(match["id"], []).append((path, "temporary" if match["temporary"] else match["kind"]))
        unreadable: set[str] = set()
        for video_id, files in entries.items():
            path = next((p for p, kind in files if kind == "json"), None)
            if path is None:
                continue
            try:
                record = VideoRecord.from_json(json.loads(path.read_text()))
                if record.id != video_id:
                    raise ValueError(f"record of {record.id} in the wrong file")
            except (OSError, ValueError, TypeError) as exc:
                logger.warning("Leaving alone an unreadable video record %s (and its MP4, if any): %s", path, exc)
                unreadable.add(video_id)
                continue
            if record.status not in ("completed", "failed"):
                # It stopped at a moment no one knows: it keeps its own times (no completed_at, not the
                # restart's time, which would make it the newest and evict finished videos before it).
                record.status = "failed"
                record.error = JobError("server_restarted", "the server restarted before this video was finished")
                record.expires_at = record.created_at + self.settings.max_age_s
                self._save(record)
            elif record.status == "completed":
                file = self.video_path(record)
                if not _is_regular_file(file) or file.stat().st_size != record.file_bytes:
                    record.status = "failed"
                    record.error = JobError("server_error", "the video file is missing from the video directory")
                    record.file_bytes = 0
                    self._save(record)
            self._records[record.id] = record
        self._records = dict(sorted(self._records.items(), key=lambda item: (item[1].created_at, item[0])))
        for video_id, files in entries.items():
            record = self._records.get(video_id)
            for path, kind in files:
                if kind == "temporary" or (
                    kind == "mp4" and video_id not in unreadable and (record is None or record.status != "completed")
                ):
                    logger.info("Removing %s: no completed video owns it", path)
                    _unlink_regular_file(path)
        restarted = sum(r.error is not None and r.error.code == "server_restarted" for r in self._records.values())
        logger.info("Found %d video(s) in %s (%d ended by the restart)", len(self._records), self.directory, restarted)
        self._sweep()

    # ---- records ------------------------------------------------------------------------------

    def add(self, job: Job, *, model: str, prompt: str, seconds: str, size: str, fps: int) -> VideoRecord:
        """A record for a job just submitted; it is finished in the background, whoever polls."""
        request = job.request
        record = VideoRecord(
            id=job.id,
            model=model,
            prompt=prompt,
            seconds=seconds,
            size=size,
            fps=fps,
            seed=request.seed,
            num_frames=request.num_frames,
            created_at=job.created_at,
            job=job,
        )
        self._records[record.id] = record
        self._save(record)
        task = asyncio.create_task(self._finish(record), name=f"finish-{record.id}")
        self._finishers.add(task)
        task.add_done_callback(self._finishers.discard)
        self._sweep()
        return record

    def get(self, video_id: str) -> VideoRecord | None:
        self._sweep()
        return self._records.get(video_id)

    def newest_first(self) -> list[VideoRecord]:
        self._sweep()
        return list(reversed(self._records.values()))

    def video_path(self, record: VideoRecord) -> Path:
        return self.directory / f"{record.id}.mp4"

    def delete(self, video_id: str) -> bool | None:
        """None: no such video. True: deleted with its file (a video whose job ended and whose MP4 is
        being written too: the finisher discards the file). False: a queued or running job, cancelled
        (it stops at its next step and ends failed, code "cancelled"; a second delete removes it)."""
        record = self.get(video_id)
        if record is None:
            return None
        if record.job is not None and not record.job.finished:
            record.cancelled_by_client = True
            self.scheduler.cancel(record.id, "deleted by the client")
            return False
        record.deleted = True
        self._remove(record, "deleted by the client")
        return True

    # ---- finishing ----------------------------------------------------------------------------

    async def _finish(self, record: VideoRecord) -> None:
        job = record.job
        try:
            await job.wait()
            if record.deleted:
                pass  # deleted as its job ended: nothing to write
            elif job.status == "completed" and record.cancelled_by_client:
                # Deleted while its frames were decoded: nobody wants the file.
                record.status, record.error = "failed", JobError("cancelled", "cancelled: deleted by the client")
            elif job.status == "completed":
                output = job.result
                job.result = None  # the frames are held by this task only until they are written
                record.error = await self._write_video(record, output)
                if record.error is not None:
                    record.status = "failed"
                elif not record.deleted:
                    record.status = "completed"
                    record.width, record.height, record.num_frames = output.width, output.height, output.num_frames
                    record.size = f"{output.width}x{output.height}"
                    record.timings_ms = {k: round(v, 2) for k, v in output.timings_ms.items()}
                    record.step_cache = output.step_cache
            else:
                record.status = "failed"
                record.error = job.error or JobError("server_error", f"the job ended {job.status}")
            self._end(record, time.time())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a record must never stay in progress
            logger.error("Video %s: finishing failed: %s", record.id, exc, exc_info=exc)
            record.status, record.error = "failed", JobError("server_error", f"finishing failed: {one_line(exc)}")
            self._end(record, time.time())
        finally:
            record.job = None
            self.scheduler.forget(job.id)
            if record.deleted:
                self._remove_files(record)  # what was written while it was being deleted
        if record.deleted:
            logger.info("Video %s: deleted while it was being finished; nothing kept", record.id)
        else:
            logger.info("Video %s %s%s", record.id, record.status, f" ({record.error.code})" if record.error else "")
        self._sweep()

    async def _write_video(self, record: VideoRecord, output: Any) -> JobError | None:
        """Encode the job's video (and its sound, where the model makes some) into an MP4 and store it (in threads:
        the next job runs meanwhile); the error, if any, for the client."""
        from vllm_omni.entrypoints.openai import media

        try:
            data = await asyncio.to_thread(media.encode_video_output, output)
        except Exception as exc:  # noqa: BLE001 - the job fails, the server goes on
            logger.error("Video %s: could not encode the MP4: %s", record.id, exc, exc_info=exc)
            return JobError("server_error", f"encoding the MP4 failed: {one_line(exc)}")
        if record.deleted:
            return None
        try:
            await asyncio.to_thread(_write_file, self.video_path(record), data)
        except OSError as exc:
            logger.error("Video %s: could not write its MP4 to %s: %s", record.id, self.directory, exc)
            return JobError("server_error", f"could not store the MP4 on the server: {exc.strerror or one_line(exc)}")
        record.file_bytes = len(data)
        return None

    def _end(self, record: VideoRecord, now: float) -> None:
        """A final status is set: date it and write the record."""
        record.completed_at = now
        record.expires_at = now + self.settings.max_age_s
        self._save(record)

    # ---- storage ------------------------------------------------------------------------------

    def _save(self, record: VideoRecord) -> None:
        if record.deleted:
            return  # its record was removed; never written again
        try:
            _write_file(self.directory / f"{record.id}.json", json.dumps(record.to_json()).encode())
        except OSError as exc:  # a full disk loses persistence, not the job
            logger.error("Video %s: cannot write its record: %s", record.id, exc)

    def _remove(self, record: VideoRecord, why: str) -> None:
        self._records.pop(record.id, None)
        self._remove_files(record)
        logger.info("Video %s removed: %s", record.id, why)

    def _remove_files(self, record: VideoRecord) -> None:
        for suffix in (".mp4", ".json"):
            _unlink_regular_file(self.directory / f"{record.id}{suffix}")

    def _sweep(self) -> None:
        """Expire and evict finished videos (see the module's docstring)."""
        now = time.time()
        finished = sorted((r for r in self._records.values() if r.finished), key=lambda r: (r.ended_at, r.created_at))
        for record in [r for r in finished if r.expires_at is not None and r.expires_at <= now]:
            self._remove(record, f"expired ({self.settings.max_age_s} s after it finished)")
            finished.remove(record)
        while len(finished) > self.settings.max_videos:
            self._remove(finished.pop(0), f"evicted (more than {self.settings.max_videos} videos kept)")
        stored = [r for r in finished if r.file_bytes]
        total = sum(r.file_bytes for r in stored)
        while total > self.settings.max_bytes and len(stored) > 1:
            record = stored.pop(0)
            total -= record.file_bytes
            self._remove(record, f"evicted (the videos passed {self.settings.max_bytes} bytes)")


def _write_file(path: Path, data: bytes) -> None:
    """`data` under `path`'s name, whole or not at all: written to a temporary name and renamed; a
    failed write (a full disk) removes the temporary, so it holds no space and is never left behind."""
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        temporary.write_bytes(data)
        os.replace(temporary, path)
    except BaseException:
        _unlink_regular_file(temporary)
        raise


def _is_regular_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def _unlink_regular_file(path: Path) -> None:
    """Unlink a file of ours; a directory or a link someone put under that name is left alone."""
    if _is_regular_file(path):
        with contextlib.suppress(OSError):
            path.unlink()
