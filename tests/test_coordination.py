"""How an instance waits on what lies outside it: Triton's answers (a question that fails or hangs is no
answer, quietly) and other engines' starts on the GPU (one at a time, across processes). The rules run inside
Triton's stub; tests/test_instances.py starts two instances through them."""

from __future__ import annotations

import importlib.util
import multiprocessing
import re
import threading
import time

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


def hold_the_start(on_gpu: bool, lock_dir: str, results) -> None:
    lines: list[str] = []
    with coordination.one_engine_start_at_a_time(on_gpu, lines.append, lock_dir=coordination.Path(lock_dir)):
        entered = time.time()
        time.sleep(HOLD_S)
        left = time.time()
    results.put((entered, left, lines))


def starts_of_two_processes(on_gpu: bool, lock_dir) -> list[tuple[float, float, list[str]]]:
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    processes = [context.Process(target=hold_the_start, args=(on_gpu, str(lock_dir), results)) for _ in range(2)]
    for process in processes:
        process.start()
    spans = sorted(results.get(timeout=30) for _ in processes)
    for process in processes:
        process.join(timeout=10)
    return spans


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
