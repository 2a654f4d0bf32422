"""Unload/reload, a dead engine, and shutdown, each with requests in flight, on a server of its own."""

from __future__ import annotations

import contextlib
import secrets
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

import psutil
import pytest
import tritonclient.grpc.model_config_pb2 as mc
from google.protobuf import text_format

from tests.backend_helpers import (
    context_length,
    engine_processes,
    generate,
    is_continuation,
    metric,
    metrics,
    model_state,
    post,
    stream,
)
from utils import paths
from utils.repository import config_to_text, prepare_run_repository, read_config
from utils.server import ServerError, TritonServer, processes_tagged



SCRATCH_STREAM_INTERVAL = 3
SCRATCH_QUEUE_WINDOW = {"max_queue_delay_microseconds": "1000000", "queue_quiet_microseconds": "300000"}


@pytest.fixture(scope="module")
def scratch_server() -> TritonServer:
    """A server of this module's own (its tests unload, kill and stop it); its model.json also sets vLLM's
    ``stream_interval``, which the backend keeps as the floor of its pace (a CPU's load never raises the pace), and
    its config.pbtxt a queue delay (``backend/vllm/admission.py``), so unloading and stopping meet held requests."""
    run_dir = paths.runs_dir() / f"pytest-scratch-{time.strftime('%Y%m%d-%H%M%S')}"
    repository = prepare_run_repository(
        run_dir / "model_repository", engine_overrides={"stream_interval": SCRATCH_STREAM_INTERVAL},
        config_parameters=SCRATCH_QUEUE_WINDOW, log=lambda _: None,
    )
    server = TritonServer(repository, run_dir=run_dir, free_ports=True)
    server.start().wait_ready(timeout=900, progress=False)
    yield server
    server.stop()


@pytest.fixture
def scratch(scratch_server: TritonServer) -> TritonServer:
    """The module's server with its model loaded: a test that fails between an unload and its reload would
    otherwise fail each test after it (as in CI on 2026-12-07)."""
    if scratch_server.process.poll() is None and not model_ready(scratch_server):
        reload(scratch_server)
    return scratch_server


def model_ready(server: TritonServer) -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/vllm_model/ready", timeout=10) as reply:
            return reply.status == 200
    except urllib.error.URLError:
        return False


def long_sampling(server: TritonServer) -> dict:
    """Streams that run far longer than any test step: nearly the whole context, EOS ignored."""
    return {"temperature": 0, "ignore_eos": True, "max_tokens": context_length(server.http_url) - 64}


class LongStreams:
    """Streams that run far longer than any test step, each on a thread of its own."""

    def __init__(self, server: TritonServer, count: int):
        sampling = long_sampling(server)
        self.limit = sampling["max_tokens"]
        self.results: list = []
        self.answered = [threading.Event() for _ in range(count)]
        self.threads = [
            threading.Thread(target=lambda answered=answered: self.results.append(
                stream(server.grpc_url, "Once upon a time", sampling=sampling, timeout=600, answered=answered)
            ))
            for answered in self.answered
        ]
        for thread in self.threads:
            thread.start()

    def wait_until_answered(self, timeout: float = 60) -> None:
        """Until every stream has had its first response (it is in the engine), so that what the test does next
        meets all of them. The engine's running gauge cannot tell: published once a second, it still showed an
        earlier test's requests when CI's unload test went on with two of its three streams not yet sent."""
        deadline = time.monotonic() + timeout
        for answered in self.answered:
            if not answered.wait(max(0.0, deadline - time.monotonic())):
                raise AssertionError(f"{sum(not a.is_set() for a in self.answered)} streams had no response in {timeout} s")

    def join(self, timeout: float) -> list:
        for thread in self.threads:
            thread.join(timeout=timeout)
        return self.results


def reload(server: TritonServer) -> None:
    assert post(f"http://{server.http_url}/v2/repository/models/vllm_model/load", timeout=900) == 200
    assert model_ready(server)


