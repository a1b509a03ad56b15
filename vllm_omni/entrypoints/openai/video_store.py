"""The videos API's jobs: a record per video, its MP4 on disk, persistence across restarts, eviction.

No HTTP here (routes/videos.py translates). A video job is a scheduler job (scheduler.py: the
same FIFO queue and engine as images) plus a `VideoRecord` that outlives it: `add` starts a
task that waits for the job whether or not anyone polls, encodes the frames to an MP4
(media.encode_mp4, in a thread, while the next job already runs) and keeps the file until the
video is deleted or evicted.

Storage, one directory (`--video-dir`; default a fresh temporary one per server, removed when
it stops): `<id>.mp4` and `<id>.json` (the record) per video, both written to a temporary name
and renamed, so a crash never leaves a half file under a video's name. The directory is locked
(flock) while a server uses it. Opening a directory a previous server left:
- completed videos whose file is there stay listed and downloadable until they expire;
- jobs that were queued or running end `failed` with code `server_restarted` (never
  `in_progress` forever);
- files of ours (`video-*.mp4`, temporaries) with no completed record are deleted: a
  leftover file is never served under another video's id. Other files are left alone.

Eviction, checked whenever the store is used: a finished video (completed or failed) expires
`max_age_s` after it finished (file and record go); beyond `max_videos` finished videos, or
`max_bytes` of files, the oldest finished ones go first (the newest video is kept even when
it alone passes `max_bytes`).
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
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vllm_omni.entrypoints.openai.scheduler import Job, JobError, Scheduler, one_line
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

VideoStatus = Literal["queued", "in_progress", "completed", "failed"]
VIDEO_ID = re.compile(r"^video-[0-9a-f]{16}$")  # the scheduler's ids with prefix "video"
_OURS = re.compile(r"^\.?video-[0-9a-f]{16}(\.mp4|\.json)(\.tmp)?$")  # files this store may delete
_RECORD_VERSION = 1
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
    file_bytes: int = 0
    job: Job | None = field(default=None, repr=False)  # the scheduler's job until the record is final
    cancelled_by_client: bool = field(default=False, repr=False)

    @property
    def finished(self) -> bool:
        return self.job is None

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
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("job",)}
        values.pop("cancelled_by_client")
        values["error"] = dataclasses.asdict(self.error) if self.error else None
        return {"version": _RECORD_VERSION, **values}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VideoRecord:
        data = dict(data)
        if data.pop("version", None) != _RECORD_VERSION:
            raise ValueError("unknown record version")
        error = data.pop("error", None)
        record = cls(**data)
        record.error = JobError(**error) if error else None
        if not VIDEO_ID.match(record.id):
            raise ValueError(f"bad id {record.id!r}")
        return record


class VideoDirectoryInUse(ValueError):
    pass


class VideoStore:
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
        now = time.time()
        for path in sorted(self.directory.glob("video-*.json")):
            try:
                record = VideoRecord.from_json(json.loads(path.read_text()))
                if record.id != path.stem:
                    raise ValueError(f"record of {record.id} in the wrong file")
            except (OSError, ValueError, TypeError) as exc:
                logger.warning("Ignoring and removing unreadable video record %s: %s", path, exc)
                path.unlink(missing_ok=True)
                continue
            if record.status not in ("completed", "failed"):
                record.status = "failed"
                record.error = JobError("server_restarted", "the server restarted before this video was finished")
                self._end(record, now)
            elif record.status == "completed":
                file = self.video_path(record)
                if not file.is_file() or file.stat().st_size != record.file_bytes:
                    record.status = "failed"
                    record.error = JobError("server_error", "the video file is missing from the video directory")
                    record.file_bytes = 0
                    self._end(record, now)
            self._records[record.id] = record
        self._records = dict(sorted(self._records.items(), key=lambda item: (item[1].created_at, item[0])))
        for path in self.directory.iterdir():
            if not _OURS.match(path.name) or path.suffix == ".json":
                continue
            record = self._records.get(path.name.lstrip(".").split(".")[0])
            if path.suffix == ".tmp" or record is None or record.status != "completed":
                logger.info("Removing %s: no completed video owns it", path)
                path.unlink(missing_ok=True)
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
        """None: no such video. True: a finished video, deleted with its file. False: a queued or
        running job, cancelled (it stops at its next step and ends failed, code "cancelled")."""
        record = self.get(video_id)
        if record is None:
            return None
        if not record.finished:
            record.cancelled_by_client = True
            self.scheduler.cancel(record.id, "deleted by the client")
            return False
        self._remove(record, "deleted by the client")
        return True

    # ---- finishing ----------------------------------------------------------------------------

    async def _finish(self, record: VideoRecord) -> None:
        job = record.job
        try:
            await job.wait()
            if job.status == "completed" and record.cancelled_by_client:
                # Deleted while its frames were decoded: nobody wants the file.
                record.status, record.error = "failed", JobError("cancelled", "cancelled: deleted by the client")
            elif job.status == "completed":
                output = job.result
                job.result = None  # the frames are held by this task only until they are written
                try:
                    record.file_bytes = await asyncio.to_thread(self._write_video, record, output.images[0], output.fps)
                except Exception as exc:  # noqa: BLE001 - the job fails, the server goes on
                    logger.error("Video %s: could not write the MP4: %s", record.id, exc, exc_info=exc)
                    record.status = "failed"
                    record.error = JobError("server_error", f"encoding failed: {one_line(exc)}")
                else:
                    record.status = "completed"
                    record.width, record.height, record.num_frames = output.width, output.height, output.num_frames
                    record.size = f"{output.width}x{output.height}"
                    record.timings_ms = {k: round(v, 2) for k, v in output.timings_ms.items()}
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
        logger.info("Video %s %s%s", record.id, record.status, f" ({record.error.code})" if record.error else "")
        self._sweep()

    def _write_video(self, record: VideoRecord, frames: Any, fps: int) -> int:
        from vllm_omni.entrypoints.openai.media import encode_mp4

        data = encode_mp4(frames, fps)
        path = self.video_path(record)
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_bytes(data)
        os.replace(temporary, path)
        return len(data)

    def _end(self, record: VideoRecord, now: float) -> None:
        """A final status is set: date it and write the record."""
        record.completed_at = now
        record.expires_at = now + self.settings.max_age_s
        self._save(record)

    # ---- storage ------------------------------------------------------------------------------

    def _save(self, record: VideoRecord) -> None:
        path = self.directory / f"{record.id}.json"
        temporary = path.with_name(f".{path.name}.tmp")
        try:
            temporary.write_text(json.dumps(record.to_json()))
            os.replace(temporary, path)
        except OSError as exc:  # a full disk loses persistence, not the job
            logger.error("Video %s: cannot write its record: %s", record.id, exc)

    def _remove(self, record: VideoRecord, why: str) -> None:
        self._records.pop(record.id, None)
        for suffix in (".mp4", ".json"):
            with contextlib.suppress(OSError):
                (self.directory / f"{record.id}{suffix}").unlink(missing_ok=True)
        logger.info("Video %s removed: %s", record.id, why)

    def _sweep(self) -> None:
        """Expire and evict finished videos (see the module's docstring)."""
        now = time.time()
        finished = sorted(
            (r for r in self._records.values() if r.finished), key=lambda r: (r.completed_at or 0.0, r.created_at)
        )
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
