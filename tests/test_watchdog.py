"""backend/vllm/watchdog.py on stand-in processes: a "Triton" that starts a "stub", which starts the real
watchdog and a child of its own (as the stub starts vLLM's engine), then either hangs (a stub whose Python no
longer runs) or exits. tests/test_lifecycle.py runs the watchdog in Triton's stub with vLLM's engine."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil

from utils.paths import backend_source

GRACE_S = 1.0

STUB = textwrap.dedent(f"""
    import importlib.util, os, subprocess, sys, time
    spec = importlib.util.spec_from_file_location("watchdog", {str(backend_source() / "watchdog.py")!r})
    watchdog = importlib.util.module_from_spec(spec); spec.loader.exec_module(watchdog)
    watchdog.start_watchdog(os.getppid(), {GRACE_S})
    engine = subprocess.Popen(["sleep", "600"])
    print(engine.pid, flush=True)
    time.sleep(float(sys.argv[1]))  # how long this stub lives: a hung one, or one that exits on its own
""")

TRITON = textwrap.dedent("""
    import subprocess, sys, time
    stub = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=sys.stdout)
    time.sleep(600)
""")


def start_triton(stub_lifetime_s: float) -> tuple[subprocess.Popen, psutil.Process, psutil.Process, psutil.Process]:
    """The stand-in Triton, its stub, the stub's "engine" and the watchdog, once all four run."""
    triton = subprocess.Popen([sys.executable, "-c", TRITON, STUB, str(stub_lifetime_s)], stdout=subprocess.PIPE, text=True)
    engine = psutil.Process(int(triton.stdout.readline()))
    stub = psutil.Process(engine.ppid())
    watchdog = next(p for p in stub.children() if "watchdog.py" in " ".join(p.cmdline()))
    return triton, stub, engine, watchdog


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until_gone(processes: list[psutil.Process], timeout: float) -> float:
    started = time.monotonic()
    while not all(gone(p) for p in processes) and time.monotonic() - started < timeout:
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_stub_that_outlives_triton_is_killed_with_all_below_it_after_the_grace():
    triton, stub, engine, watchdog = start_triton(stub_lifetime_s=600)
    try:
        triton.kill()
        triton.wait()
        time.sleep(GRACE_S / 2)
        assert not gone(stub) and not gone(engine)  # the stub's own chance to stop its engine and exit
        took = wait_until_gone([stub, engine, watchdog], timeout=10)
        assert all(gone(p) for p in (stub, engine, watchdog)) and took < GRACE_S + 1, took
    finally:
        for process in (stub, engine, watchdog):
            if not gone(process):
                process.kill()


def test_a_stub_that_exits_in_the_grace_is_left_to_do_so():
    """The stub's own watcher stopped its engine: nothing is killed, and the watchdog leaves with the stub."""
    triton, stub, engine, watchdog = start_triton(stub_lifetime_s=0.5)
    try:
        triton.kill()
        triton.wait()
        assert wait_until_gone([stub, watchdog], timeout=5) < 2
        time.sleep(GRACE_S)
        assert not gone(engine)
    finally:
        engine.kill()


def test_the_watchdog_leaves_at_once_with_a_stub_that_ends_while_triton_runs():
    """An unload, or a stub's normal exit: no watchdog stays behind, and Triton and the rest are untouched."""
    triton, stub, engine, watchdog = start_triton(stub_lifetime_s=0.5)
    try:
        assert wait_until_gone([stub], timeout=5) < 2
        assert wait_until_gone([watchdog], timeout=5) < 0.5
        assert triton.poll() is None and not gone(engine)
    finally:
        triton.kill()
        engine.kill()
