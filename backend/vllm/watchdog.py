"""A process beside each stub that ends it, and all it started, when Triton dies and the stub does not.

When Triton is killed with streams in flight, the stub's own watcher (``VllmModel._leave_with_triton``) stops
vLLM's engine and exits. Now and then it cannot: a call into the stub's IPC blocks for good on the dead
server and no Python thread of the stub runs again, a timer's ``os._exit`` included (4 in 28 kills on 2 CPU
cores, 2026-12-07; py-spy 15 s after the kill: the 10 s timer still waiting, the cancellation poller blocked
inside ``is_cancelled``). vLLM's engine and worker processes outlive a killed stub, so this watchdog ends the
whole tree. It needs no Python of the stub's to run: a separate interpreter, stdlib only, run by path
with ``-I``, waiting on pidfds (no polling, no pid reused by mistake).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from pathlib import Path


def start_watchdog(triton_pid: int, grace_s: float) -> subprocess.Popen:
    """Watch this process (a stub) and Triton, its parent: ``grace_s`` after Triton dies, if this process is
    still there, it and every process below it are killed."""
    return subprocess.Popen(
        [sys.executable, "-I", str(Path(__file__).resolve()), str(triton_pid), str(os.getpid()), str(grace_s)],
        stdin=subprocess.DEVNULL, close_fds=True,
    )


def parent_of(pid: int) -> int:
    """``pid``'s parent, from /proc (raises OSError once ``pid`` is gone)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc (the stub's engine, its workers, multiprocessing's helpers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                children.setdefault(parent_of(int(entry.name)), []).append(int(entry.name))
    found, pending = [], list(children.get(pid, []))
    while pending:
        child = pending.pop()
        found.append(child)
        pending.extend(children.get(child, []))
    return found


def watch(triton_pid: int, stub_pid: int, grace_s: float) -> bool:
    """Wait until the stub ends (True: nothing to do) or Triton does; then give the stub ``grace_s`` to stop
    its engine and exit on its own, and kill what is left (False). Triton may already be gone when this
    starts (the stub is then no longer its child): the grace starts at once."""
    try:
        stub = os.pidfd_open(stub_pid)
    except ProcessLookupError:
        return True
    poller = select.poll()
    poller.register(stub, select.POLLIN)
    with contextlib.suppress(OSError):
        triton = os.pidfd_open(triton_pid)
        if parent_of(stub_pid) == triton_pid:
            poller.register(triton, select.POLLIN)
            if stub in {fd for fd, _ in poller.poll()}:
                return True
            poller.unregister(triton)
    if poller.poll(int(grace_s * 1000)):
        return True
    left = [pid for pid in descendants(stub_pid) if pid != os.getpid()]
    print(f"[vllm] watchdog: the stub {stub_pid} outlived Triton by {grace_s:.0f} s: killing it and {len(left)} "
          "process(es) below it", file=sys.stderr, flush=True)
    signal.pidfd_send_signal(stub, signal.SIGKILL)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return False


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
