"""How responses reach Triton: a request's output collector rings a doorbell when it has something new, the event
loop builds the response, and one thread sends it (``Outbox``: first and final responses first); how often vLLM
builds response objects for a streaming request (``OutputPace``). Nothing here imports Triton or vLLM, so the
rules are tested on their own (tests/test_sending.py)."""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable


class Doorbell:
    """Stands in for the ``ready`` event of vLLM's per-request output collector (``RequestOutputCollector``), so
    the engine's output handler queues the request for sending itself instead of waking a task per request.

    The collector calls ``set`` when an output arrives while none is waiting (later ones merge into the waiting
    one) and ``clear`` when the sender takes it: a request is marked pending once per response. Nothing
    awaits the collector (its ``get`` would wait on this), so at 256 streams no 256 task switches follow each
    engine step (a micro-benchmark on CPU, 256 collectors: 1.9-2.0 ms per step with a task per request iterating
    them as ``AsyncLLM.generate`` does, 0.6-0.7 ms with the sender taking the outputs).
    """

    __slots__ = ("_ring",)

    def __init__(self, ring: Callable[[], None]) -> None:
        self._ring = ring

    def set(self) -> None:
        self._ring()

    def clear(self) -> None:
        """Nothing to undo: the sender has taken the output, and the next one rings again."""


def rings_the_doorbell(collector: object) -> bool:
    """Whether ``collector``, a fresh vLLM ``RequestOutputCollector``, calls its ``ready`` event's ``set`` when
    an output arrives. The backend relies on it; a vLLM release that signals some other way would leave every
    request unanswered, so the backend checks at load and refuses to load instead."""
    rung: list[bool] = []
    try:
        collector.ready = Doorbell(lambda: rung.append(True))
        collector.put(RuntimeError("a probe, not an error"))
    except Exception:  # noqa: BLE001 - a collector that cannot take this is one the backend cannot use
        return False
    return bool(rung)


class Outbox:
    """Responses built on the event loop, waiting for the sending thread: an urgent line (first responses, final
    responses and closes: each request has one of each, and its client waits for them: its time to first token,
    and in a closed loop its next request) served before the other, each in order of arrival. One producer
    (the loop) and one consumer (the sending thread); ``get`` blocks without holding the GIL."""

    STOP = object()

    def __init__(self) -> None:
        self._urgent: deque = deque()
        self._other: deque = deque()
        self._waiting = threading.Semaphore(0)

    def put(self, item: object, urgent: bool) -> None:
        (self._urgent if urgent else self._other).append(item)
        self._waiting.release()

    def get(self) -> object:
        """The next item: the oldest urgent one, else the oldest other; waits for one."""
        self._waiting.acquire()
        return (self._urgent or self._other).popleft()

    def stop(self) -> None:
        """The consumer's ``get`` returns ``STOP`` once every item put before it is taken."""
        self.put(self.STOP, urgent=False)

    def __len__(self) -> int:
        return len(self._urgent) + len(self._other)


class OutputPace:
    """How many new tokens vLLM gathers per streaming request before it builds a response object for it.

    vLLM's output processor builds a response object per request per engine step, and the request's output
    collector merges it into the waiting one: about half of the event loop's output processing (vLLM's own
    OutputProcessor on made-up outputs, 64 and 256 streams: ``scripts/frontend-bench.py``). The sender takes a
    request's merged output only once its previous response is sent, and under load a response carries many
    tokens (10-30 on an H200 when the loop itself sent, in turns),
    so most of those objects are only merged away. vLLM builds one every ``stream_interval`` tokens per request
    instead (the first token and the last always at once); the backend sets it per request to half the tokens
    per response the sender has been sending (``interval``), so the sender still finds new tokens when it
    comes, and an idle server's streams keep one token per response (when the sender keeps up, a response
    carries the interval's tokens, so the next interval is half of it: back to 1 within a few dozen responses)."""

    SMOOTHING = 0.05  # weight of the newest response: about the last 20
    SHARE = 0.5
    LIMIT = 16

    def __init__(self) -> None:
        self._tokens_per_response = 1.0

    def observe(self, tokens: int) -> None:
        """A later response (not a request's first: that one always carries a single token) went out."""
        self._tokens_per_response += self.SMOOTHING * (tokens - self._tokens_per_response)

    def interval(self) -> int:
        return max(1, min(self.LIMIT, round(self._tokens_per_response * self.SHARE)))
