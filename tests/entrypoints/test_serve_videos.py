"""The videos API end to end: `vllm-omni serve tiny/hunyuan-video-1.5 --ulysses-degree 2` and the `openai` client.

One server process for the module (CPU workers), its videos kept in a test directory.
208x144 is 13x9 latent pixels; 9 frames are 3 latent frames: 351 video tokens, odd, so Ulysses
2 pads them. Covers create_and_poll and download (a real MP4 of the asked frames and size),
progress, cancellation by DELETE, deleting a finished video (its file goes, then 404), the list
newest first with its cursor, two jobs at once, JSON bodies, bad input naming the field, and a
`seconds` over the frame limit saying which lengths fit. POST /v1/videos/sync on the same server:
the bytes the async route stores for the same seed, a client that leaves has its job cancelled
(the request behind it runs next), and hostile bodies answered as the async route answers them.
Image-to-video runs on a server of its own (test_serve_image_to_video.py); here the upload
paths are covered by the text-to-video model refusing them.
"""

from __future__ import annotations

import base64
import io
import re
import time
from concurrent.futures import ThreadPoolExecutor

import av
import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI
from server_process import HTTP_TIMEOUT_S, open_request, sha256, start_server

MODEL = "tiny/hunyuan-video-1.5"
PROMPT = "A cat walks on the grass, realistic style."
SIZE = "208x144"
FAST = {"num_inference_steps": 2, "fps": 8}  # seconds="1" at 8 fps: 9 frames (k * 4 + 1)
SLOW_STEPS = 400  # ~20 s on CPU: such a job only ends quickly by being cancelled
POLL_S = 0.05

# slow: a real server process, started per module
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-videos")
    video_dir = root / "videos"
    srv = start_server(
        [MODEL, "--ulysses-degree", "2", "--max-steps", str(SLOW_STEPS), "--video-dir", str(video_dir)],
        root / "server.log",
    )
    srv.video_dir = video_dir
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)


def create(client, **extra):
    body = dict(FAST, seed=7)
    body.update(extra)
    return client.videos.create(model=MODEL, prompt=PROMPT, size=SIZE, seconds="1", extra_body=body)


