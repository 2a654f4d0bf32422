"""Where the busy threads of a few processes ran, and how often two of them shared a physical core.

    python scripts/cpu-placement.py SECONDS INTERVAL_S LABEL=PID [LABEL=PID ...]

Why: a small model's engine step is CPU-bound Python in vLLM's engine core, so anything that slows that one thread
slows every request. Two busy threads on the two logical CPUs of one physical core (SMT siblings) each run
markedly slower than alone. This samples every thread of the named processes (the engine core, the frontend that
feeds it, Triton) from /proc each interval: its CPU time since the last sample and the logical CPU it last ran on,
then prints, per busy thread, its share of a core and the CPUs it used, and, per pair of busy threads, the share of
the intervals both were busy on one physical core (siblings) or on one logical CPU (taking turns); and per busy
thread, from the kernel's own counters over the whole window and per second of the thread's CPU time, how often it
moved to another CPU (migrations), was taken off its CPU while it could still run (involuntary switches: preempted)
and gave its CPU up (voluntary switches: it waited on a lock, the GIL, the GPU, I/O).
"""

from __future__ import annotations

import collections
import itertools
import os
import sys
import time
from pathlib import Path

BUSY = 0.3  # a thread that used at least this share of a core in an interval counts as busy in it
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
COUNTERS = ("se.nr_migrations", "nr_involuntary_switches", "nr_voluntary_switches")  # in /proc/PID/task/TID/sched


def physical_core(cpu: int) -> tuple[int, int]:
    """(package, core) of a logical CPU: two CPUs with the same pair are SMT siblings."""
    topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return int((topology / "physical_package_id").read_text()), int((topology / "core_id").read_text())
    except (OSError, ValueError):
        return 0, cpu  # no topology: every CPU a core of its own


def scheduler_counters(task: Path) -> tuple[int, ...] | None:
    """The thread's migrations, involuntary and voluntary context switches so far (/proc/.../sched); None where
    the kernel does not publish them."""
    try:
        lines = (task / "sched").read_text().splitlines()
    except OSError:
        return None
    values = dict(line.replace(" ", "").split(":", 1) for line in lines if ":" in line)
    try:
        return tuple(int(float(values[name])) for name in COUNTERS)
    except (KeyError, ValueError):
        return None


def thread_samples(pid: int) -> dict[int, tuple[str, float, int, tuple[int, ...] | None]]:
    """Each thread of ``pid``: (name, CPU seconds so far, logical CPU it last ran on, ``scheduler_counters``)."""
    samples = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended between listing and reading
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()  # fields[0] is field 3 of proc(5), the state
        cpu_s = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
        samples[int(task.name)] = (name, cpu_s, int(fields[36]), scheduler_counters(task))
    return samples


def counter_rates(first: dict, last: dict) -> dict[tuple[str, int, str], tuple[float, ...]]:
    """Per thread seen at both ends of the window: its ``COUNTERS`` per second of its CPU time, so that threads busy
    for part of a window (an engine whose target runs a third of it) compare with threads busy all along."""
    rates = {}
    for label, threads in last.items():
        for tid, (name, cpu_s, _, counters) in threads.items():
            before = first[label].get(tid)
            used = cpu_s - before[1] if before is not None else 0.0
            if counters is not None and before is not None and before[3] is not None and used > 0:
                rates[(label, tid, name)] = tuple((b - a) / used for a, b in zip(before[3], counters))
    return rates


def sample(processes: dict[str, int], seconds: float, interval: float) -> tuple[list[dict], dict]:
    """Per interval: {(label, tid, name): (share of a core, logical CPU)} for every thread that ran in it; and
    ``counter_rates`` over the whole window."""
    first = previous = {label: thread_samples(pid) for label, pid in processes.items()}
    intervals = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.monotonic()
        time.sleep(interval)
        elapsed = time.monotonic() - started
        current = {label: thread_samples(pid) for label, pid in processes.items()}
        step = {}
        for label, threads in current.items():
            for tid, (name, cpu_s, cpu, _) in threads.items():
                before = previous[label].get(tid)
                used = cpu_s - before[1] if before else 0.0
                if used > 0:
                    step[(label, tid, name)] = (used / elapsed, cpu)
        intervals.append(step)
        previous = current
    return intervals, counter_rates(first, previous)


def report(intervals: list[dict], rates: dict) -> str:
    """Busy threads with their CPUs and scheduler counters, then how often each pair of them shared a physical core
    or a logical CPU."""
    if not intervals:
        return "no samples"
    share = collections.Counter()
    cpus: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
    for step in intervals:
        for thread, (used, cpu) in step.items():
            share[thread] += used / len(intervals)
            cpus[thread][cpu] += 1
    busy = [thread for thread, used in share.most_common() if used >= BUSY / 2]
    lines = [f"{len(intervals)} intervals; busy threads (share of a core, logical CPUs it ran on: share of its intervals):"]
    for thread in busy:
        seen = sum(cpus[thread].values())
        where = ", ".join(f"{cpu}: {n / seen:.0%}" for cpu, n in cpus[thread].most_common(4))
        counted = rates.get(thread)
        per_s = " ".join(f"{rate:.0f}" for rate in counted) if counted else "not published"
        lines.append(f"  {thread[0]} {thread[2]} (tid {thread[1]}): {share[thread]:.2f}  [{where}]  migrations, involuntary, voluntary switches per CPU second: {per_s}")
    lines.append(f"pairs of busy threads (both >= {BUSY} of a core in an interval): share of all intervals on SMT siblings / on one CPU")
    for a, b in itertools.combinations(busy, 2):
        siblings = same = 0
        for step in intervals:
            if a in step and b in step and step[a][0] >= BUSY and step[b][0] >= BUSY:
                cpu_a, cpu_b = step[a][1], step[b][1]
                same += cpu_a == cpu_b
                siblings += cpu_a != cpu_b and physical_core(cpu_a) == physical_core(cpu_b)
        lines.append(f"  {a[0]} {a[2]} + {b[0]} {b[2]}: {siblings / len(intervals):.0%} / {same / len(intervals):.0%}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    seconds, interval = float(argv[0]), float(argv[1])
    processes = {}
    for arg in argv[2:]:
        label, _, pid = arg.partition("=")
        if not pid.isdigit():
            sys.exit(f"expected LABEL=PID, got {arg!r}")
        processes[label] = int(pid)
    print("processes:", " ".join(f"{label}={pid}" for label, pid in processes.items()))
    print(report(*sample(processes, seconds, interval)))


if __name__ == "__main__":
    main(sys.argv[1:])
