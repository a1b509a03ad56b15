"""The videos API's store without HTTP or workers: jobs finished by hand, files in a test directory.

Covers the MP4 and the record written when a job completes, what a restart finds (finished
videos kept, interrupted jobs failed with their own times, leftover files of ours removed,
unreadable records, other files and entries of the wrong kind untouched), one server per
directory, deletion and cancellation (also while the MP4 is written), a full disk failing one
video only, and eviction by age, count and bytes.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import io
import json
import os
import threading
import time
from pathlib import Path

import av
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vllm_omni.diffusion.engine.job import Job, JobError
from vllm_omni.diffusion.request import DiffusionOutput, DiffusionRequest
from vllm_omni.entrypoints.openai import media
from vllm_omni.entrypoints.openai.video_store import (
    VideoDirectoryInUse,
    VideoRecord,
    VideoStorageSettings,
    VideoStore,
)

FRAMES = 5
WAIT_S = 10  # a hang guard for conditions that hold within a second


class FakeScheduler:
    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.forgotten: list[str] = []

    def cancel(self, job_id: str, reason: str = "cancelled") -> None:
        self.cancelled.append(job_id)

    def forget(self, job_id: str) -> None:
        self.forgotten.append(job_id)


def new_job(number: int) -> Job:
    video_id = f"video-{number:016x}"
    request = DiffusionRequest(request_id=video_id, prompt="p", width=32, height=16, num_frames=FRAMES, fps=8, seed=3)
    return Job(video_id, request)


def complete(job: Job, shade: int = 100) -> None:
    frames = np.full((FRAMES, 16, 32, 3), shade, dtype=np.uint8)
    output = DiffusionOutput(job.id, [frames], 3, 16, 32, num_frames=FRAMES, fps=8, timings_ms={"total": 5.0})
    job.status, job.result = "completed", output
    job._done.set()


def end(job: Job, status: str, error: JobError) -> None:
    job.status, job.error = status, error
    job._done.set()


def add(store: VideoStore, job: Job) -> VideoRecord:
    return store.add(job, model="tiny", prompt="p", seconds="0.62", size="32x16", fps=8)


async def finished(record: VideoRecord) -> VideoRecord:
    deadline = time.monotonic() + WAIT_S
    while not record.finished:
        assert time.monotonic() < deadline, f"{record.id} never finished"
        await asyncio.sleep(0.005)
    return record


def opened(directory, **limits) -> VideoStore:
    store = VideoStore(VideoStorageSettings(directory=directory, **limits), FakeScheduler())
    store.open()
    return store


def test_a_completed_job_becomes_an_mp4_and_a_record_that_a_restart_keeps(tmp_path):
    async def scenario():
        store = opened(tmp_path)
        job = new_job(1)
        record = add(store, job)
        assert record.state() == ("queued", 0)
        assert json.loads((tmp_path / f"{job.id}.json").read_text())["status"] == "queued"
        job.status, job.progress = "in_progress", 40
        assert record.state() == ("in_progress", 40)
        complete(job)
        await finished(record)
        assert record.state() == ("completed", 100) and store.scheduler.forgotten == [job.id]
        assert (record.width, record.height, record.num_frames, record.size) == (32, 16, FRAMES, "32x16")
        assert record.expires_at == record.completed_at + store.settings.max_age_s
        data = (tmp_path / f"{job.id}.mp4").read_bytes()
        assert len(data) == record.file_bytes
        with av.open(io.BytesIO(data)) as container:
            assert len(list(container.decode(video=0))) == FRAMES
        await store.close()

        again = opened(tmp_path)
        kept = again.get(job.id)
        assert (kept.state(), kept.file_bytes, kept.seed) == (("completed", 100), len(data), 3)
        assert kept.timings_ms == {"total": 5.0}
        await again.close()
        assert (tmp_path / f"{job.id}.mp4").is_file()  # a directory given by the user stays

    asyncio.run(scenario())


def test_a_video_with_sound_becomes_an_mp4_with_an_aac_track_as_long_as_the_video(tmp_path):
    """A model that makes sound (DiffusionOutput.audio): the MP4 carries it beside the frames."""
    rate, seconds = 24000, FRAMES / 8
    t = np.arange(int(rate * seconds)) / rate
    sound = np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 660 * t)]).astype(np.float32) * 0.5

    async def scenario():
        store = opened(tmp_path)
        job = new_job(1)
        record = add(store, job)
        complete(job)
        job.result.audio, job.result.audio_sample_rate = [sound], rate
        await finished(record)
        assert record.state() == ("completed", 100)
        with av.open(io.BytesIO((tmp_path / f"{job.id}.mp4").read_bytes())) as container:
            video, audio = container.streams.video[0], container.streams.audio[0]
            assert (video.codec_context.name, audio.codec_context.name) == ("h264", "aac")
            assert (audio.rate, audio.channels) == (rate, 2)
            assert float(audio.duration * audio.time_base) == pytest.approx(seconds, abs=0.05)
            assert float(video.duration * video.time_base) == pytest.approx(seconds, abs=0.01)
            assert len(list(container.decode(video=0))) == FRAMES
        await store.close()

    asyncio.run(scenario())


def test_encode_mp4_takes_mono_or_stereo_sound_and_refuses_other_shapes():
    frames = np.zeros((3, 16, 32, 3), dtype=np.uint8)
    mono = media.encode_mp4(frames, 8, audio=np.zeros((1, 3000), np.float32), sample_rate=8000)
    with av.open(io.BytesIO(mono)) as container:
        assert container.streams.audio[0].channels == 1
    with av.open(io.BytesIO(media.encode_mp4(frames, 8))) as container:
        assert len(container.streams.audio) == 0  # no sound: no audio track
    for audio, rate in ((np.zeros((3, 100), np.float32), 8000), (np.zeros(100, np.float32), 8000), (mono, None)):
        with pytest.raises(ValueError, match="expected audio"):
            media.encode_mp4(frames, 8, audio=np.zeros((1, 10)) if audio is mono else audio, sample_rate=rate)


def test_the_same_frames_make_the_same_mp4_every_time_whatever_the_heap_held():
    # libx264's macroblock tree read memory it never wrote: in a process whose heap had been used (a server's),
    # the same frames came out as different bytes, most times, at most sizes (208x144 and 848x480 among them).
    g = torch.Generator().manual_seed(1)
    coarse = torch.rand(9, 3, 18, 26, generator=g)
    frames = (F.interpolate(coarse, size=(144, 208), mode="bilinear") * 255).permute(0, 2, 3, 1).to(torch.uint8)
    rng = np.random.default_rng(0)
    digests = set()
    for _ in range(6):
        garbage = [rng.integers(0, 256, int(n), dtype=np.uint8) for n in rng.integers(1000, 3_000_000, 20)]
        del garbage  # freed: the next allocations reuse what it held
        digests.add(hashlib.sha256(media.encode_mp4(frames.numpy(), 8)).hexdigest())
    assert len(digests) == 1


def left_record(number: int, status: str, age_s: float = 10, file_bytes: int = 0) -> VideoRecord:
    """A record as a previous server wrote it, created `age_s` ago (completed ones finished a second later)."""
    created = time.time() - age_s
    done = created + 1 if status == "completed" else None
    return VideoRecord(
        new_job(number).id, "tiny", "p", "1", "32x16", 8, 3, FRAMES, created, status, done, file_bytes=file_bytes
    )


def leave(directory: Path, *records: VideoRecord) -> None:
    for r in records:
        (directory / f"{r.id}.json").write_text(json.dumps(r.to_json()))
        if r.status == "completed":
            (directory / f"{r.id}.mp4").write_bytes(b"m" * r.file_bytes)


def test_a_restart_fails_interrupted_jobs_and_removes_leftover_files_of_ours_only(tmp_path, capsys):
    record = left_record

    # What a server killed mid-run leaves behind.
    left = {
        "queued": record(1, "queued"),
        "done": record(2, "completed", file_bytes=4),
        "file_gone": record(3, "completed", file_bytes=4),
    }
    leave(tmp_path, *left.values())
    (tmp_path / f"{left['file_gone'].id}.mp4").unlink()
    orphan = tmp_path / f"{new_job(4).id}.mp4"  # its record was never written, or was deleted
    orphan.write_bytes(b"half")
    half_written = tmp_path / f".{new_job(1).id}.mp4.tmp"
    half_written.write_bytes(b"ha")
    # Records of ours it cannot read (damaged, or from a newer server) stay, with their MP4.
    unreadable = [tmp_path / f"{new_job(5).id}.json", tmp_path / f"{new_job(6).id}.json"]
    unreadable[0].write_text("{not json")
    unreadable[1].write_text(json.dumps({**left_record(6, "completed").to_json(), "version": 99}))
    unreadable.append(tmp_path / f"{new_job(6).id}.mp4")
    unreadable[2].write_bytes(b"mp4?")
    foreign = [tmp_path / "notes.txt", tmp_path / "holiday.mp4", tmp_path / "video-notes.json"]
    for path in foreign:
        path.write_text("not ours")
    # Entries under our names that the store never makes: skipped, not fatal.
    odd = [
        tmp_path / f"{new_job(7).id}.mp4",
        tmp_path / f"{new_job(8).id}.json",
        tmp_path / f".{new_job(9).id}.mp4.tmp",
    ]
    for path in odd:
        path.mkdir()
    linked = tmp_path / f"{new_job(10).id}.mp4"
    linked.symlink_to(tmp_path / "notes.txt")

    async def scenario():
        store = opened(tmp_path)
        restarted = store.get(left["queued"].id)
        assert restarted.state() == ("failed", 0) and restarted.error.code == "server_restarted"
        # It keeps its own times: when it stopped is not known, and it expires counting from its creation.
        assert restarted.completed_at is None
        assert restarted.expires_at == left["queued"].created_at + store.settings.max_age_s
        assert json.loads((tmp_path / f"{restarted.id}.json").read_text())["status"] == "failed"
        assert store.get(left["done"].id).state() == ("completed", 100)
        gone = store.get(left["file_gone"].id)
        assert gone.error.code == "server_error" and gone.completed_at == left["file_gone"].completed_at
        assert not orphan.exists() and not half_written.exists()
        assert [path.read_bytes()[:4] for path in unreadable] == [b"{not", b'{"ve', b"mp4?"]
        assert all(path.read_text() == "not ours" for path in foreign)
        assert all(path.is_dir() for path in odd) and linked.is_symlink()
        assert [r.id for r in store.newest_first()] == sorted((r.id for r in left.values()), reverse=True)
        await store.close()
        log = capsys.readouterr().err
        assert all(f"unreadable video record {path}" in log for path in unreadable[:2]), log
        assert all(f"Skipping {path} in the video directory: not a regular file" in log for path in [*odd, linked])

    asyncio.run(scenario())


def test_after_a_restart_interrupted_jobs_are_evicted_by_their_own_age_not_the_restart_time(tmp_path):
    oldest_interrupted = left_record(1, "in_progress", age_s=400)
    completed = [left_record(2, "completed", age_s=300, file_bytes=4), left_record(3, "completed", 100, 4)]
    newest_interrupted = left_record(4, "queued", age_s=50)
    leave(tmp_path, oldest_interrupted, *completed, newest_interrupted)

    async def scenario():
        store = opened(tmp_path, max_videos=3)
        # Four finished, three kept: the interrupted job created first is the oldest and goes; both
        # completed videos stay (dated by the restart, the interrupted jobs would have evicted the older one).
        kept = [newest_interrupted.id, completed[1].id, completed[0].id]
        assert [r.id for r in store.newest_first()] == kept
        assert not (tmp_path / f"{oldest_interrupted.id}.json").exists()
        assert all((tmp_path / f"{r.id}.mp4").is_file() for r in completed)
        await store.close()

    asyncio.run(scenario())


def test_one_server_at_a_time_per_directory_and_the_default_one_is_removed_at_close(tmp_path):
    async def scenario():
        store = opened(tmp_path)
        with pytest.raises(VideoDirectoryInUse, match="in use by another server"):
            opened(tmp_path)
        await store.close()
        await opened(tmp_path).close()  # free again

        temporary = VideoStore(VideoStorageSettings(), FakeScheduler())
        temporary.open()
        job = new_job(1)
        complete(job)
        await finished(add(temporary, job))
        assert (temporary.directory / f"{job.id}.mp4").is_file()
        await temporary.close()
        assert not temporary.directory.exists()

    asyncio.run(scenario())


def test_delete_cancels_an_unfinished_job_and_removes_a_finished_one(tmp_path):
    async def scenario():
        store = opened(tmp_path)
        running, done = new_job(1), new_job(2)
        running_record, done_record = add(store, running), add(store, done)
        complete(done)
        await finished(done_record)

        assert store.delete(running.id) is False and store.scheduler.cancelled == [running.id]
        end(running, "cancelled", JobError("cancelled", "cancelled: deleted by the client"))
        await finished(running_record)
        assert running_record.state() == ("failed", 0) and running_record.error.code == "cancelled"

        assert store.delete(done.id) is True
        assert store.get(done.id) is None and list(tmp_path.glob(f"{done.id}*")) == []
        assert store.delete(done.id) is None
        # A job whose frames were decoded as it was deleted is not written.
        late = new_job(3)
        late_record = add(store, late)
        late.status = "in_progress"
        assert store.delete(late.id) is False
        complete(late)
        await finished(late_record)
        assert late_record.error.code == "cancelled" and not (tmp_path / f"{late.id}.mp4").exists()
        await store.close()

    asyncio.run(scenario())


def test_a_delete_while_the_mp4_is_written_deletes_the_video_and_its_file_once_written(tmp_path, monkeypatch):
    encoding, release = threading.Event(), threading.Event()
    real_encode = media.encode_mp4

    def held_encode(frames, fps, **sound):
        encoding.set()
        assert release.wait(WAIT_S), "never released"
        return real_encode(frames, fps, **sound)

    monkeypatch.setattr(media, "encode_mp4", held_encode)

    async def scenario():
        store = opened(tmp_path)
        job = new_job(1)
        record = add(store, job)
        complete(job)
        assert await asyncio.to_thread(encoding.wait, WAIT_S)
        assert record.state() == ("in_progress", 99)  # the frames are in, the MP4 is being written

        assert store.delete(job.id) is True
        assert store.get(job.id) is None and store.newest_first() == []
        assert store.delete(job.id) is None
        release.set()
        await finished(record)
        assert list(tmp_path.glob(f"*{job.id}*")) == [] and store.scheduler.forgotten == [job.id]
        await store.close()
        again = opened(tmp_path)
        assert again.newest_first() == []
        await again.close()

    asyncio.run(scenario())


def test_a_full_disk_fails_that_video_leaving_no_partial_file_and_the_next_video_completes(tmp_path, monkeypatch):
    real_write = Path.write_bytes

    def write_until_the_disk_is_full(path, data):
        real_write(path, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    async def scenario():
        store = opened(tmp_path)
        job = new_job(1)
        record = add(store, job)
        with monkeypatch.context() as disk:
            disk.setattr(Path, "write_bytes", write_until_the_disk_is_full)  # the MP4 and the record's write
            complete(job)
            await finished(record)
        assert record.state() == ("failed", 0) and record.file_bytes == 0
        assert (record.error.code, record.error.message) == (
            "server_error",
            "could not store the MP4 on the server: No space left on device",
        )
        assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", f"{job.id}.json"]  # no partial file

        # Space again: the next video completes, with no restart.
        following = new_job(2)
        following_record = add(store, following)
        complete(following)
        await finished(following_record)
        assert following_record.state() == ("completed", 100)
        assert (tmp_path / f"{following.id}.mp4").stat().st_size == following_record.file_bytes > 0
        await store.close()

    asyncio.run(scenario())


def test_finished_videos_expire_and_the_oldest_go_first_beyond_the_count_or_bytes(tmp_path):
    async def finish_all(store, numbers, shade=100):
        records = []
        for number in numbers:
            job = new_job(number)
            records.append(add(store, job))
            complete(job, shade)
            await finished(records[-1])
        return records

    async def scenario():
        by_count = opened(tmp_path / "count", max_videos=2)
        first, second, third = await finish_all(by_count, [1, 2, 3])
        assert [r.id for r in by_count.newest_first()] == [third.id, second.id]
        assert not (tmp_path / "count" / f"{first.id}.mp4").exists()
        second.expires_at = time.time() - 1  # its age ran out
        assert by_count.get(second.id) is None and not (tmp_path / "count" / f"{second.id}.json").exists()
        await by_count.close()

        probe = opened(tmp_path / "probe")
        one_video = (await finish_all(probe, [9]))[0].file_bytes
        await probe.close()
        by_bytes = opened(tmp_path / "bytes", max_bytes=one_video + one_video // 2)
        first, second = await finish_all(by_bytes, [1, 2])
        assert [r.id for r in by_bytes.newest_first()] == [second.id]
        alone = opened(tmp_path / "alone", max_bytes=1)
        (kept,) = await finish_all(alone, [1])
        assert alone.get(kept.id) is not None  # the newest video stays even when it alone passes the limit
        for store in (by_bytes, alone):
            await store.close()

    asyncio.run(scenario())
