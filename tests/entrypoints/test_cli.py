"""The command line: fast `--help` documenting every flag, the `--omni` hand-off's argv, the one-shot
`generate`, and servers that must refuse to start (bad deploy YAML, unknown model, lost workers)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
from PIL import Image
from server_process import REPO, ServerProcess, free_port, omni_command, process_alive, server_env, start_server

MODEL = "tiny/qwen-image"


def run(args: list[str], timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=server_env(**env), cwd=REPO)


def test_help_documents_every_flag_and_imports_neither_torch_nor_fastapi():
    script = textwrap.dedent(
        """
        import contextlib, io, sys
        from vllm_omni.entrypoints.cli.main import main
        for command in ("serve", "generate"):
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
                main([command, "--help"])
            print(out.getvalue())
        print("HEAVY:", sorted(m for m in ("torch", "fastapi", "uvicorn", "diffusers", "vllm") if m in sys.modules))
        """
    )
    result = run([sys.executable, "-c", script])
    assert result.returncode == 0, result.stderr
    assert "HEAVY: []" in result.stdout
    help_text = result.stdout
    for flag in (
        "--host",
        "--port",
        "--ulysses-degree",
        "--ring-degree",
        "--cfg-parallel-size",
        "--mask-sp-padding",
        "--no-trim-sp-padding",
        "--attention-backend",
        "--dtype",
        "--device",
        "--deploy-config",
        "--api-key",
        "--max-queue",
        "--max-image-size",
        "--max-steps",
        "--max-n",
        "--max-input-images",
        "--max-upload-bytes",
        "--max-input-pixels",
        "--max-prompt-tokens",
        "--max-tokens-per-step",
        "--served-model-name",
        "--body-read-timeout",
        "--enforce-eager",
        "--distributed-executor-backend",
        "--ray-address",
        # vLLM's flags
        "--download-dir",
        "--tensor-parallel-size",
        "--uvicorn-log-level",
        "--disable-log-requests",
        "--allowed-origins",
        "--allowed-methods",
        "--allowed-headers",
        "--allow-credentials",
        "--root-path",
        "--ssl-keyfile",
        "--ssl-certfile",
    ):
        assert flag in help_text, flag
    for flag in ("--prompt", "--image", "--negative-prompt", "--size", "--steps", "--seed", "--output"):
        assert flag in help_text, flag


def test_argv_as_vllm_hands_it_over_is_accepted():
    # vLLM calls main() with sys.argv untouched: ['vllm', 'serve', MODEL, '--omni', ...].
    script = "import sys\nfrom vllm_omni.entrypoints.cli.main import main\n"
    script += f"sys.argv = ['vllm', 'serve', {MODEL!r}, '--omni', '--ulysses-degree', '2', '--help']\nmain()\n"
    result = run([sys.executable, "-c", script])
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: vllm serve")


@pytest.mark.slow  # starts workers
def test_generate_writes_the_images_and_prints_the_step_breakdown(tmp_path):
    output = tmp_path / "out" / "cat.png"
    result = run(
        omni_command(
            "generate",
            MODEL,
            "--prompt",
            "a cat holding a sign that says hello world",
            "--size",
            "272x208",
            "--steps",
            "2",
            "--seed",
            "3",
            "--n",
            "2",
            "--ulysses-degree",
            "2",
            "--mask-sp-padding",
            "--output",
            str(output),
        ),
        VLLM_LOGGING_LEVEL="DEBUG",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "DiffusionEngine.step breakdown: preprocess=" in result.stdout
    assert (result.stdout + result.stderr).count("Engine ready in") == 1
    assert "Auto-padded sequence from 221 to 222 (pad_size=1, world_size=2, dim=1)" in result.stderr
    assert "padding=mask" in result.stderr
    for path, seed in ((output, 3), (output.with_name("cat-1.png"), 4)):  # image i is drawn from seed + i
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size == (272, 208)
        assert f"Wrote {path} (272x208, seed {seed})" in result.stdout


@pytest.mark.slow  # `vllm-omni generate` in a subprocess, up to its checks
def test_generate_with_bad_input_says_which_field(tmp_path):
    result = run(omni_command("generate", MODEL, "--prompt", "x", "--size", "abc", "--output", str(tmp_path / "x.png")))
    assert result.returncode == 2 and "size must be 'WIDTHxHEIGHT'" in result.stderr


@pytest.mark.slow  # `vllm-omni generate` in a subprocess, up to its checks
@pytest.mark.parametrize(
    "model,flags,message",
    [
        # The flag reaches the engine (not a silent bf16 run): FP8 needs CUDA GPUs, these workers run on the CPU.
        (MODEL, ["--quantization", "fp8"], "quantization='fp8' needs CUDA GPUs of compute capability 8.9"),
        # GLM-Image runs CFG, but its branches cannot be split: the refusal says why.
        ("tiny/glm-image", ["--cfg-parallel-size", "2"], "GlmImagePipeline runs classifier-free guidance, but"),
    ],
    ids=["fp8-on-cpu", "glm-image-cfg-parallel"],
)
def test_generate_refuses_what_the_engine_cannot_run_before_any_worker_starts(tmp_path, model, flags, message):
    output = tmp_path / "x.png"
    result = run(omni_command("generate", model, "--prompt", "x", *flags, "--device", "cpu", "--output", str(output)))
    assert result.returncode == 2 and message in result.stderr, result.stderr[-4000:]
    assert "Starting" not in result.stderr and not output.exists()


@pytest.mark.parametrize(
    "yaml_text,key",
    [
        ("stages:\n  - stage_id: 0\n    parallel_config: {ulysses_degre: 2}\n", "ulysses_degre"),
        ("stages:\n  - stage_id: 0\n    default_sampling_params: {steps: 2}\n", "steps"),
        ("stages:\n  - stage_id: 0\nmodel: x\n", "model"),
    ],
)
def test_serve_with_an_unknown_yaml_key_fails_at_start_naming_it(tmp_path, yaml_text, key):
    (tmp_path / "bad.yaml").write_text(yaml_text)
    result = run(omni_command("serve", MODEL, "--deploy-config", str(tmp_path / "bad.yaml"), "--port", "1"))
    assert result.returncode == 2
    assert "unknown" in result.stderr and f"'{key}'" in result.stderr


@pytest.mark.parametrize(
    "args,words",
    [
        (["tiny/qwen-imag"], "unknown tiny model 'tiny/qwen-imag'; tiny models: tiny/qwen-image"),
        (["no-such-org/no-such-model"], "model 'no-such-org/no-such-model' is not in the Hugging Face cache"),
        ([MODEL, "--distributed-executor-backend", "ray"], "needs Ray on every node: pip install -e '.[ray]'"),
        (
            [MODEL, "--lora-modules", "a=/does/not/exist"],
            "--lora-modules a=/does/not/exist: adapter 'a': /does/not/exist does not exist",
        ),
        ([MODEL, "--lora-modules", "a=tiny/qwen-image-lor"], "unknown tiny adapter 'tiny/qwen-image-lor'"),
        ([MODEL, "--lora-modules", "a={tmp}/empty"], "/empty holds no .safetensors or .bin file: not a LoRA adapter"),
        ([MODEL, "--lora-modules", "a={tmp}/x.safetensors"], "x.safetensors is not a LoRA adapter: not a safetensors"),
        ([MODEL, "--lora-modules", "a={model}/transformer"], "transformer is not a LoRA adapter: none of its"),
    ],
    ids=[
        "misspelt-tiny-model",
        "hub-model-offline",
        "ray-not-installed",
        "lora-path-missing",
        "lora-tiny-name-misspelt",
        "lora-folder-without-weights",
        "lora-file-not-safetensors",
        "lora-path-is-model-weights",
    ],
)
def test_a_refusal_before_serving_is_one_line_with_exit_code_2(tmp_path, args, words):
    from vllm_omni.diffusion.model_source import resolve_model_path

    (tmp_path / "ray").mkdir()  # on the path first: Ray as if it were not installed
    (tmp_path / "ray" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'ray'\", name='ray')\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "x.safetensors").write_bytes(b"\x07not a safetensors file" * 8)
    args = [arg.format(tmp=tmp_path, model=resolve_model_path(MODEL)) for arg in args]
    env = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join((str(tmp_path), str(REPO)))}
    result = run(omni_command("serve", *args, "--port", str(free_port())), timeout=120, **env)
    assert result.returncode == 2, result.stderr[-4000:]
    # One line and nothing else: no traceback, no log line, no shutdown line, nothing said Serving.
    assert result.stderr.startswith("vllm-omni serve: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert words in result.stderr and result.stdout == ""


def test_a_busy_port_is_refused_in_one_line_before_serving():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run(omni_command("serve", MODEL, "--host", "127.0.0.1", "--port", str(port)), timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"vllm-omni serve: error: port {port} on 127.0.0.1 is in use: choose another with --port\n"


def test_the_port_check_takes_a_port_uvicorn_takes_whose_old_connections_wait_in_time_wait():
    import uvicorn

    from vllm_omni.entrypoints.cli.serve import check_port

    with socket.socket() as listener:  # a server before this one, with uvicorn's SO_REUSEADDR
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            connection, _ = listener.accept()
            connection.close()  # the server's end closes first: it waits in TIME_WAIT
            assert client.recv(1) == b""
    with socket.socket() as plain, pytest.raises(OSError):  # a bind without SO_REUSEADDR would call it busy
        plain.bind(("127.0.0.1", port))
    check_port("127.0.0.1", port)
    uvicorn.Config(app=None, host="127.0.0.1", port=port).bind_socket().close()  # and uvicorn takes it


@pytest.mark.slow  # starts workers
def test_server_exits_nonzero_when_its_workers_cannot_be_brought_back(tmp_path):
    from vllm_omni.diffusion.model_source import resolve_model_path

    model = tmp_path / "model"
    shutil.copytree(resolve_model_path(MODEL), model)
    server = start_server([str(model), "--ulysses-degree", "2"], tmp_path / "server.log")
    try:
        shutil.rmtree(model / "transformer")  # a respawned worker can no longer load the model
        os.kill(server.worker_pids()[0], signal.SIGKILL)
        assert server.wait_exit() == 1
        assert "cannot be brought back" in server.log()
    finally:
        server.close()


@pytest.mark.slow  # starts workers
def test_sigterm_while_the_workers_load_exits_0_and_leaves_no_workers(tmp_path):
    server = ServerProcess(omni_command("serve", MODEL, "--ulysses-degree", "2"), tmp_path / "server.log")
    try:
        assert server.first_health().status_code == 503
        workers = []
        while len(workers) < 2 and server.proc.poll() is None:
            workers = server.worker_pids()
        assert server.terminate() == 0
        assert not any(process_alive(pid) for pid in workers)
    finally:
        server.close()