def test_a_stream_interval_in_model_json_gathers_tokens_and_loses_none(scratch):
    """vLLM builds a response every ``stream_interval`` tokens (the backend's pace never goes below model.json's
    value): the first token at once, then the interval's tokens (or several intervals' when the sender is
    behind), the rest with the last; the text is exactly the non-streamed reply's."""
    sampling = {"temperature": 0, "ignore_eos": True, "max_tokens": 11}
    streamed = stream(scratch.grpc_url, "The capital of France is", sampling=sampling, exclude_input_in_output=True)
    _, whole = generate(
        scratch.http_url, {"text_input": "The capital of France is", "exclude_input_in_output": True, **sampling}
    )
    assert streamed.error is None and sum(streamed.tokens) == 11 and streamed.tokens[0] == 1
    assert len(streamed.tokens) < 11 and all(n % SCRATCH_STREAM_INTERVAL == 0 for n in streamed.tokens[1:-1])
    assert streamed.text == whole["text_output"]


def steps_over(values: dict[str, float], tokens: int) -> float:
    """Engine steps that computed more than ``tokens`` tokens (vLLM's tokens-per-step histogram; ``tokens`` is one
    of its bucket bounds)."""
    within = sum(v for k, v in values.items() if k.startswith("vllm:iteration_tokens_total_bucket{") and f'le="{tokens}"' in k)
    return metric(values, "vllm:iteration_tokens_total_count") - within


