"""When the backend hands requests to vLLM's engine (``backend/vllm/admission.py``), on a real asyncio loop with
windows long enough for a busy CI machine; tests/test_lifecycle.py runs it inside Triton."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from utils.paths import backend_source

_spec = importlib.util.spec_from_file_location("backend_admission", backend_source() / "admission.py")
admission = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(admission)

QUIET_S = 0.06
LONGEST_S = 0.25


class Recorder:
    """What was admitted, and when (the loop's clock)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.admitted: list[tuple[str, float]] = []

    def __call__(self, request: object) -> None:
        self.admitted.append((request, self.loop.time()))

    def names(self) -> list[str]:
        return [name for name, _ in self.admitted]


async def arrivals(gaps_s: list[float], others_in_flight: bool = True) -> tuple[Recorder, float, "admission.Admission"]:
    """Offer r0, r1, ... with the given gaps before each; returns the recorder, the first arrival's time, the rule."""
    loop = asyncio.get_running_loop()
    recorder = Recorder(loop)
    rule = admission.Admission(loop, recorder, quiet_s=QUIET_S, longest_s=LONGEST_S)
    started = loop.time()
    for i, gap in enumerate(gaps_s):
        await asyncio.sleep(gap)
        rule.offer(f"r{i}", others_in_flight=others_in_flight)
    return recorder, started, rule


def test_a_request_with_nothing_in_flight_goes_in_at_once():
    async def scenario():
        recorder, _, rule = await arrivals([0.0], others_in_flight=False)
        assert recorder.names() == ["r0"] and len(rule) == 0  # synchronously, no timer

    asyncio.run(scenario())


def test_without_a_delay_every_request_goes_in_at_once():
    async def scenario():
        loop = asyncio.get_running_loop()
        recorder = Recorder(loop)
        rule = admission.Admission(loop, recorder, quiet_s=0.0, longest_s=0.0)  # config.pbtxt's default
        for name in ("a", "b", "c"):
            rule.offer(name, others_in_flight=True)
            assert recorder.names()[-1] == name and len(rule) == 0

    asyncio.run(scenario())


def test_requests_arriving_together_go_in_together_once_arrivals_stop():
    async def scenario():
        recorder, started, rule = await arrivals([0.0, 0.005, 0.005, 0.005])
        assert recorder.admitted == [] and len(rule) == 4
        await asyncio.sleep(QUIET_S + 0.1)
        assert recorder.names() == ["r0", "r1", "r2", "r3"]
        times = [t for _, t in recorder.admitted]
        assert max(times) - min(times) < 0.001  # one release, all four at once
        waited = times[0] - started
        assert QUIET_S + 0.015 - 0.005 <= waited < LONGEST_S  # a quiet period after the last arrival, not the first

    asyncio.run(scenario())


def test_a_steady_trickle_waits_no_longer_than_the_longest_window():
    async def scenario():
        recorder, started, rule = await arrivals([0.0] + [QUIET_S / 3] * 20)  # never quiet for QUIET_S, for 0.4 s
        first_batch = [t for _, t in recorder.admitted]
        assert first_batch, "nothing admitted although the longest window passed"
        assert first_batch[0] - started == pytest.approx(LONGEST_S, abs=0.05)
        await asyncio.sleep(LONGEST_S + 0.1)
        assert recorder.names() == [f"r{i}" for i in range(21)] and len(rule) == 0  # every one, in order, once

    asyncio.run(scenario())


def test_a_request_behind_held_ones_waits_with_them_even_when_alone_in_flight():
    async def scenario():
        loop = asyncio.get_running_loop()
        recorder = Recorder(loop)
        rule = admission.Admission(loop, recorder, quiet_s=QUIET_S, longest_s=LONGEST_S)
        rule.offer("held", others_in_flight=True)
        rule.offer("alone", others_in_flight=False)  # must not overtake the held one
        assert recorder.admitted == []
        await asyncio.sleep(QUIET_S + 0.1)
        assert recorder.names() == ["held", "alone"]

    asyncio.run(scenario())


def test_release_admits_every_held_request_now_and_no_timer_fires_later():
    async def scenario():
        recorder, _, rule = await arrivals([0.0, 0.001, 0.001])
        rule.release()
        assert recorder.names() == ["r0", "r1", "r2"] and len(rule) == 0
        await asyncio.sleep(LONGEST_S + 0.1)
        assert recorder.names() == ["r0", "r1", "r2"]  # the cancelled timer admitted nothing twice

    asyncio.run(scenario())


@pytest.mark.parametrize("quiet_s, longest_s", [(-0.001, 0.005), (0.006, 0.005)])
def test_windows_that_make_no_sense_are_refused(quiet_s, longest_s):
    with pytest.raises(ValueError, match="quiet_s <= longest_s"):
        admission.Admission(asyncio.new_event_loop(), print, quiet_s=quiet_s, longest_s=longest_s)
