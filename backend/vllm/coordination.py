"""Waiting on what lies outside an instance: Triton's answers to its questions, and other engines starting on
the same GPU. Nothing here imports Triton or vLLM, so both rules are tested on their own
(tests/test_coordination.py)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

START_LOCK_NAME = f"triton-vllm-gpu-engine-start-{os.getuid()}.lock"


def answer_within(question: Callable[[], bool], wait_s: float) -> bool | None:
    """``question()``'s answer, or None when it has none within ``wait_s`` or fails.

    Triton can keep a readiness question waiting on an unload that waits on this very instance, so the
    question is asked from a thread nobody joins past ``wait_s``. It fails while the server is not ready
    (starting up with another instance or model still loading, or shutting down): then there is no answer
    either, and the thread ends quietly instead of printing a traceback into the server's log.
    """
    answer: dict[str, bool] = {}

    def ask() -> None:
        with contextlib.suppress(Exception):
            answer["value"] = question()

    asker = threading.Thread(target=ask, name="ask-triton", daemon=True)
    asker.start()
    asker.join(wait_s)
    return answer.get("value")


@contextlib.contextmanager
def one_engine_start_at_a_time(
    on_gpu: bool, log: Callable[[str], None], lock_dir: Path | None = None
) -> Iterator[None]:
    """Hold this machine's GPU engine-start lock while an engine starts (on a GPU; a CPU engine starts at once).

    vLLM sizes its KV cache by profiling a step and counting the GPU memory that disappeared meanwhile as
    its own: an engine that starts while another allocates loses the other's share. On an H200, of two
    instances started together the second got 47,296 KV-cache tokens against the first's 902,384. A CPU
    engine's cache is a fixed size (VLLM_CPU_KVCACHE_SPACE), so CPU engines need no turn. The lock is a
    file lock (one per user, in the temporary directory), so it also spans servers and dies with its holder.
    """
    if not on_gpu:
        yield
        return
    path = (lock_dir or Path(tempfile.gettempdir())) / START_LOCK_NAME
    with open(path, "a") as handle:
        asked = time.perf_counter()
        fcntl.flock(handle, fcntl.LOCK_EX)
        waited_s = time.perf_counter() - asked
        if waited_s >= 0.1:
            log(f"waited {waited_s:.1f} s for another engine to finish starting on this machine's GPUs")
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
