"""How the backend's one sender learns which streams have something to send, shares the event loop with vLLM's
output processing, and in which order it serves the streams. Nothing here imports Triton or vLLM, so the rules
are tested on their own (tests/test_sender_turns.py)."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Hashable


class SendQueue:
    """The streams that have something to send, in two lines, each in order of arrival: urgent responses (a
    request's first and its final one), then the rest. A client waits longest for its first response (its time
    to first token); the final one frees the client (a closed loop's next request waits on it) and the engine's
    slot was freed already, so a final response held back is time the engine has nothing to do for it. A
    request has only one of each, so letting them pass costs the others little. A stream waits in the queue at
    most once: what its request produces meanwhile joins the response it will get."""

    def __init__(self) -> None:
        self._urgent: OrderedDict[Hashable, object] = OrderedDict()
        self._later: OrderedDict[Hashable, object] = OrderedDict()

    def add(self, key: Hashable, stream: object, urgent: bool) -> bool:
        """Queue ``stream`` at the end of its line unless it is already waiting; True if it joined."""
        if key in self._urgent or key in self._later:
            return False
        (self._urgent if urgent else self._later)[key] = stream
        return True

    def hurry(self, key: Hashable) -> None:
        """A waiting stream's response became urgent (its request finished): it moves to the urgent line."""
        stream = self._later.pop(key, None)
        if stream is not None:
            self._urgent[key] = stream

    def discard(self, key: Hashable) -> None:
        self._urgent.pop(key, None)
        self._later.pop(key, None)

    def pop(self) -> object:
        """The next stream to serve: the longest-waiting urgent response, else the longest-waiting other."""
        return (self._urgent or self._later).popitem(last=False)[1]

    def has_urgent(self) -> bool:
        """Whether an urgent response is waiting."""
        return bool(self._urgent)

    def clear(self) -> None:
        self._urgent.clear()
        self._later.clear()

    def __len__(self) -> int:
        return len(self._urgent) + len(self._later)


class Doorbell:
    """Stands in for the ``ready`` event of vLLM's per-request output collector (``RequestOutputCollector``), so
    the engine's output handler queues the request for sending itself instead of waking a task per request.

    The collector calls ``set`` when an output arrives while none is waiting (later ones merge into the waiting
    one) and ``clear`` when the sender takes it: a request joins the send queue once per response. Nothing
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


def hurry_when_finished(collector: object, hurry: Callable[[], None]) -> None:
    """Call ``hurry`` whenever vLLM puts a finished output into ``collector`` (a ``RequestOutputCollector``).

    The collector rings the doorbell only for an output that finds it empty: under load a request's final
    output usually merges into one already waiting, and would wait for its turn among the later responses.
    vLLM's output processor calls the collector's ``put`` as an attribute, so this instance's ``put`` is
    replaced; ``stop_hurrying`` undoes it (the replacement refers back to the collector)."""
    put = type(collector).put

    def put_then_hurry(output: object) -> None:
        put(collector, output)
        if getattr(output, "finished", False):
            hurry()

    collector.put = put_then_hurry


def stop_hurrying(collector: object) -> None:
    vars(collector).pop("put", None)


# The share of a turn's allowance later responses get (first and final responses are never held back). Measured side by
# side on one H200 (2026-12-04, 256 streams, HTTP / gRPC): 1.0 (sending and output processing half and half)
# served 129 / 130 requests/s with 7-8 tokens per response, TTFT p50 526 / 308 ms; 0.25 served 195 / 182 with
# 22-25 tokens per response, TTFT p50 276 / 164 ms (the in-process engine: 199, 152 ms). Only these two were measured.
LATER_SHARE = 0.25


def send_one_turn(
    ready: SendQueue, deliver: Callable[[object], None], allowance_s: float, clock: Callable[[], float] = time.perf_counter
) -> int:
    """Send every urgent response waiting in ``ready`` (first and final ones), then later responses in order
    of waiting until ``LATER_SHARE`` of ``allowance_s`` has been spent on them (at least one). Returns how many
    were sent.

    The sender passes the time since its previous turn ended as the allowance, which under load is the time
    the loop spent processing the engine's outputs. Each send is an IPC round trip during which the loop
    does nothing else, so the less of the loop sending takes, the more outputs it processes and the more
    tokens each later response carries; a first response is what a client waits longest for, a final one
    what its next request waits for, and each request has one of each, so those all go at once. After the
    loop has been idle, the allowance is the idle time and a turn sends what it can of the backlog. A stream
    not reached waits at the front of its line.
    """
    sent = 0
    while ready.has_urgent():
        deliver(ready.pop())
        sent += 1
    started = clock()
    while ready:
        deliver(ready.pop())
        sent += 1
        if clock() - started >= allowance_s * LATER_SHARE:
            break
    return sent


class OutputPace:
    """How many new tokens vLLM gathers per streaming request before it builds a response object for it.

    vLLM's output processor builds a response object per request per engine step, and the request's output
    collector merges it into the waiting one: about half of the event loop's output processing (vLLM's own
    OutputProcessor on made-up outputs, 64 and 256 streams: ``scripts/frontend-bench.py``). The sender takes a
    request's merged output only when its turn comes, and under load a response carries 10-30 tokens (H200),
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
