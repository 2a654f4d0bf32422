"""Summarize py-spy raw profiles (``py-spy record --threads --format raw``, idle samples left out) of one
process each: per thread, how busy it was and where its time went (own time and time under each frame).

    python scripts/profile-summary.py RATE_HZ DURATION_S FILE...
    python scripts/profile-summary.py --compare THREAD LABEL=FILE=STEP_MS...

Busy share = a thread's samples / (rate x duration): near 1.0 means the thread had no idle moment, the sign of
a loop that limits everything behind it.

``--compare`` sets one thread (say the engine core's MainThread) of several profiles side by side, each frame's
time in milliseconds per engine step (its share of the thread's samples x that target's step time), the frames
that differ most first: where an engine step behind one front-end takes longer than behind another. The share
is the frame's and everything under it (line numbers dropped, so a function counts once)."""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

TOP = 14
COMPARED = 25
LINE_NUMBER = re.compile(r":\d+\)$")


def read_samples(path: Path) -> dict[str, list[tuple[list[str], int]]]:
    """Stacks per thread: ``thread (TID): NAME;frame;frame... COUNT`` lines."""
    threads: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [f for f in stack.split(";") if not f.startswith("process ")]
        if not frames or not frames[0].startswith("thread "):
            continue
        threads[frames[0].split(": ", 1)[-1] + " " + frames[0].split(":")[0][7:]].append((frames[1:], int(count)))
    return threads


def summarize(path: Path, expected: float) -> None:
    print(f"=== {path.name}")
    if not path.exists():
        return print("  (no profile: py-spy did not run)")
    threads = read_samples(path)
    for thread, stacks in sorted(threads.items(), key=lambda item: -sum(n for _, n in item[1])):
        total = sum(n for _, n in stacks)
        if total < 0.02 * expected:
            continue
        own: collections.Counter = collections.Counter()
        under: collections.Counter = collections.Counter()
        for frames, n in stacks:
            if frames:
                own[frames[-1]] += n
            for frame in set(frames):
                under[frame] += n
        print(f"--- thread {thread}: busy {total / expected:.2f}")
        print("  own time:")
        for frame, n in own.most_common(TOP):
            print(f"   {n / total:6.1%}  {frame[:140]}")
        print("  under:")
        for frame, n in under.most_common(TOP + 16):
            print(f"   {n / total:6.1%}  {frame[:140]}")


def ms_per_step(path: Path, thread_name: str, step_ms: float) -> dict[str, float]:
    """Each function's inclusive share of one thread's samples, in milliseconds of a ``step_ms`` step."""
    threads = read_samples(path)
    stacks = [stack for thread in threads if thread.split(" (")[0] == thread_name for stack in threads[thread]]
    total = sum(n for _, n in stacks)
    if not total:
        return {}
    under: collections.Counter = collections.Counter()
    for frames, n in stacks:
        for function in {LINE_NUMBER.sub(")", frame) for frame in frames}:
            under[function] += n
    return {function: n / total * step_ms for function, n in under.items()}


def compare(thread_name: str, profiles: dict[str, tuple[Path, float]]) -> None:
    """The functions whose time per step differs most between the profiles, largest spread first."""
    times = {label: ms_per_step(path, thread_name, step_ms) for label, (path, step_ms) in profiles.items()}
    functions = set().union(*times.values())
    spread = {f: max(t.get(f, 0.0) for t in times.values()) - min(t.get(f, 0.0) for t in times.values()) for f in functions}
    labels = list(times)
    print(f"=== {thread_name}: ms per engine step under each function (" +
          ", ".join(f"{label} {step_ms:.2f} ms per step" for label, (_, step_ms) in profiles.items()) + ")")
    print("  " + "".join(f"{label[:12]:>13s}" for label in labels) + "  function")
    for function in sorted(functions, key=lambda f: -spread[f])[:COMPARED]:
        print("  " + "".join(f"{times[label].get(function, 0.0):13.3f}" for label in labels) + f"  {function[:120]}")


def main(argv: list[str]) -> None:
    if argv[0] == "--compare":
        profiles = {}
        for spec in argv[2:]:
            label, path, step_ms = spec.rsplit("=", 2)
            profiles[label] = (Path(path), float(step_ms))
        return compare(argv[1], profiles)
    rate, duration, files = float(argv[0]), float(argv[1]), argv[2:]
    for name in files:
        summarize(Path(name), rate * duration)


if __name__ == "__main__":
    main(sys.argv[1:])
