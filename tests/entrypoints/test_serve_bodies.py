"""Request bodies over real HTTP: a deadline, bodies cut short, one byte limit per field, errors naming the field.

One `vllm-omni serve tiny/hunyuan-video-1.5` for the module, with a queue of 3 places, 4 bodies read
at once (`--max-body-reads`), a body deadline of 2 s (`--body-read-timeout`) and a 1 MB upload limit,
so a body past the server's cap (the uploads as data URLs plus three text fields at their limit:
about 4.5 MB) is cheap to send. Raw sockets send what no client library would: headers and a byte,
then silence; a huge Content-Length and little or nothing; a body cut short; a client that leaves
mid-body. The bodies being read are seen through /metrics, the queue places free through a request
refused after it took one (400, not 429); that a refused body ran nothing, through the videos list
and the scheduler's log lines. The rules on the body's headers and its reading hold on every route
that reads one: the tests of those are parametrized over the routes.
"""

from __future__ import annotations

import base64
import json
import re
import socket
import time

import httpx
import pytest
from openai import APIStatusError, BadRequestError, OpenAI
from server_process import HTTP_TIMEOUT_S, start_server

from vllm_omni.entrypoints.openai.body_limits import BodyLimits

MODEL = "tiny/hunyuan-video-1.5"
PROMPT = "A cat walks on the grass, realistic style."
QUEUE = 3
BODY_READS = QUEUE + 1  # a normal request is read beside QUEUE silent uploads
BODY_TIMEOUT_S = 2
UPLOAD_LIMIT = 1_000_000
FIELD_LIMIT = BodyLimits().max_field_bytes  # the documented default: a text field's value, UTF-8
FAST = {"size": "64x48", "num_frames": 1, "num_inference_steps": 1}
BOUNDARY = "vllmomnibodytest"
POLL_S = 0.05
QUEUED = r"Request video-\w+ queued"  # the scheduler's line for a job it queued

# slow: a real server process, started per module
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-bodies")
    args = [MODEL, "--max-queue", str(QUEUE), "--body-read-timeout", str(BODY_TIMEOUT_S)]
    args += ["--max-body-reads", str(BODY_READS)]
    args += ["--max-upload-bytes", str(UPLOAD_LIMIT), "--video-dir", str(root / "videos")]
    srv = start_server(args, root / "server.log")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)


# ---- helpers --------------------------------------------------------------------------------------


def wait_until(condition, what: str, timeout: float = HTTP_TIMEOUT_S):
    """Poll `condition` until it returns something true (a hang guard, not a timing check)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(POLL_S)
    raise AssertionError(f"never happened: {what}")


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}, body
    return body["error"]


def videos(server) -> list[dict]:
    return httpx.get(f"{server.url}/v1/videos", params={"limit": 100}).json()["data"]


def wait_idle(server) -> None:
    """Every job finished: the queue's places are all free."""
    wait_until(lambda: all(v["status"] in ("completed", "failed") for v in videos(server)), "the jobs finished")


def bodies_reading(server) -> int:
    """The request bodies the server is reading now (its /metrics)."""
    metrics = httpx.get(f"{server.url}/metrics").text
    return int(float(re.search(r"(?m)^vllm_omni_request_bodies_reading (\S+)$", metrics).group(1)))


def probe(server) -> int:
    """The status of a request that takes a queue place and is then refused: 400 while a place is free, 429 not."""
    return httpx.post(f"{server.url}/v1/videos", json={"prompt": PROMPT, "num_stepz": 1}).status_code


def multipart(fields: list[tuple[str, str | tuple[str, bytes]]]) -> bytes:
    """A multipart/form-data body (boundary BOUNDARY): text fields, and (filename, data) file parts."""
    out = b""
    for name, value in fields:
        if isinstance(value, tuple):
            disposition = f'form-data; name="{name}"; filename="{value[0]}"\r\nContent-Type: image/png'
            data = value[1]
        else:
            disposition, data = f'form-data; name="{name}"', value.encode()
        out += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return out + f"--{BOUNDARY}--\r\n".encode()


MULTIPART_TYPE = f"multipart/form-data; boundary={BOUNDARY}"
# Every route that reads a body: the media type it takes and a small body of it.
BODY_ROUTES = {
    "/v1/images/generations": ("application/json", json.dumps({"prompt": PROMPT}).encode()),
    "/v1/images/edits": (MULTIPART_TYPE, multipart([("prompt", PROMPT), ("image", ("a.png", b"png"))])),
    "/v1/chat/completions": (
        "application/json",
        json.dumps({"messages": [{"role": "user", "content": PROMPT}]}).encode(),
    ),
    "/v1/videos": ("application/json", json.dumps({"prompt": PROMPT, **FAST}).encode()),
}
JSON_ROUTES = [path for path, (kind, _) in BODY_ROUTES.items() if kind == "application/json"]
QUEUED_ANY = r"Request \w+-\w+ queued"