def test_a_queue_delay_sends_requests_arriving_close_together_to_the_engine_together(scratch):
    """config.pbtxt's ``max_queue_delay_microseconds`` (the scratch server's: 1 s, quiet 0.3 s): four requests that
    arrive 0.1 s apart while another streams are held until arrivals stop, then reach the engine together, and each
    request still gets exactly its tokens. Their prompts (32-42 tokens each, distinct, so no prefix is cached) then
    share engine steps: a step of over 64 tokens computes two or more of them, where without the delay each would
    have a step of its own (at most 43 tokens with the other stream's decode). All four in one step (over 128
    tokens) is the rule on a CPU but not on a GPU: the backend hands them to vLLM one after the other in one turn of
    its loop (each tokenized on the way), and an H100's engine, stepping every few milliseconds, took them in over
    more than one step in 2 of 5 runs (2026-12-07)."""
    import queue

    import tritonclient.grpc as grpcclient

    from tests.backend_helpers import MODEL, inputs_for

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(scratch.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(MODEL, inputs_for("Once upon a time", stream=True, sampling=long_sampling(scratch)))
    try:
        assert responses.get(timeout=120)[1] is None  # the first token: the long request is in flight
        before = metrics(scratch.metrics_url)
        replies: dict[int, tuple[int, dict]] = {}

        def ask(i: int) -> None:
            tag = secrets.token_hex(4)  # a prefix no earlier request had: nothing of the prompt is cached
            prompt = (
                f"Request {i} {tag}: the quick brown fox jumps over the lazy dog, "
                "and the dog sleeps under the old tree by the wide river."
            )
            body = {"text_input": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0,
                    "return_num_input_tokens": True, "return_num_output_tokens": True}
            replies[i] = generate(scratch.http_url, body)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
            time.sleep(0.1)
        for thread in threads:
            thread.join(timeout=120)
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    assert all(status == 200 for status, _ in replies.values()) and len(replies) == 4, replies
    prompt_tokens = [body["num_input_tokens"] for _, body in replies.values()]
    assert all(32 <= n <= 42 for n in prompt_tokens), prompt_tokens  # two exceed 64 tokens, one with a decode does not
    assert all(body["num_output_tokens"] == 4 for _, body in replies.values())
    deadline = time.monotonic() + 5
    while steps_over(metrics(scratch.metrics_url), 64) - steps_over(before, 64) < 1 and time.monotonic() < deadline:
        time.sleep(0.5)  # the backend publishes vLLM's histograms once a second
    after = metrics(scratch.metrics_url)
    shared = steps_over(after, 64) - steps_over(before, 64)
    assert 1 <= shared <= 2, (shared, steps_over(after, 128) - steps_over(before, 128))


def test_unload_with_streams_in_flight_finishes_within_bound(scratch):
    streams = LongStreams(scratch, 3)
    streams.wait_until_answered()
    started = time.monotonic()
    assert post(f"http://{scratch.http_url}/v2/repository/models/vllm_model/unload") == 200
    while model_state(scratch) not in ("UNAVAILABLE", "") and time.monotonic() - started < 60:
        time.sleep(0.5)
    unloaded_after = time.monotonic() - started
    results = streams.join(timeout=60)
    assert unloaded_after < 30, f"unload took {unloaded_after:.0f} s"
    assert model_state(scratch) == "UNAVAILABLE"
    assert len(results) == 3 and all(sum(r.tokens) < streams.limit for r in results)  # cut short, each stream closed
    assert all(r.error is not None and "being unloaded" in r.error for r in results), [r.error for r in results]
    reload(scratch)
    status, body = generate(scratch.http_url, {"text_input": "The capital of France is", "temperature": 0, "max_tokens": 8})
    assert status == 200 and is_continuation(body["text_output"], "The capital of France is")


def test_dead_engine_fails_fast_and_the_model_reports_not_ready(scratch):
    streams = LongStreams(scratch, 2)
    streams.wait_until_answered()
    engines = engine_processes(scratch)
    assert engines, "no EngineCore process found under the server"
    killed_at = time.monotonic()
    for proc in engines:
        proc.kill()
    results = streams.join(timeout=30)
    assert time.monotonic() - killed_at < 15
    assert len(results) == 2
    assert all(r.error is not None and "engine died" in r.error for r in results), [r.error for r in results]

    started = time.monotonic()
    status, body = generate(scratch.http_url, {"text_input": "Hi", "max_tokens": 4}, timeout=30)
    assert time.monotonic() - started < 5 and status >= 400 and body["error"]
    deadline = time.monotonic() + 60
    while model_ready(scratch) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not model_ready(scratch)
    reload(scratch)


def test_a_sigterm_with_streams_in_flight_leaves_nothing_behind(scratch):
    """Triton's own shutdown, as `docker stop`, systemd or Ctrl-C start it (no unload first, unlike
    TritonServer.stop, which every fixture's teardown runs). Asked through the stub, the backend's readiness
    question crashed the stub, and Triton never exited; over HTTP the streams stop and the model unloads."""
    streams = LongStreams(scratch, 3)
    streams.wait_until_answered()
    family = [psutil.Process(scratch.process.pid), *psutil.Process(scratch.process.pid).children(recursive=True)]
    started = time.monotonic()
    scratch.process.send_signal(signal.SIGTERM)
    code = scratch.process.wait(timeout=90)
    stopped_after = time.monotonic() - started
    results = streams.join(timeout=30)
    log = scratch.log_path.read_text(errors="replace")
    assert stopped_after < 15, f"shutdown took {stopped_after:.0f} s"
    assert code == 0 and "Segfault" not in log and "successfully unloaded 'vllm_model'" in log
    assert [p.pid for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    assert list(Path("/dev/shm").glob(f"{scratch.shm_prefix}*")) == []
    assert len(results) == 3 and all(r.error is not None and "being unloaded" in r.error for r in results), results


def still_running(processes: list[psutil.Process]) -> list[str]:
    """Names of those still running (a zombie has exited: here nobody may reap it)."""
    names = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                names.append(process.name())
        except psutil.NoSuchProcess:
            continue
    return names


@contextlib.contextmanager
def killed_with_streams_in_flight(
    tmp_path: Path, kill: Callable[[TritonServer, psutil.Process], None]
) -> Iterator[tuple[TritonServer, list[psutil.Process], float, LongStreams]]:
    """A server of the test's own, ``kill``ed (Triton, its stub, or both) with two streams in flight: the server,
    the stub and every process below it, how long they took to be gone (up to 30 s), and the streams."""
    repository = prepare_run_repository(tmp_path / "model_repository", log=lambda _: None)
    server = TritonServer(repository, run_dir=tmp_path / "run", free_ports=True)
    server.start().wait_ready(timeout=900, progress=False)
    try:
        streams = LongStreams(server, 2)
        streams.wait_until_answered()
        stub = next(p for p in psutil.Process(server.process.pid).children() if "triton_python_backend_stub" in p.name())
        left = [stub, *stub.children(recursive=True)]
        assert engine_processes(server) and len(left) >= 3  # the stub, its watchdog, the engine (and its workers, helpers)
        kill(server, stub)
        killed_at = time.monotonic()
        while still_running(left) and time.monotonic() - killed_at < 30:
            time.sleep(0.5)
        yield server, left, time.monotonic() - killed_at, streams
        results = streams.join(timeout=30)
        assert len(results) == 2 and all(r.error is not None for r in results), results  # none left hanging
    finally:
        server.stop()


def test_a_killed_server_leaves_no_engine_behind(tmp_path):
    """Triton killed (or crashed) with streams in flight: its stub, re-parented away, stops vLLM's engine and
    exits (both stayed for as long as anyone looked, holding their memory; a GPU's, on a GPU). Now and then the
    stub never runs Python again after the kill (the next test makes that case every time) and its watchdog stops
    everything 10 s later instead: in CI once in about 14 runs of this test, at a0ab376 (2026-12-07)."""
    with killed_with_streams_in_flight(tmp_path, lambda server, stub: server.process.kill()) as (server, left, gone_after, _):
        assert still_running(left) == [] and gone_after < 20
        log = server.log_path.read_text(errors="replace")
        assert "is gone: stopping the engine and this stub" in log or "[vllm] watchdog:" in log, log[-2000:]


def test_a_killed_server_whose_stub_cannot_run_leaves_nothing_behind(tmp_path):
    """Now and then a stub left by a killed Triton never runs Python again (a call into its IPC blocks on the dead
    server: 6 in 38 kills here), so its own watcher cannot stop the engine. Stopped with SIGSTOP, the stub is that
    case every time: ENGINE_STOP_WAIT_S (10 s) after Triton's death its watchdog kills it, the engine, the engine's
    workers and multiprocessing's helpers (without it, all of them stayed)."""
    def stop_stub_then_kill_triton(server: TritonServer, stub: psutil.Process) -> None:
        stub.suspend()
        server.process.kill()

    with killed_with_streams_in_flight(tmp_path, stop_stub_then_kill_triton) as (server, left, gone_after, _):
        assert still_running(left) == [] and gone_after < 15
        assert "[vllm] watchdog:" in server.log_path.read_text(errors="replace")


def test_a_killed_stub_leaves_no_engine_behind(tmp_path):
    """A stub killed (the OOM killer) or crashed: its engine and workers, re-parented, ran on for 40 minutes;
    its watchdog kills them 10 s later. Triton 2.51 itself mostly runs on, sends the dead stub's streams nothing
    and cannot unload the model (its unload waits until the exit timeout): only a new server serves it again. A
    stub killed while it holds a lock of the memory it shares with Triton takes Triton down with it: Triton's
    Python backend meets the dead owner's lock, throws `boost::interprocess::lock_exception` and aborts (once in
    the dozen CI runs of this test by 2026-12-07). Either way nothing of the stub's may stay behind."""
    with killed_with_streams_in_flight(tmp_path, lambda server, stub: stub.kill()) as (server, left, gone_after, streams):
        assert still_running(left) == [] and gone_after < 15
        log = server.log_path.read_text(errors="replace")
        assert "[vllm] watchdog:" in log
        if server.process.poll() is None:
            assert streams.results == []  # Triton runs on; the streams wait
            server.process.kill()  # what ends them
        else:
            assert server.process.returncode == -signal.SIGABRT and "boost::interprocess::lock_exception" in log


def test_a_server_that_exits_after_loading_leaves_nothing_behind(tmp_path):
    """Triton binds its ports only once the model is loaded; when one is taken by then it exits, and its stub
    and vLLM's engine, re-parented away from it, must not stay behind (both did, in CI on 2026-12-03)."""
    repository = prepare_run_repository(tmp_path / "model_repository", log=lambda _: None)
    server = TritonServer(repository, run_dir=tmp_path / "run", free_ports=True)
    server.start()
    with socket.socket() as taker:
        taker.bind(("127.0.0.1", server.ports.grpc))
        taker.listen()
        with pytest.raises(ServerError, match="exited with code"):
            server.wait_ready(timeout=900, progress=False)
    assert "GRPC" in server.log_tail(200) and "already in use" in server.log_tail(200)
    assert processes_tagged(server.shm_prefix) == []
    assert list(Path("/dev/shm").glob(f"{server.shm_prefix}*")) == []


def test_a_queue_delay_the_backend_cannot_use_fails_the_load_naming_it(tmp_path):
    """A config.pbtxt edited by hand past utils.repository's check: the backend refuses to load, before it starts
    an engine, and the server's error says which parameter and why."""
    repository = prepare_run_repository(tmp_path / "model_repository", log=lambda _: None)
    config_path = repository / "vllm_model" / "config.pbtxt"
    config = read_config(config_path)
    config.parameters["max_queue_delay_microseconds"].string_value = "2000"
    config.parameters["queue_quiet_microseconds"].string_value = "3000"
    config_path.write_text(config_to_text(config))
    server = TritonServer(repository, run_dir=tmp_path / "run", free_ports=True)
    server.start()
    try:
        with pytest.raises(ServerError, match=r"'queue_quiet_microseconds' \(3000\) exceeds 'max_queue_delay_microseconds'"):
            server.wait_ready(timeout=900, progress=False)
    finally:
        server.stop()
    assert "EngineCore" not in server.log_path.read_text(errors="replace")
    assert processes_tagged(server.shm_prefix) == []


NEIGHBOUR_MODEL = """import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        release = os.path.join(args["model_repository"], "release")
        deadline = time.monotonic() + 600
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.1)

    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[]) for _ in requests]
"""


def add_slow_neighbour(repository: Path) -> Path:
    """A Python model whose load lasts until its folder holds a file named ``release``: until then the server
    is not ready, whatever the vLLM model's state. Returns the file to create."""
    folder = repository / "slow_neighbour"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(NEIGHBOUR_MODEL)
    config = mc.ModelConfig(name="slow_neighbour", backend="python", max_batch_size=0)
    config.input.add(name="IN", data_type=mc.TYPE_INT32, dims=[1])
    (folder / "config.pbtxt").write_text(text_format.MessageToString(config))
    return folder / "release"


def test_a_model_that_loads_longer_leaves_the_vllm_model_serving(tmp_path):
    """The vLLM model is ready while a neighbour still loads, so the server answers readiness questions with
    "Server not ready"; asked anyway, they printed tracebacks (and can corrupt the stub's shared memory: two
    instances crashed the server on 2026-12-03). With no request in flight the backend asks none."""
    repository = prepare_run_repository(tmp_path / "model_repository", log=lambda _: None)
    release = add_slow_neighbour(repository)
    server = TritonServer(repository, run_dir=tmp_path / "run", free_ports=True)
    server.start()
    try:
        deadline = time.monotonic() + 900
        while "[vllm] vllm_model ready" not in server.log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline and server.process.poll() is None, server.log_tail(40)
            time.sleep(0.5)
        time.sleep(3)  # six health polls of the vLLM model while the server is not ready
        release.touch()
        server.wait_ready(timeout=120, progress=False)
        prompt = "The capital of France is"
        status, body = generate(server.http_url, {"text_input": prompt, "temperature": 0, "max_tokens": 4})
        assert status == 200 and is_continuation(body["text_output"], prompt), body
        assert "Server not ready" not in server.log_path.read_text(errors="replace")
    finally:
        server.stop()
