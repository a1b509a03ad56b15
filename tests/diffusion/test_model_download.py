"""A hub id not in the cache is downloaded (only the files model_index.json names), then taken from the cache;
a missing repo, a gated one and a local path that does not exist are each one clear line.

The hub is a stand-in: a threaded HTTP server on 127.0.0.1 that answers huggingface_hub's requests
(`/api/models/{repo}/revision/{rev}`, `/api/models/{repo}/tree/{rev}`, HEAD and GET
`/{repo}/resolve/{rev}/{file}` with `X-Repo-Commit` and `ETag`) with the tiny Qwen-Image's files, and counts them.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from huggingface_hub import constants

from vllm_omni.diffusion.model_source import ModelNotFoundError, resolve_model_path

REPO = "acme/tiny-qwen-image"
GATED = "acme/gated-model"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class StandInHub:
    """Serves `files` as the repo REPO at every revision; GATED answers 403 GatedRepo, any other repo 404."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub.answer(self, body=True)

            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def file_gets(self) -> list[str]:
        return [path for method, path in self.requests if method == "GET" and "/resolve/" in path]

    def answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(handler.path).path)
        self.requests.append((handler.command, path))
        api = path.startswith("/api/models/")
        parts = path.removeprefix("/api/models/" if api else "/").split("/")
        repo, rest = "/".join(parts[:2]), parts[2:]
        if repo == GATED:
            return self.send(handler, 403, b'{"error": "gated"}', {"X-Error-Code": "GatedRepo"}, body)
        if repo != REPO or not rest:
            return self.send(handler, 404, b'{"error": "no such repo"}', {"X-Error-Code": "RepoNotFound"}, body)
        if api and rest[0] == "revision":
            info = {"id": REPO, "sha": COMMIT, "private": False, "siblings": [{"rfilename": f} for f in self.files]}
            return self.send(handler, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if api and rest[0] == "tree":
            tree = [
                {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                for name, data in self.files.items()
            ]
            return self.send(handler, 200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
        if not api and rest[0] == "resolve" and "/".join(rest[2:]) in self.files:
            data = self.files["/".join(rest[2:])]
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
            return self.send(handler, 200, data, headers, body)
        self.send(handler, 404, b'{"error": "no such file"}', {"X-Error-Code": "EntryNotFound"}, body)

    @staticmethod
    def send(handler: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
        handler.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            handler.send_header(key, value)
        handler.end_headers()
        if body:
            handler.wfile.write(data)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def hub():
    tiny = resolve_model_path("tiny/qwen-image")
    files = {str(p.relative_to(tiny)): p.read_bytes() for p in sorted(tiny.rglob("*")) if p.is_file()}
    files["README.md"] = b"a model card the pipeline does not read"
    files["onnx/model.onnx"] = b"another format, not named by model_index.json"
    stand_in = StandInHub(files)
    yield stand_in
    stand_in.close()


@pytest.fixture
def at_the_stand_in(hub, tmp_path, monkeypatch):
    """huggingface_hub pointed at the stand-in, its home and cache in tmp_path, no token, online."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)  # read at import: set where it was read
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "default-cache"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "home" / "token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    hub.requests.clear()
    return hub


def test_a_hub_model_is_downloaded_once_into_the_download_dir_then_read_from_it(at_the_stand_in, tmp_path):
    hub = at_the_stand_in
    download_dir = tmp_path / "models"
    folder = resolve_model_path(REPO, download_dir=str(download_dir))
    assert folder.is_relative_to(download_dir) and (folder / "model_index.json").is_file()
    components = {"model_index.json", "scheduler", "text_encoder", "tokenizer", "transformer", "vae"}
    assert {p.relative_to(folder).parts[0] for p in folder.rglob("*") if p.is_file()} == components
    tiny = resolve_model_path("tiny/qwen-image")
    assert (folder / "transformer" / "config.json").read_bytes() == (tiny / "transformer" / "config.json").read_bytes()
    gets = hub.file_gets()
    assert not any("README.md" in path or "onnx" in path for path in gets)  # only what model_index.json names
    assert len(gets) == sum(1 for p in folder.rglob("*") if p.is_file())  # each file once

    hub.requests.clear()
    assert resolve_model_path(REPO, download_dir=str(download_dir)) == folder
    assert hub.requests == []  # from the cache: not even a look at the hub
    assert not (tmp_path / "default-cache").exists()  # --download-dir, not the default cache


def test_a_revision_is_asked_for_by_name(at_the_stand_in, tmp_path):
    folder = resolve_model_path(REPO, download_dir=str(tmp_path / "models"), revision="v1.0")
    assert folder.name == COMMIT
    assert any(path.startswith(f"/{REPO}/resolve/v1.0/") for _, path in at_the_stand_in.requests)


@pytest.mark.parametrize(
    "model,words",
    [
        ("acme/no-such-model", "not found: not a local folder, and the Hugging Face hub"),
        (GATED, "is gated on the Hugging Face hub: accept its terms"),
    ],
    ids=["missing", "gated"],
)
def test_a_missing_or_gated_repo_is_one_clear_line(at_the_stand_in, tmp_path, model, words):
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model_path(model, download_dir=str(tmp_path / "models"))
    message = str(caught.value)
    assert words in message and model in message and "\n" not in message
    if model == GATED:
        assert "HF_TOKEN" in message


def test_an_unreachable_hub_is_one_clear_line(at_the_stand_in, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model_path(REPO, download_dir=str(tmp_path / "models"))
    message = str(caught.value)
    assert "is not in the Hugging Face cache" in message and "cannot be reached" in message and "\n" not in message
    assert at_the_stand_in.requests == []


@pytest.mark.parametrize("model", ["/no/such/folder", "./no-such-folder", "../up/there", "~/nowhere", "a/b/c", "bare"])
def test_a_path_that_does_not_exist_is_no_such_folder_without_a_download(at_the_stand_in, model):
    with pytest.raises(ModelNotFoundError, match="no such folder") as caught:
        resolve_model_path(model)
    assert "download" not in str(caught.value) and at_the_stand_in.requests == []


def test_a_file_is_not_a_model(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="is a file, not a diffusers pipeline folder"):
        resolve_model_path(str(tmp_path / "model.safetensors"))


def test_an_existing_relative_folder_of_owner_name_form_is_local(tmp_path, monkeypatch):
    tiny = resolve_model_path("tiny/qwen-image")
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "local").symlink_to(tiny)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("acme/local") == Path(tiny).resolve()