def raw_post(server, path: str, content_type: str, body: bytes, length: int | None = None) -> socket.socket:
    """POST on a raw socket, Content-Length `length` (default: the body's), and leave it open."""
    host, port = server.url.removeprefix("http://").split(":")
    head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {content_type}\r\n"
    head += f"Content-Length: {len(body) if length is None else length}\r\n\r\n"
    sock = socket.create_connection((host, int(port)))
    sock.sendall(head.encode() + body)
    return sock


def answer_of(sock: socket.socket) -> tuple[int, dict, bytes]:
    """The status, headers and body of the answer on `sock`, read until the server closes the connection."""
    sock.settimeout(HTTP_TIMEOUT_S)  # a hang guard
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def png_bytes(size: int) -> bytes:
    """A PNG signature padded to `size` bytes: the size checks come before any image check."""
    return b"\x89PNG\r\n\x1a\n" + bytes(size - 8)


# ---- a deadline on the body ----------------------------------------------------------------------


def test_silent_uploads_take_no_queue_place_and_get_408(server):
    wait_idle(server)
    start = server.log_size()
    # As many uploads as the queue has places, each headers and one byte of a body announced as 1000
    # bytes, then silence; on three routes.
    stalled = [
        raw_post(server, "/v1/videos", MULTIPART_TYPE, b"-", length=1000),
        raw_post(server, "/v1/images/edits", MULTIPART_TYPE, b"-", length=1000),
        raw_post(server, "/v1/chat/completions", "application/json", b"{", length=1000),
    ]
    assert len(stalled) == QUEUE
    wait_until(lambda: bodies_reading(server) == QUEUE, "the server is reading the silent uploads")
    # A request takes a queue place only once its body has arrived: while they hang, the queue is open
    # (a request that takes a place and is then refused gets 400, not 429), and a request runs.
    assert probe(server) == 400
    response = httpx.post(f"{server.url}/v1/videos", json={"prompt": PROMPT, **FAST})
    assert response.status_code == 200, response.text
    job = response.json()["id"]
    wait_until(lambda: httpx.get(f"{server.url}/v1/videos/{job}").json()["status"] == "completed", "the job ran")
    # At the deadline each is answered 408 and its connection closed.
    for sock in stalled:
        status, headers, body = answer_of(sock)
        assert status == 408 and headers["connection"] == "close", body
        error = json.loads(body)["error"]
        assert error["code"] == "body_timeout" and f"within {BODY_TIMEOUT_S} s" in error["message"], error
        assert "1 of 1000 bytes" in error["message"] and error["param"] is None
    log = server.log(start)
    assert log.count("the body did not arrive within") == 3
    assert log.index(f"Request {job} queued") < log.index("the body did not arrive within")  # queued as they hung
    assert "Traceback" not in log and "ERROR" not in log, log
    wait_until(lambda: bodies_reading(server) == 0, "the read slots were given back")


def test_bodies_past_max_body_reads_get_429_until_one_ends(server):
    wait_idle(server)
    stalled = [raw_post(server, "/v1/videos", "application/json", b"{", length=1000) for _ in range(BODY_READS)]
    wait_until(lambda: bodies_reading(server) == BODY_READS, "the server is reading the silent uploads")
    refused = httpx.post(f"{server.url}/v1/videos", json={"prompt": PROMPT, **FAST})
    assert refused.status_code == 429 and error_of(refused)["code"] == "too_many_bodies", refused.text
    assert 1 <= int(refused.headers["retry-after"]) <= BODY_TIMEOUT_S and refused.headers["connection"] == "close"
    stalled.pop().close()  # a client that leaves gives its slot back
    wait_until(lambda: probe(server) == 400, "a read slot was free again")
    for sock in stalled:
        sock.close()
    wait_until(lambda: bodies_reading(server) == 0, "the read slots were given back")


