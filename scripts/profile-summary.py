"""Summarize py-spy raw profiles (``py-spy record --threads --format raw``, idle samples left out) of one
process each: per thread, how busy it was and where its time went (own time and time under each frame).

    python scripts/profile-summary.py RATE_HZ DURATION_S FILE...

Busy share = a thread's samples / (rate x duration): near 1.0 means the thread had no idle moment, the sign of
a loop that limits everything behind it."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

TOP = 14


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


def main(argv: list[str]) -> None:
    rate, duration, files = float(argv[0]), float(argv[1]), argv[2:]
    for name in files:
        summarize(Path(name), rate * duration)


if __name__ == "__main__":
    main(sys.argv[1:])
