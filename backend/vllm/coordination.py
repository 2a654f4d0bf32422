"""Waiting on what lies outside an instance: Triton's answers to its questions, and other engines starting on
the same GPU. Nothing here imports Triton or vLLM, so the rules are tested on their own
(tests/test_coordination.py)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

START_LOCK_NAME = f"triton-vllm-gpu-engine-start-{os.getuid()}.lock"
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # Triton is local: an http_proxy must not relay


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


def triton_http_address(command: list[str]) -> str | None:
    """Where the Triton of ``command`` (its command line) answers HTTP; None when HTTP is off.

    Triton takes ``--name=value`` and ``--name value``; it listens on 0.0.0.0:8000 unless told otherwise.
    """
    options: dict[str, str] = {}
    args = iter(command[1:])
    for arg in args:
        if arg.startswith("--"):
            name, has_value, value = arg[2:].partition("=")
            options[name] = value if has_value else next(args, "")
    if options.get("allow-http", "true").lower() in ("false", "0", "no", "off"):
        return None
    host = options.get("http-address", "0.0.0.0")
    host = "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{host}:{options.get('http-port', '8000')}"


def parent_command_line() -> list[str]:
    """The command line of the process that started this one (Triton, for a stub); empty when unreadable."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def model_ready_over_http(address: str, model: str, timeout: float) -> bool:
    """Triton's answer to ``GET /v2/models/<model>/ready``: a question it can refuse without harm.

    Refused (400: the model is not ready, or the server is shutting down) or unanswered (its endpoint
    closed) means not ready; a slow answer raises, for `answer_within` to count as none.
    """
    url = f"http://{address}/v2/models/{urllib.parse.quote(model)}/ready"
    try:
        with DIRECT.open(url, timeout=timeout) as reply:
            return reply.status == 200
    except urllib.error.HTTPError:
        return False
    except urllib.error.URLError as err:
        if isinstance(err.reason, TimeoutError):
            raise
        return False


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
