"""Sender threads: the backend's responses leave from here, off the engine's event loop. Nothing here imports
Triton or vLLM, so the mechanism is tested on its own (tests/test_outbox.py).

A Triton ``send`` is an IPC round trip to the server process (0.17-0.29 ms measured on an H200) during which
the stub releases the GIL, and the server handles the sends of one model in a thread pool. Sent from the
event loop, each round trip stalled vLLM's output processing; sent from a few threads, several are in
flight at once and the loop keeps processing meanwhile. A thread that comes back from its round trip asks
for the GIL, which the loop then gives up after Python's switch interval: at the default 5 ms a thread could
send only ~200 responses a second while the loop was busy, so the stub process uses a shorter one
(``SWITCH_INTERVAL_S``, set by the backend for its own process).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, Protocol, TypeVar

SENDER_THREADS = 4
SWITCH_INTERVAL_S = 0.0005  # 2-core CPU, 4 threads: ~4000 GIL-free 0.2 ms round trips/s against ~600 at 5 ms

Item = TypeVar("Item")
C = TypeVar("C", bound="Content")
_STOP = object()


class SenderThreads(Generic[Item]):
    """Threads that deliver what the loop posts, first posted first delivered.

    ``deliver(item)`` returns True when the item has more to send (it arrived during the round trip): the
    item then goes to the back of the queue, behind the others waiting, and no two threads ever hold the
    same item at once as long as the poster posts an item only while no thread holds it (``Mailbox``).
    """

    def __init__(self, deliver: Callable[[Item], bool], threads: int = SENDER_THREADS, name: str = "triton-send") -> None:
        self._deliver = deliver
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def post(self, item: Item) -> None:
        self._queue.put(item)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                if self._queue.empty():
                    return
                self._queue.put(_STOP)  # an item went back in behind the stop: deliver it first
                continue
            if self._deliver(item):
                self._queue.put(item)

    def stop(self, timeout_s: float) -> bool:
        """Deliver everything posted, then end the threads; False when one is still busy after the timeout."""
        for _ in self._threads:
            self._queue.put(_STOP)
        for thread in self._threads:
            thread.join(timeout_s)
        return not any(thread.is_alive() for thread in self._threads)


class Content(Protocol):
    def is_empty(self) -> bool: ...


class Mailbox(Generic[C]):
    """What one stream has not sent yet, shared by its writer (the loop) and the sender thread holding it.

    ``update`` changes the waiting content and says whether the stream must be posted to the sender threads
    (no thread holds it and it is not queued already); ``take`` hands a sender everything waiting;
    ``done_sending`` says whether more arrived meanwhile (the sender then keeps the stream queued). A lock
    makes the three exclusive; it is never held during a round trip.
    """

    def __init__(self, new_content: Callable[[], C]) -> None:
        self._lock = threading.Lock()
        self._new_content = new_content
        self._content = new_content()
        self._queued = False

    def update(self, change: Callable[..., None], *args) -> bool:
        """``change(content, *args)`` under the lock; True when the caller must post the stream."""
        with self._lock:
            change(self._content, *args)
            if self._queued:
                return False
            self._queued = True
            return True

    def take(self) -> C:
        with self._lock:
            content, self._content = self._content, self._new_content()
            return content

    def done_sending(self) -> bool:
        with self._lock:
            self._queued = not self._content.is_empty()
            return self._queued
