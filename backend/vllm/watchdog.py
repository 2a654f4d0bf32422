"""A process beside each stub that ends what the stub started when Triton or the stub dies without stopping it.

When Triton is killed with streams in flight, the stub's own watcher (``VllmModel._leave_with_triton``) stops
vLLM's engine and exits. Now and then it cannot: a call into the stub's IPC blocks for good on the dead
server and no Python thread of the stub runs again, a timer's ``os._exit`` included (6 in 38 kills on 2 CPU
cores, 2026-12-07; py-spy 15 s after the kill: the 10 s timer still waiting, the cancellation poller blocked
inside ``is_cancelled``). And a stub that dies (killed, crashed) leaves vLLM's engine and workers running:
a stub killed by hand left them at 60 % of a core each for 40 minutes. So this watchdog kills, after a grace,
the stub and everything it started that is still there. It needs no Python of the stub's to run: a separate
interpreter, stdlib only, run by path with ``-I``, waiting on pidfds (no polling, no pid reused by mistake).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path


def start_watchdog(triton_pid: int, grace_s: float) -> subprocess.Popen:
    """Watch this process (a stub), the processes it has started so far (vLLM's engine and its workers) and
    Triton, its parent: ``grace_s`` after Triton's death or the stub's, whatever of them is left is killed."""
    started = [str(pid) for pid in descendants(os.getpid())]  # named here: one that the stub's death re-parents is still found
    return subprocess.Popen(
        [sys.executable, "-I", str(Path(__file__).resolve()), str(triton_pid), str(os.getpid()), str(grace_s), *started],
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


def pidfds(pids: list[int]) -> dict[int, int]:
    """A pidfd for each of ``pids`` still there: it names that very process even once its pid is reused."""
    fds = {}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            fds[pid] = os.pidfd_open(pid)
    return fds


def below(stub_pid: int) -> dict[int, int]:
    return pidfds([pid for pid in descendants(stub_pid) if pid != os.getpid()])


def still_running_after(fds: dict[int, int], wait_s: float) -> dict[int, int]:
    """Those of ``fds`` whose process has not ended within ``wait_s`` (a pidfd polls readable when it ends)."""
    deadline = time.monotonic() + wait_s
    running = dict(fds)
    while running:
        poller = select.poll()
        for fd in running.values():
            poller.register(fd, select.POLLIN)
        ended = {fd for fd, _ in poller.poll(max(0, int((deadline - time.monotonic()) * 1000)))}
        if not ended:
            break
        running = {pid: fd for pid, fd in running.items() if fd not in ended}
    return running


def watch(triton_pid: int, stub_pid: int, grace_s: float, started: list[int]) -> None:
    """Wait until the stub or Triton ends. An unload stops the engine before the stub exits: nothing is left.
    A stub that died (killed, crashed) leaves its engine running; a stub whose Triton died stops its engine
    and exits, or hangs. Whatever of them is left ``grace_s`` later is killed.
    Triton may already be gone when this starts (the stub is then no longer its child): the grace starts."""
    stub = pidfds([stub_pid])
    if not stub:
        return
    engine = pidfds(started)  # vLLM's engine, its workers, multiprocessing's helpers: started before this
    poller = select.poll()
    poller.register(stub[stub_pid], select.POLLIN)
    with contextlib.suppress(OSError):
        triton = pidfds([triton_pid])
        if triton and parent_of(stub_pid) == triton_pid:
            poller.register(triton[triton_pid], select.POLLIN)
            poller.poll()  # until one of the two ends
    left = still_running_after(stub, grace_s)
    if left:  # Triton is gone and the stub hangs: the engine, and what the stub started since this began
        left |= engine | below(stub_pid)
    else:
        left = still_running_after(engine, grace_s)
    if left:
        print(f"[vllm] watchdog: {len(left)} process(es) of the stub {stub_pid} outlived it or Triton by "
              f"{grace_s:.0f} s: killing them", file=sys.stderr, flush=True)
        for fd in left.values():
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), [int(pid) for pid in sys.argv[4:]])
