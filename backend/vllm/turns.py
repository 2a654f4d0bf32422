"""How the backend's one sender shares the event loop with vLLM's output processing, and in which order it
serves the streams. Nothing here imports Triton or vLLM, so the rules are tested on their own
(tests/test_sender_turns.py)."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Hashable


class SendQueue:
    """The streams that have something to send, in two lines, each in order of arrival: first responses, then
    the rest. A client waits longest for its first response (its time to first token), and a request has only
    one, so letting it pass costs the others little. A stream waits in the queue at most once: what its request
    produces meanwhile joins the response it will get."""

    def __init__(self) -> None:
        self._first: OrderedDict[Hashable, object] = OrderedDict()
        self._later: OrderedDict[Hashable, object] = OrderedDict()

    def add(self, key: Hashable, stream: object, first: bool) -> bool:
        """Queue ``stream`` at the end of its line unless it is already waiting; True if it joined."""
        if key in self._first or key in self._later:
            return False
        (self._first if first else self._later)[key] = stream
        return True

    def discard(self, key: Hashable) -> None:
        self._first.pop(key, None)
        self._later.pop(key, None)

    def pop(self) -> object:
        """The next stream to serve: the longest-waiting first response, else the longest-waiting other."""
        return (self._first or self._later).popitem(last=False)[1]

    def clear(self) -> None:
        self._first.clear()
        self._later.clear()

    def __len__(self) -> int:
        return len(self._first) + len(self._later)


def send_one_turn(
    ready: SendQueue, deliver: Callable[[object], None], allowance_s: float, clock: Callable[[], float] = time.perf_counter
) -> int:
    """Send the streams waiting in ``ready``, in its order, one response each, until ``allowance_s`` has been
    spent (at least one send). Returns how many were sent.

    The sender passes the time since its previous turn ended as the allowance: while the engine's outputs
    keep the loop busy, sending then gets as much of it as processing them (half and half), and when the
    loop has nothing else to do a turn sends everything waiting. A stream not reached waits at the front of
    its line for the next turn.
    """
    started = clock()
    sent = 0
    while ready:
        deliver(ready.pop())
        sent += 1
        if clock() - started >= allowance_s:
            break
    return sent