def poll_until(client, video_id, done, timeout=HTTP_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        video = client.videos.retrieve(video_id)
        if done(video):
            return video
        time.sleep(POLL_S)
    raise AssertionError(f"video {video_id} never got there: {video}")


def finished(video) -> bool:
    return video.status in ("completed", "failed")


def decode_mp4(data: bytes):
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        return frames, stream.codec_context.name, stream.average_rate


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def test_create_and_poll_then_download_gives_a_playable_mp4_of_the_asked_frames_and_size(server, client):
    video = client.videos.create_and_poll(
        model=MODEL, prompt=PROMPT, size=SIZE, seconds="1", extra_body=dict(FAST, seed=7), poll_interval_ms=50
    )
    assert (video.status, video.progress, video.error) == ("completed", 100, None)
    assert (video.object, video.model, video.prompt, video.seconds, video.size) == ("video", MODEL, PROMPT, "1", SIZE)
    extra = video.model_extra
    assert (extra["seed"], extra["num_frames"], extra["fps"], extra["width"], extra["height"]) == (7, 9, 8, 208, 144)
    assert extra["timings_ms"]["total"] > 0
    assert video.created_at <= video.completed_at < video.expires_at

    data = client.videos.download_content(video.id).read()
    frames, codec, rate = decode_mp4(data)
    assert (len(frames), frames[0].shape, codec, rate) == (9, (144, 208, 3), "h264", 8)
    assert sha256((server.video_dir / f"{video.id}.mp4").read_bytes()) == sha256(data)


def test_a_job_answers_at_once_queued_and_reports_progress_then_delete_cancels_it(server, client):
    start = server.log_size()
    slow = create(client, num_inference_steps=SLOW_STEPS)
    assert (slow.status, slow.progress, slow.completed_at, slow.seconds, slow.size) == ("queued", 0, None, "1", SIZE)
    running = poll_until(client, slow.id, lambda v: v.status == "in_progress" and v.progress > 0)
    assert 0 < running.progress < 100
    early = httpx.get(f"{server.url}/v1/videos/{slow.id}/content")
    assert early.status_code == 409 and error_of(early)["code"] == "video_not_ready"  # no content before it completes

    deleted = client.videos.delete(slow.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (slow.id, "video.deleted", False)
    ended = poll_until(client, slow.id, finished)
    assert ended.status == "failed" and ended.error.code == "cancelled", ended
    stopped = server.wait_for_log(rf"request {slow.id} cancelled at step (\d+)", start)
    assert int(stopped.group(1)) < SLOW_STEPS // 2
    # The server goes on: the next job completes.
    following = client.videos.create_and_poll(
        model=MODEL, prompt=PROMPT, size=SIZE, seconds="1", extra_body=FAST, poll_interval_ms=50
    )
    assert following.status == "completed"
    # A second DELETE removes the cancelled job.
    assert client.videos.delete(slow.id).deleted is True
    with pytest.raises(NotFoundError):
        client.videos.retrieve(slow.id)


def test_two_jobs_submitted_together_both_complete_and_list_newest_first(server, client):
    first, second = create(client, seed=1), create(client, seed=2)
    for video in (first, second):
        assert poll_until(client, video.id, finished).status == "completed"
    page = client.videos.list(limit=1)
    assert [v.id for v in page.data] == [second.id] and page.has_more
    next_page = page.get_next_page()
    assert [v.id for v in next_page.data] == [first.id]
    newest = [v.id for v in client.videos.list(limit=100).data]
    assert newest.index(second.id) < newest.index(first.id)
    oldest = [v.id for v in client.videos.list(limit=100, order="asc").data]
    assert oldest == newest[::-1]


def test_deleting_a_finished_video_removes_it_and_its_file(server, client):
    video = client.videos.create_and_poll(
        model=MODEL, prompt=PROMPT, size=SIZE, seconds="1", extra_body=FAST, poll_interval_ms=50
    )
    path = server.video_dir / f"{video.id}.mp4"
    assert path.is_file()
    deleted = client.videos.delete(video.id)
    assert (deleted.id, deleted.deleted) == (video.id, True)
    assert not path.exists() and not (server.video_dir / f"{video.id}.json").exists()
    for response in (
        httpx.get(f"{server.url}/v1/videos/{video.id}"),
        httpx.get(f"{server.url}/v1/videos/{video.id}/content"),
        httpx.delete(f"{server.url}/v1/videos/{video.id}"),
    ):
        assert response.status_code == 404
        assert error_of(response)["type"] == "not_found_error"
    assert video.id not in [v.id for v in client.videos.list(limit=100).data]


def test_a_json_body_works_too_with_num_frames_winning_over_seconds(server):
    body = {"model": MODEL, "prompt": PROMPT, "size": SIZE, "seconds": 4, "num_frames": 6, **FAST}
    response = httpx.post(f"{server.url}/v1/videos", json=body)
    assert response.status_code == 200, response.text
    video = response.json()
    # 6 frames is rounded down to 5 (k * 4 + 1); the length reported is that of the frames run.
    assert (video["status"], video["num_frames"], video["seconds"]) == ("queued", 5, "0.62")
    assert response.headers["X-Request-Id"] == video["id"]


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"seconds": "abc"}, "seconds"),
        ({"seconds": "-1"}, "seconds"),
        ({"seconds": "100"}, "seconds"),  # 800 frames at 8 fps: over --max-frames
        ({"size": "abc"}, "size"),
        ({"size": "99999x144"}, "size"),
        # Over --max-tokens-per-step (131072): 256 x 256 tokens x 3 latent frames, too large at any
        # length; 1280x720 fits at 121 frames, not at 241 (10 s at 24 fps, or asked as num_frames).
        ({"size": "4096x4096"}, "size"),
        ({"size": "1280x720", "seconds": "10", "fps": 24}, "seconds"),
        ({"size": "1280x720", "num_frames": 241}, "num_frames"),
        ({"num_frames": 0}, "num_frames"),
        ({"num_frames": 100000}, "num_frames"),
        ({"num_frames": "many"}, "num_frames"),
        ({"num_inference_steps": 100000}, "num_inference_steps"),
        ({"fps": 0}, "fps"),
        ({"n": 2}, "n"),  # one job is one video
        ({"num_stepz": 2}, "num_stepz"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, client, fields, param):
    body = dict(FAST, prompt=PROMPT, model=MODEL, size=SIZE, seconds="1")
    body.update(fields)
    # As the openai client sends it (multipart form) ...
    with pytest.raises(BadRequestError) as refused:
        client.videos.create(prompt=PROMPT, extra_body={k: v for k, v in body.items() if k != "prompt"})
    assert refused.value.body["param"] == param, refused.value.body
    # ... and as JSON.
    response = httpx.post(f"{server.url}/v1/videos", json=body)
    assert response.status_code == 400 and error_of(response)["param"] == param, response.text


def test_a_model_not_served_is_a_404_naming_it(server, client):
    body = dict(FAST, model="sora-2", size=SIZE, seconds="1")
    with pytest.raises(NotFoundError) as refused:
        client.videos.create(prompt=PROMPT, extra_body=body)
    assert refused.value.body["param"] == "model" and refused.value.body["code"] == "model_not_found"
    response = httpx.post(f"{server.url}/v1/videos", json={**body, "prompt": PROMPT})
    assert response.status_code == 404 and error_of(response)["param"] == "model", response.text


