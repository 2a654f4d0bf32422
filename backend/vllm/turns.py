"""How the backend's one sender shares the event loop with vLLM's output processing. Nothing here imports
Triton or vLLM, so the rule is tested on its own (tests/test_sender_turns.py)."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable


def send_one_turn(
    ready: OrderedDict, deliver: Callable[[object], None], allowance_s: float, clock: Callable[[], float] = time.perf_counter
) -> int:
    """Send the streams waiting in ``ready``, longest waiting first, one response each, until ``allowance_s``
    has been spent (at least one send). Returns how many were sent.

    The sender passes the time since its previous turn ended as the allowance: while the engine's outputs
    keep the loop busy, sending then gets as much of it as processing them (half and half), and when the
    loop has nothing else to do a turn sends everything waiting. A stream not reached waits at the front
    for the next turn, and what its request produces meanwhile joins the response it will get.
    """
    started = clock()
    sent = 0
    while ready:
        _, stream = ready.popitem(last=False)
        deliver(stream)
        sent += 1
        if clock() - started >= allowance_s:
            break
    return sent
