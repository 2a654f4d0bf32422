"""The backend's sender threads and mailboxes (backend/vllm/outbox.py) with made-up streams: several sends in
flight at once, never two on one stream, nothing lost or reordered, nothing left behind by ``stop``. The
real sends run inside Triton's stub: tests/test_backend.py streams through them."""

from __future__ import annotations

import importlib.util
import random
import threading
import time

from utils.paths import backend_source

_spec = importlib.util.spec_from_file_location("backend_outbox", backend_source() / "outbox.py")
outbox = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(outbox)


class Tokens:
    """Mailbox content: token numbers written by the loop, in order."""

    def __init__(self) -> None:
        self.items: list[int] = []

    def add(self, token: int) -> None:
        self.items.append(token)

    def is_empty(self) -> bool:
        return not self.items


class FakeStream:
    def __init__(self) -> None:
        self.mailbox = outbox.Mailbox(Tokens)
        self.received: list[int] = []
        self.holders = 0


def test_a_mailbox_asks_to_be_posted_only_when_no_sender_has_it():
    mailbox = outbox.Mailbox(Tokens)
    assert mailbox.update(Tokens.add, 1) is True  # first output: post it
    assert mailbox.update(Tokens.add, 2) is False  # already queued: the output just merges
    assert mailbox.take().items == [1, 2]
    assert mailbox.update(Tokens.add, 3) is False  # a sender holds it: it will see this when done
    assert mailbox.done_sending() is True  # more arrived during the round trip: keep it queued
    assert mailbox.take().items == [3]
    assert mailbox.done_sending() is False  # nothing new: the next output posts it again
    assert mailbox.update(Tokens.add, 4) is True


def test_sends_of_different_streams_are_in_flight_at_once():
    together = threading.Barrier(outbox.SENDER_THREADS, timeout=10)  # breaks unless all threads send at once

    def deliver(stream: FakeStream) -> bool:
        stream.mailbox.take()
        together.wait()  # a blocked round trip (the GIL is released, as the stub's send does)
        return stream.mailbox.done_sending()

    senders = outbox.SenderThreads(deliver)
    streams = [FakeStream() for _ in range(outbox.SENDER_THREADS)]
    for stream in streams:
        assert stream.mailbox.update(Tokens.add, 0)
        senders.post(stream)
    assert senders.stop(timeout_s=15)
    assert not together.broken


def test_every_output_arrives_once_in_order_and_no_stream_is_sent_by_two_threads_at_once():
    streams = [FakeStream() for _ in range(32)]
    overlaps: list[FakeStream] = []
    guard = threading.Lock()

    def deliver(stream: FakeStream) -> bool:
        with guard:
            stream.holders += 1
            if stream.holders > 1:
                overlaps.append(stream)
        stream.received.extend(stream.mailbox.take().items)
        time.sleep(random.uniform(0, 0.0005))  # the round trip, GIL released
        with guard:
            stream.holders -= 1
        return stream.mailbox.done_sending()

    senders = outbox.SenderThreads(deliver)
    written = {id(stream): [] for stream in streams}
    for token in range(200):  # the loop: outputs for every stream, step after step
        for stream in streams:
            written[id(stream)].append(token)
            if stream.mailbox.update(Tokens.add, token):
                senders.post(stream)
        if token % 20 == 0:
            time.sleep(0.001)
    assert senders.stop(timeout_s=30)
    assert not overlaps
    assert all(stream.received == written[id(stream)] for stream in streams)


def test_stop_delivers_what_is_posted_and_what_arrives_during_a_send_first():
    first_send_started, more_written = threading.Event(), threading.Event()

    def deliver(stream: FakeStream) -> bool:
        stream.received.extend(stream.mailbox.take().items)
        if not first_send_started.is_set():
            first_send_started.set()
            more_written.wait(10)  # an output arrives during this round trip, after stop was called
        return stream.mailbox.done_sending()

    senders = outbox.SenderThreads(deliver, threads=1)
    stream = FakeStream()
    assert stream.mailbox.update(Tokens.add, 1)
    senders.post(stream)
    first_send_started.wait(10)
    stopping = threading.Thread(target=senders.stop, args=(10,))
    stopping.start()
    assert stream.mailbox.update(Tokens.add, 2) is False  # held by the sender: merges, goes back in the queue
    more_written.set()
    stopping.join(15)
    assert not stopping.is_alive()
    assert stream.received == [1, 2]