def test_seconds_12_at_the_default_fps_is_a_400_saying_which_lengths_fit_and_at_what_fps_it_would(client):
    # At the default 24 fps, 12 s is 288 frames, over --max-frames (257).
    with pytest.raises(BadRequestError) as refused:
        client.videos.create(model=MODEL, prompt=PROMPT, size=SIZE, seconds="12")
    assert refused.value.body["param"] == "seconds"
    assert "seconds '4' or '8' fit at fps=24; 12 s fits at fps=21 or lower" in refused.value.body["message"]
    # As it says: at 21 fps, 12 s is 252 frames, run as 253 (4k + 1).
    body = dict(FAST, fps=21, num_inference_steps=SLOW_STEPS)
    video = client.videos.create(model=MODEL, prompt=PROMPT, size=SIZE, seconds="12", extra_body=body)
    assert (video.seconds, video.model_extra["num_frames"], video.model_extra["fps"]) == ("12", 253, 21)
    assert client.videos.delete(video.id).deleted is False  # only its frame count was wanted: cancelled
    assert poll_until(client, video.id, finished).error.code == "cancelled"
    assert client.videos.delete(video.id).deleted is True


def test_an_input_reference_is_refused_by_the_text_to_video_model_naming_it(server, client):
    png = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (64, 48), "orange").save(png, format="PNG")
    with pytest.raises(BadRequestError) as refused:
        client.videos.create(model=MODEL, prompt=PROMPT, input_reference=("cat.png", png.getvalue(), "image/png"))
    assert refused.value.body["param"] == "input_reference"
    data_url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    for response in (
        httpx.post(f"{server.url}/v1/videos", json={"prompt": PROMPT, "input_reference": {"image_url": data_url}}),
        # The form spelling of that object (the openai client's for nested fields).
        httpx.post(f"{server.url}/v1/videos", data={"prompt": PROMPT, "input_reference[image_url]": data_url}),
    ):
        assert response.status_code == 400 and error_of(response)["param"] == "input_reference"
        assert "not accepted" in error_of(response)["message"]
    remote = {"prompt": PROMPT, "input_reference": {"image_url": "https://example.com/cat.png"}}
    response = httpx.post(f"{server.url}/v1/videos", json=remote)
    assert response.status_code == 400 and "fetches nothing" in error_of(response)["message"]


def test_an_image_request_to_the_video_model_is_a_400_naming_model(server, client):
    with pytest.raises(BadRequestError) as refused:
        client.images.generate(model=MODEL, prompt=PROMPT, size=SIZE)
    assert refused.value.body["param"] == "model" and "/v1/videos" in refused.value.body["message"]


def test_unknown_videos_and_unsupported_variants_are_answered_in_openai_shape(server, client):
    missing = httpx.get(f"{server.url}/v1/videos/video-0000000000000000")
    assert missing.status_code == 404 and error_of(missing)["param"] == "video_id"
    with pytest.raises(NotFoundError):
        client.videos.retrieve("video-0000000000000000")
    bad_cursor = httpx.get(f"{server.url}/v1/videos", params={"after": "video-0000000000000000"})
    assert bad_cursor.status_code == 400 and error_of(bad_cursor)["param"] == "after"
    bad_limit = httpx.get(f"{server.url}/v1/videos", params={"limit": "0"})
    assert bad_limit.status_code == 400 and error_of(bad_limit)["param"] == "limit"


# ---- POST /v1/videos/sync ---------------------------------------------------------------------------------------


def sync(server, **fields) -> httpx.Response:
    body = dict(FAST, model=MODEL, prompt=PROMPT, size=SIZE, seconds="1", seed=7)
    body.update(fields)
    return httpx.post(f"{server.url}/v1/videos/sync", json=body, timeout=HTTP_TIMEOUT_S)


def test_sync_answers_the_mp4_the_async_route_stores_for_the_same_seed(server, client):
    answer = sync(server, seed=11)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "video/mp4"
    headers = {k: answer.headers[k] for k in ("x-seed", "x-size", "x-num-frames", "x-fps")}
    assert headers == {"x-seed": "11", "x-size": SIZE, "x-num-frames": "9", "x-fps": "8"}
    frames, codec, rate = decode_mp4(answer.content)
    assert (len(frames), frames[0].shape, codec, rate) == (9, (144, 208, 3), "h264", 8)

    video = client.videos.create_and_poll(
        model=MODEL, prompt=PROMPT, size=SIZE, seconds="1", extra_body=dict(FAST, seed=11), poll_interval_ms=50
    )
    assert sha256(client.videos.download_content(video.id).read()) == sha256(answer.content)
    # Nothing is stored for it: its id is no video of the store.
    job = answer.headers["x-request-id"]
    assert re.fullmatch(r"video-[0-9a-f]{16}", job) and job not in [v.id for v in client.videos.list(limit=100).data]
    assert httpx.get(f"{server.url}/v1/videos/{job}").status_code == 404


