"""When a request reaches vLLM's engine: at once (the default), or, with a queue delay set in config.pbtxt, held while
others are in flight until the requests arriving close behind it can go in with it. Nothing here imports Triton or
vLLM, so the rule is tested on its own (tests/test_admission.py; tests/test_lifecycle.py runs it inside Triton).

Why it exists: vLLM's engine takes new requests in on the step that follows their arrival, and a step that takes
some in (prefill, ``GPUModelRunner.add_requests``) is longer than one that only decodes. Behind Triton a closed
loop's clients learn their requests finished one response at a time (each an IPC round trip from the stub), so
their next requests arrive spread over several steps: 0.31-0.44 steps taking new requests per request at 64 streams
against 0.20-0.22 for the in-process engine (H100s, 2026-12-06). It is Triton's ``max_queue_delay_microseconds`` for
a decoupled model: ``max_queue_delay_microseconds`` bounds the wait, and a held group goes in as soon as no request
has arrived for ``queue_quiet_microseconds`` (a wave of resubmissions is over). Off by default: a fixed window of
5 or 12 ms cut those steps to the in-process engine's count but bought no steady gain in requests/s on an H100 and
cost 3-14 ms of time to first token, and this quiet-period rule with a 5 ms delay served 0.94 / 1.03 / 1.00 of the
requests/s without it at 16 / 64 / 256 streams on an H100, at 3 ms more TTFT at 16 (2026-12-07, two rounds each
1-30 % apart; docs/gpu-measurements.md).
"""

from __future__ import annotations

import asyncio
from typing import Callable


class Admission:
    """Holds requests that arrive while others are in flight and admits them together (never, when ``longest_s`` is
    0: each goes in at once). ``admit`` is called with each request, in order of arrival, on the event loop's thread."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        admit: Callable[[object], None],
        quiet_s: float,
        longest_s: float,
    ) -> None:
        if not 0 <= quiet_s <= longest_s:
            raise ValueError(f"need 0 <= quiet_s <= longest_s, got {quiet_s} and {longest_s}")
        self._loop = loop
        self._admit = admit
        self._quiet_s = quiet_s
        self._longest_s = longest_s
        self._held: list[object] = []
        self._first_held_at = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def offer(self, request: object, others_in_flight: bool) -> None:
        """A valid request arrived: admitted now if nothing is held and nothing else is in flight (or there is no
        window), else held."""
        if not self._held and (not others_in_flight or self._longest_s == 0):
            self._admit(request)
            return
        now = self._loop.time()
        if not self._held:
            self._first_held_at = now
        self._held.append(request)
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(min(now + self._quiet_s, self._first_held_at + self._longest_s), self.release)

    def release(self) -> None:
        """Admit every held request now, in order of arrival (the window closed, or the model is stopping)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        held, self._held = self._held, []
        for request in held:
            self._admit(request)

    def __len__(self) -> int:
        return len(self._held)
