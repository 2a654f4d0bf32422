"""How an instance waits on what lies outside it: Triton's answers (a question that fails or hangs is no
answer, quietly; readiness asked over HTTP, at the address on Triton's command line) and other engines'
starts on the GPU (one at a time, across processes). The rules run inside Triton's stub;
tests/test_instances.py and tests/test_lifecycle.py run them there."""

from __future__ import annotations

import http.server
import importlib.util
import multiprocessing
import re
import socket
import threading
import time
import urllib.request

import pytest

from utils.paths import backend_source

_spec = importlib.util.spec_from_file_location("backend_coordination", backend_source() / "coordination.py")
coordination = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(coordination)

HOLD_S = 1.0


@pytest.fixture
def thread_failures(monkeypatch) -> list:
    """What threads raised (Python prints it to stderr, which in a server is its log)."""
    failures: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    return failures


def test_an_answer_comes_back(thread_failures):
    assert coordination.answer_within(lambda: True, wait_s=2) is True
    assert coordination.answer_within(lambda: False, wait_s=2) is False


def test_a_question_that_fails_is_no_answer_and_prints_nothing(thread_failures):
    def server_not_ready() -> bool:
        raise RuntimeError("Failed to check model readiness: Server not ready")

    assert coordination.answer_within(server_not_ready, wait_s=2) is None
    time.sleep(0.1)  # the asking thread has ended
    assert thread_failures == []


def test_a_question_left_waiting_is_no_answer_after_the_wait(thread_failures):
    started = time.perf_counter()
    assert coordination.answer_within(lambda: time.sleep(3) or True, wait_s=0.2) is None
    assert time.perf_counter() - started < 1.0


def hold_the_start(on_gpu: bool, lock_dir: str, both_ready, results) -> None:
    lines: list[str] = []
    both_ready.wait()  # spawned processes take their own time to start: both ask for the start at once
    with coordination.one_engine_start_at_a_time(on_gpu, lines.append, lock_dir=coordination.Path(lock_dir)):
        entered = time.time()
        time.sleep(HOLD_S)
        left = time.time()
    results.put((entered, left, lines))


def starts_of_two_processes(on_gpu: bool, lock_dir) -> list[tuple[float, float, list[str]]]:
    # spawned, not forked: a fork of this process, whose earlier tests left gRPC's threads running, hung on the GPU
    # machine (2026-12-06: "Other threads are currently calling into gRPC, skipping fork() handlers")
    context = multiprocessing.get_context("spawn")
    results, both_ready = context.Queue(), context.Barrier(2)
    processes = [context.Process(target=hold_the_start, args=(on_gpu, str(lock_dir), both_ready, results))
                 for _ in range(2)]
    for process in processes:
        process.start()
    try:
        return sorted(results.get(timeout=60) for _ in processes)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():  # multiprocessing joins its children at exit: a hung one would hold pytest's
                process.kill()


def test_engines_on_a_gpu_start_one_after_the_other(tmp_path):
    (first_in, first_out, first_lines), (second_in, _, second_lines) = starts_of_two_processes(True, tmp_path)
    assert second_in >= first_out
    assert first_lines == []
    assert len(second_lines) == 1 and re.fullmatch(r"waited \d+\.\d s for another engine .*", second_lines[0]), second_lines
    assert (tmp_path / coordination.START_LOCK_NAME).exists()


def test_engines_on_a_cpu_start_together(tmp_path):
    (first_in, first_out, _), (second_in, _, _) = starts_of_two_processes(False, tmp_path)
    assert second_in < first_out
    assert not (tmp_path / coordination.START_LOCK_NAME).exists()


def test_the_http_address_comes_from_tritons_command_line():
    address = coordination.triton_http_address
    assert address(["tritonserver", "--model-repository=/m"]) == "127.0.0.1:8000"
    assert address(["tritonserver", "--http-address=127.0.0.1", "--http-port=21286"]) == "127.0.0.1:21286"
    assert address(["tritonserver", "--http-port", "9000", "--http-address", "10.0.0.5"]) == "10.0.0.5:9000"
    assert address(["tritonserver", "--http-address=::1", "--http-port=9000"]) == "[::1]:9000"
    assert address(["tritonserver", "--http-address=0.0.0.0"]) == "127.0.0.1:8000"
    assert address(["tritonserver", "--allow-http=false"]) is None


class ReadinessAnswers(http.server.BaseHTTPRequestHandler):
    """A stand-in for Triton's endpoint: ready models answer 200, others 400, 'slow' after 5 s."""

    def do_GET(self) -> None:
        if self.path.endswith("/slow/ready"):
            time.sleep(5)
        self.send_response(200 if self.path == "/v2/models/ready_model/ready" else 400)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def endpoint():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ReadinessAnswers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_readiness_over_http_is_an_answer_even_when_refused(endpoint):
    assert coordination.model_ready_over_http(endpoint, "ready_model", timeout=2) is True
    assert coordination.model_ready_over_http(endpoint, "unloading_model", timeout=2) is False


def test_a_proxy_in_the_environment_is_not_asked(endpoint, monkeypatch):
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("no_proxy", "")
    monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen's opener reads the environment when first built
    assert coordination.model_ready_over_http(endpoint, "ready_model", timeout=2) is True


def test_a_closed_endpoint_is_not_ready_and_a_slow_one_is_no_answer(endpoint):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{probe.getsockname()[1]}"
    assert coordination.model_ready_over_http(closed, "ready_model", timeout=2) is False
    ask_slow = lambda: coordination.model_ready_over_http(endpoint, "slow", timeout=0.5)  # noqa: E731
    assert coordination.answer_within(ask_slow, wait_s=3) is None