def test_sync_a_client_that_disconnects_has_its_job_cancelled_and_the_request_behind_it_runs_next(server):
    start = server.log_size()
    body = dict(FAST, model=MODEL, prompt=PROMPT, size=SIZE, seconds="1", seed=7, num_inference_steps=SLOW_STEPS)
    leaving = open_request(server.url, "/v1/videos/sync", body)
    queued = rf"Request (video-\w+) queued: size={SIZE}, frames=9, steps={{}},"
    slow = server.wait_for_log(queued.format(SLOW_STEPS), start).group(1)
    server.wait_for_log(rf"Request {slow} running", start)
    with ThreadPoolExecutor(1) as pool:
        behind = pool.submit(sync, server, seed=12)  # queued behind the slow job
        waiting = server.wait_for_log(queued.format(FAST["num_inference_steps"]), start).group(1)
        leaving.close()  # the client goes away
        server.wait_for_log(rf"Request {slow}: client disconnected, cancelling", start)
        stopped = int(server.wait_for_log(rf"request {slow} cancelled at step (\d+)", start).group(1))
        answer = behind.result(timeout=HTTP_TIMEOUT_S)
    assert stopped < SLOW_STEPS // 2  # stopped at a step, not run to its end
    assert answer.status_code == 200 and answer.headers["x-request-id"] == waiting, answer.text
    # The job behind it started when the cancelled one ended: the engine ran nothing between them.
    log = server.log(start)
    ended = log.index(f"Request {slow} cancelled")
    assert ended < log.index(f"Request {waiting} running")
    assert re.findall(r"Request (video-\w+) running", log) == [slow, waiting]


def _error(response: httpx.Response) -> tuple:
    error = response.json()["error"]
    return response.status_code, error["type"], error["param"], error["code"]


JSON = {"Content-Type": "application/json"}
HOSTILE = {
    "not json": dict(content=b'{"prompt": "a cat", ', headers=JSON),
    "a json list": dict(content=b'["a cat"]', headers=JSON),
    "no content type": dict(content=b'{"prompt": "a cat"}'),
    "plain text": dict(content=b"a cat", headers={"Content-Type": "text/plain"}),
    "no prompt": dict(json={"size": SIZE}),
    "a prompt that is an object": dict(json={"prompt": {"text": PROMPT}}),
    "an unknown field": dict(json={"prompt": PROMPT, "num_stepz": 2}),
    "n": dict(json={"prompt": PROMPT, "n": 2}),
    "a seed that is a list": dict(json={"prompt": PROMPT, "seed": [1]}),
    "a huge size": dict(json={"prompt": PROMPT, "size": "99999x99999"}),
    "too many frames": dict(json={"prompt": PROMPT, "num_frames": 10**9}),
    "too many steps": dict(json={"prompt": PROMPT, "num_inference_steps": 10**9}),
    "seconds not a number": dict(json={"prompt": PROMPT, "seconds": "NaN"}),
    "a prompt over the token limit": dict(json={"prompt": "cat " * 100_000}),
    "a model not served": dict(json={"prompt": PROMPT, "model": "sora-2"}),
    "an adapter by path": dict(json={"prompt": PROMPT, "lora": {"name": "x", "path": "/etc/passwd"}}),
    "a remote reference": dict(json={"prompt": PROMPT, "input_reference": {"image_url": "http://127.0.0.1/x.png"}}),
    "a form with a stray file": dict(data={"prompt": PROMPT}, files={"other": ("x.png", b"\x89PNG", "image/png")}),
}


@pytest.mark.parametrize("request_kwargs", HOSTILE.values(), ids=HOSTILE.keys())
def test_sync_answers_a_hostile_body_as_the_async_route_does(server, request_kwargs):
    answers = [
        httpx.post(f"{server.url}{path}", timeout=HTTP_TIMEOUT_S, **request_kwargs)
        for path in ("/v1/videos", "/v1/videos/sync")
    ]
    assert 400 <= answers[0].status_code < 500, answers[0].text
    assert _error(answers[1]) == _error(answers[0]), (answers[0].text, answers[1].text)
    # The same words too, but for the route's own path where a message names it.
    asynchronous, synchronous = (answer.json()["error"]["message"] for answer in answers)
    assert synchronous == asynchronous.replace("/v1/videos ", "/v1/videos/sync "), (asynchronous, synchronous)
