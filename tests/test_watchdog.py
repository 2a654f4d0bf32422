"""backend/vllm/watchdog.py on stand-in processes: a "Triton" that starts a "stub", which starts an "engine"
and then the real watchdog (the backend starts vLLM's engine before it), and after a while either stops its
engine and exits (an unload, or the stub's own exit once Triton is gone) or not. tests/test_lifecycle.py runs
the watchdog in Triton's stub with vLLM's engine."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from utils.paths import backend_source

GRACE_S = 1.0

STUB = textwrap.dedent(f"""
    import importlib.util, os, subprocess, sys, time
    spec = importlib.util.spec_from_file_location("watchdog", {str(backend_source() / "watchdog.py")!r})
    watchdog = importlib.util.module_from_spec(spec); spec.loader.exec_module(watchdog)
    engine = subprocess.Popen(["sleep", "600"])
    watchdog.start_watchdog(os.getppid(), {GRACE_S})
    print(engine.pid, flush=True)
    time.sleep(float(sys.argv[1]))  # how long this stub runs (600: it hangs)
    engine.kill()
    engine.wait()
""")

TRITON = textwrap.dedent("""
    import subprocess, sys, time
    stub = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=sys.stdout)
    time.sleep(600)
""")


class StandIns:
    """The stand-in Triton, its stub, the stub's engine and the watchdog, once all four run."""

    def __init__(self, stub_runs_s: float):
        self.triton = subprocess.Popen([sys.executable, "-c", TRITON, STUB, str(stub_runs_s)], stdout=subprocess.PIPE, text=True)
        self.engine = psutil.Process(int(self.triton.stdout.readline()))
        self.stub = psutil.Process(self.engine.ppid())
        self.watchdog = self._child_running("watchdog.py")

    def _child_running(self, script: str, timeout: float = 10) -> psutil.Process:
        """The stub's child once it runs ``script`` (until it has exec'd, a child still shows the stub's command)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for child in self.stub.children():
                if script in " ".join(child.cmdline()):
                    return child
            time.sleep(0.01)
        raise AssertionError(f"the stub never ran {script}")

    def kill_all(self) -> None:
        for process in (psutil.Process(self.triton.pid), self.stub, self.engine, self.watchdog):
            if not gone(process):
                process.kill()


@pytest.fixture
def stand_ins(request) -> StandIns:
    processes = StandIns(stub_runs_s=request.param)
    yield processes
    processes.kill_all()


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def seconds_until_gone(processes: list[psutil.Process], timeout: float = 10) -> float:
    started = time.monotonic()
    while not all(gone(p) for p in processes) and time.monotonic() - started < timeout:
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.mark.parametrize("stand_ins", [600], indirect=True)
def test_a_stub_that_hangs_once_triton_is_gone_is_killed_with_its_engine_after_the_grace(stand_ins):
    stand_ins.triton.kill()
    time.sleep(GRACE_S / 2)
    assert not gone(stand_ins.stub) and not gone(stand_ins.engine)  # the stub's own chance to stop its engine
    took = seconds_until_gone([stand_ins.stub, stand_ins.engine, stand_ins.watchdog])
    assert GRACE_S / 2 < took < GRACE_S / 2 + 1, took


@pytest.mark.parametrize("stand_ins", [600], indirect=True)
def test_a_stub_that_dies_leaves_no_engine_and_triton_untouched(stand_ins):
    """A stub killed (or crashed) while Triton runs: its engine would run on, re-parented, for good."""
    stand_ins.stub.kill()
    time.sleep(GRACE_S / 2)
    assert not gone(stand_ins.engine)
    assert seconds_until_gone([stand_ins.engine, stand_ins.watchdog]) < GRACE_S / 2 + 1
    assert stand_ins.triton.poll() is None


@pytest.mark.parametrize("stand_ins", [0.5], indirect=True)
def test_a_stub_that_stops_its_engine_and_exits_takes_the_watchdog_with_it_at_once(stand_ins):
    """An unload: nothing is left to kill, so the watchdog does not wait out the grace."""
    assert seconds_until_gone([stand_ins.stub, stand_ins.engine], timeout=5) < 2
    assert seconds_until_gone([stand_ins.watchdog]) < 0.5
    assert stand_ins.triton.poll() is None


@pytest.mark.parametrize("stand_ins", [0.3], indirect=True)
def test_a_stub_that_stops_its_engine_once_triton_is_gone_is_left_to_do_so(stand_ins):
    stand_ins.triton.kill()
    assert seconds_until_gone([stand_ins.stub, stand_ins.engine], timeout=5) < 2
    assert seconds_until_gone([stand_ins.watchdog]) < 0.5
