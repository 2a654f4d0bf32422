"""scripts/profile-summary.py --compare on made-up py-spy raw profiles: the time per engine step under each
function, per profile, the functions that differ most first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "profile-summary.py"


def raw_profile(path: Path, adding: int, sampling: int) -> Path:
    """A busy loop whose steps split between adding requests and sampling, plus an output thread to be left out."""
    path.write_text(
        f"thread (7): MainThread;loop (core.py:10);step (core.py:20);add_requests (runner.py:5) {adding}\n"
        f"thread (7): MainThread;loop (core.py:10);step (core.py:21);sample (runner.py:9) {sampling}\n"
        "thread (8): Output;send (zmq.py:3) 500\n"
    )
    return path


def compare(*specs: str) -> list[str]:
    result = subprocess.run([sys.executable, str(SCRIPT), "--compare", "MainThread", *specs],
                            capture_output=True, text=True, timeout=30, check=True)
    return result.stdout.splitlines()


def row(lines: list[str], function: str) -> list[float]:
    line = next(line for line in lines if line.endswith(function))
    return [float(value) for value in line.split()[:-2]]


def test_time_per_step_under_each_function_side_by_side(tmp_path):
    slow = raw_profile(tmp_path / "triton.txt", adding=30, sampling=70)
    fast = raw_profile(tmp_path / "direct.txt", adding=10, sampling=90)
    lines = compare(f"triton={slow}=2.0", f"direct={fast}=1.0")
    assert "triton 2.00 ms per step, direct 1.00 ms per step" in lines[0]
    assert row(lines, "add_requests (runner.py)") == [0.6, 0.1]  # 30 % of 2 ms against 10 % of 1 ms
    assert row(lines, "sample (runner.py)") == [1.4, 0.9]
    # one function on two lines counts once, and the output thread's samples are not the busy loop's
    assert row(lines, "step (core.py)") == [2.0, 1.0]
    functions = [line.rsplit("  ", 1)[-1] for line in lines[2:]]
    assert not any("send" in function for function in functions)
    # the largest spread first: the loop and its step (1 ms), then adding and sampling (0.5 ms each)
    assert set(functions[:2]) == {"loop (core.py)", "step (core.py)"}
    assert set(functions[2:]) == {"add_requests (runner.py)", "sample (runner.py)"}
