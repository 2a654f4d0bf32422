"""The rule by which the backend's sender shares the event loop with vLLM's output processing, on made-up
timings (the sender itself runs inside Triton's stub; tests/test_backend.py streams through it)."""

from __future__ import annotations

import importlib.util
from collections import OrderedDict

from utils.paths import backend_source

_spec = importlib.util.spec_from_file_location("backend_turns", backend_source() / "turns.py")
turns = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(turns)

SEND_S = 0.00025  # one response: an IPC round trip to the Triton process (0.17-0.29 ms measured on an H200)


class FakeClock:
    """A clock that moves only when a response is sent, so a turn's length is counted in sends."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_turn(waiting: list[str], allowance_s: float) -> tuple[list[str], list[str]]:
    clock = FakeClock()
    ready = OrderedDict((name, name) for name in waiting)
    sent: list[str] = []

    def deliver(stream: str) -> None:
        sent.append(stream)
        clock.now += SEND_S

    assert turns.send_one_turn(ready, deliver, allowance_s, clock) == len(sent)
    return sent, list(ready)


def test_a_turn_sends_for_as_long_as_the_allowance_longest_waiting_first():
    sent, left = run_turn([f"r{i}" for i in range(256)], allowance_s=4 * SEND_S)
    assert sent == ["r0", "r1", "r2", "r3"]  # 1 ms of sending at 0.25 ms each
    assert left[0] == "r4" and len(left) == 252  # the rest wait, in order, for the next turn


def test_a_turn_sends_at_least_one_response_even_with_no_allowance():
    sent, left = run_turn(["a", "b"], allowance_s=0.0)
    assert sent == ["a"] and left == ["b"]


def test_an_idle_loop_gives_a_turn_enough_to_send_everything_waiting():
    sent, left = run_turn([f"r{i}" for i in range(64)], allowance_s=1.0)
    assert len(sent) == 64 and left == []