def test_a_client_that_leaves_mid_body_is_one_info_line_and_queues_nothing(server):
    wait_idle(server)
    before = [v["id"] for v in videos(server)]
    start = server.log_size()
    body = multipart([("prompt", PROMPT), ("seed", "7")])
    raw_post(server, "/v1/videos", MULTIPART_TYPE, body[: len(body) // 2], length=len(body)).close()
    line = server.wait_for_log(r"(?m)^.*POST /v1/videos: the client disconnected after \d+ of \d+ bytes.*$", start)
    assert line.group(0).startswith("INFO"), line.group(0)
    assert probe(server) == 400  # it held no queue place
    wait_until(lambda: bodies_reading(server) == 0, "its read slot was given back")
    log = server.log(start)
    assert "Traceback" not in log and "ERROR" not in log and "ClientDisconnect" not in log, log
    assert not re.search(QUEUED, log) and [v["id"] for v in videos(server)] == before


# ---- refused from the headers, unread -------------------------------------------------------------


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_a_body_without_a_content_type_is_a_400_and_runs_nothing(server, path):
    start = server.log_size()
    before = [v["id"] for v in videos(server)]
    response = httpx.post(f"{server.url}{path}", content=BODY_ROUTES[path][1], timeout=HTTP_TIMEOUT_S)
    assert "content-type" not in response.request.headers
    assert response.status_code == 400 and response.headers["connection"] == "close", response.text
    error = error_of(response)
    assert error["param"] is None and f"the request has no Content-Type: POST {path} takes" in error["message"], error
    assert [v["id"] for v in videos(server)] == before and not re.search(QUEUED_ANY, server.log(start))


@pytest.mark.parametrize("sent", [0, 1], ids=["nothing-sent", "a-byte-sent"])
@pytest.mark.parametrize("path", BODY_ROUTES)
def test_a_content_length_over_the_cap_is_a_413_at_once_without_reading_the_body(server, path, sent):
    content_type, body = BODY_ROUTES[path]
    # Answered before the deadline, from the headers: a wait for the body would end in a 408.
    status, headers, answer = answer_of(raw_post(server, path, content_type, body[:sent], length=10**12))
    assert status == 413 and headers["connection"] == "close", answer
    error = json.loads(answer)["error"]
    assert error["param"] is None and f"its Content-Length is {10**12}" in error["message"], error


# ---- bodies cut short ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fault,words",
    [
        (lambda body: body[: body.index(b"cat") + 2], "cut short"),  # inside the prompt's string
        (lambda body: body[:-1], "cut short"),  # every value whole, the closing bracket missing
        (lambda body: body.replace(b"cat", b"caf\xe9"), "not UTF-8"),
    ],
    ids=["cut-in-a-string", "cut-after-a-value", "not-utf8"],
)
@pytest.mark.parametrize("path", JSON_ROUTES)
def test_json_cut_short_or_not_utf8_is_a_400_about_the_whole_body(server, path, fault, words):
    start = server.log_size()
    content = fault(BODY_ROUTES[path][1])
    response = httpx.post(f"{server.url}{path}", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] is None and "not valid JSON" in error["message"] and words in error["message"], error
    assert not re.search(QUEUED_ANY, server.log(start))


@pytest.mark.parametrize(
    "cut,param",
    [
        (lambda body: body[: body.index(b"123456") + 3], "seed"),  # inside a field: "123" of "123456"
        (lambda body: body[: body.rindex(b"--")], "seed"),  # whole fields, no closing boundary
    ],
    ids=["inside-a-field", "without-the-closing-boundary"],
)
def test_a_multipart_body_cut_short_is_a_400_naming_the_field_and_runs_nothing(server, cut, param):
    wait_idle(server)
    before = [v["id"] for v in videos(server)]
    start = server.log_size()
    body = multipart([("prompt", PROMPT), *((k, str(v)) for k, v in FAST.items()), ("seed", "123456")])
    response = httpx.post(
        f"{server.url}/v1/videos", content=cut(body), headers={"Content-Type": MULTIPART_TYPE}, timeout=HTTP_TIMEOUT_S
    )
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param and "closing boundary" in error["message"], error
    assert [v["id"] for v in videos(server)] == before
    assert not re.search(QUEUED, server.log(start))
    # The whole body, sent again, is a job with the seed it gives.
    complete = httpx.post(f"{server.url}/v1/videos", content=body, headers={"Content-Type": MULTIPART_TYPE})
    assert complete.status_code == 200 and complete.json()["seed"] == 123456, complete.text
    wait_idle(server)


# ---- one limit per field, named ------------------------------------------------------------------


def test_a_prompt_over_the_field_limit_is_the_same_400_in_json_and_in_multipart(server, client):
    prompt = "p" * 2 * FIELD_LIMIT  # the body within its cap
    by_json = httpx.post(f"{server.url}/v1/videos", json={"prompt": prompt, **FAST}, timeout=HTTP_TIMEOUT_S)
    assert by_json.status_code == 400, by_json.text
    with pytest.raises(BadRequestError) as by_form:  # the openai client sends a multipart form
        client.videos.create(model=MODEL, prompt=prompt, extra_body=FAST)
    expected = f"prompt is larger than the limit of {FIELD_LIMIT} bytes for a text field"
    assert error_of(by_json)["param"] == by_form.value.body["param"] == "prompt"
    assert error_of(by_json)["message"] == by_form.value.body["message"] == expected


def test_a_body_past_the_cap_is_a_413_by_its_length_or_a_400_naming_the_field_as_it_streams(server, client):
    prompt = "p" * 6 * FIELD_LIMIT
    # With a Content-Length (the JSON and the multipart form of client libraries), refused unread.
    by_json = httpx.post(f"{server.url}/v1/videos", json={"prompt": prompt, **FAST}, timeout=HTTP_TIMEOUT_S)
    with pytest.raises(APIStatusError) as by_form:
        client.videos.create(model=MODEL, prompt=prompt, extra_body=FAST)
    assert by_json.status_code == by_form.value.status_code == 413, by_json.text
    assert error_of(by_json)["param"] is None and by_form.value.body["param"] is None
    # Chunked (no Content-Length): read up to the cap, which is passed inside the prompt.
    content = json.dumps({"prompt": prompt, **FAST}).encode()
    chunks = (content[i : i + 65536] for i in range(0, len(content), 65536))
    streamed = httpx.post(
        f"{server.url}/v1/videos", content=chunks, headers={"Content-Type": "application/json"}, timeout=HTTP_TIMEOUT_S
    )
    assert streamed.status_code == 400 and "content-length" not in streamed.request.headers, streamed.text
    expected = f"prompt is larger than the limit of {FIELD_LIMIT} bytes for a text field"
    assert error_of(streamed)["param"] == "prompt" and error_of(streamed)["message"] == expected


def test_an_input_reference_over_the_upload_limit_is_the_same_400_as_a_file_and_as_a_data_url(server, client):
    image = png_bytes(UPLOAD_LIMIT + 1)
    with pytest.raises(BadRequestError) as as_file:
        client.videos.create(model=MODEL, prompt=PROMPT, input_reference=("cat.png", image, "image/png"))
    data_url = "data:image/png;base64," + base64.b64encode(image).decode()
    as_url = httpx.post(f"{server.url}/v1/videos", json={"prompt": PROMPT, "input_reference": {"image_url": data_url}})
    expected = f"input_reference is larger than the upload limit of {UPLOAD_LIMIT} bytes"
    assert as_url.status_code == 400 and error_of(as_url)["message"] == as_file.value.body["message"] == expected
    assert error_of(as_url)["param"] == as_file.value.body["param"] == "input_reference"


@pytest.mark.parametrize(
    "body,param,words",
    [
        ({"seconds": ["4"]}, "seconds", "got list"),
        ({"seconds": {"value": 4}}, "seconds", "got dict"),
        ({"seconds": 10**400}, "seconds", "far too large"),
        ({"seed": "x", "prompt": "p" * (FIELD_LIMIT + 1)}, "prompt", "text field"),
    ],
    ids=["seconds-list", "seconds-object", "seconds-400-digits", "a-field-too-large-is-named-before-a-bad-one"],
)
def test_a_json_field_of_the_wrong_shape_is_a_400_naming_it(server, body, param, words):
    response = httpx.post(f"{server.url}/v1/videos", json={"prompt": PROMPT, **body}, timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize(
    "content,param",
    [
        (b'{"prompt": "a cat", "seed": tru}', "seed"),
        (b'{"prompt": "a cat", "seconds": ' + b"9" * 5000 + b"}", "seconds"),
    ],
    ids=["bad-literal", "integer-beyond-python"],  # not UTF-8, or cut short: the whole body is at fault
)
def test_json_that_does_not_parse_names_the_field_where_it_stops(server, content, param):
    response = httpx.post(f"{server.url}/v1/videos", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and error_of(response)["param"] == param, response.text
    assert "not valid JSON" in error_of(response)["message"]


def test_seconds_of_400_digits_in_a_form_is_a_400_naming_seconds(client):
    with pytest.raises(BadRequestError) as refused:
        client.videos.create(model=MODEL, prompt=PROMPT, seconds="9" * 400, extra_body=FAST)
    assert refused.value.body["param"] == "seconds", refused.value.body


def test_two_input_reference_files_are_a_400_naming_input_reference(server):
    files = [("input_reference", ("a.png", png_bytes(64), "image/png"))] * 2
    response = httpx.post(f"{server.url}/v1/videos", data={"prompt": PROMPT}, files=files)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == "input_reference" and "at most 1" in error["message"], error


@pytest.mark.parametrize(
    "content_type",
    ["APPLICATION/JSON", "application/json; charset=UTF-8", f"Multipart/Form-Data; boundary={BOUNDARY}"],
    ids=["upper-case-json", "json-with-charset", "mixed-case-multipart"],
)
def test_media_types_are_compared_without_case_and_parameters(server, content_type):
    fields = {"prompt": PROMPT, **FAST, "seed": 5}
    if content_type.lower().startswith("multipart"):
        body = multipart([(k, str(v)) for k, v in fields.items()])
    else:
        body = json.dumps(fields).encode()
    response = httpx.post(f"{server.url}/v1/videos", content=body, headers={"Content-Type": content_type})
    assert response.status_code == 200, response.text
    assert response.json()["seed"] == 5
    wait_idle(server)
