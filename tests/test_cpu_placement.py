"""scripts/cpu-placement.py against real busy processes: two pinned to one CPU must show up sharing it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "cpu-placement.py"
SPIN = "import time\nend = time.monotonic() + 6\nwhile time.monotonic() < end: pass"


def spinner(cpu: int) -> subprocess.Popen:
    """A Python process that keeps one thread busy on logical CPU ``cpu`` for a few seconds."""
    return subprocess.Popen([sys.executable, "-c", SPIN], preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))


def test_two_busy_threads_pinned_to_one_cpu_are_reported_sharing_it():
    cpu = min(os.sched_getaffinity(0))
    first, second = spinner(cpu), spinner(cpu)
    try:
        result = subprocess.run(
            [sys.executable, str(SCRIPT), "2", "0.25", f"first={first.pid}", f"second={second.pid}"],
            capture_output=True, text=True, timeout=30, check=True,
        )
    finally:
        first.kill()
        second.kill()
    lines = result.stdout.splitlines()
    busy = [line for line in lines if line.startswith(("  first", "  second")) and "tid" in line]
    assert len(busy) == 2, result.stdout
    assert all(f"[{cpu}: 100%]" in line for line in busy), result.stdout  # each ran on the one CPU it was given
    shares = [float(line.split(": ")[1].split()[0]) for line in busy]
    assert all(0.25 <= share <= 0.7 for share in shares), result.stdout  # taking turns: about half a core each
    for line in busy:  # taking turns means being preempted, never moved (the kernel's counters, where published)
        counters = line.rsplit("switches per CPU second: ", 1)[1]
        if counters != "not published":
            migrations, involuntary, _ = (float(value) for value in counters.split())
            assert migrations == 0 and involuntary > 10, result.stdout
    pair = next(line for line in lines if " + " in line and "first" in line and "second" in line)
    siblings, same = pair.rsplit(": ", 1)[1].split(" / ")
    # every interval where both were busy they were on the one CPU (a third process on it can leave one below busy)
    assert siblings == "0%" and int(same.rstrip("%")) >= 75, result.stdout
