"""The rules by which the instances of a model find their one engine (backend/vllm/sharing.py), without Triton or
vLLM: how many instances share a device, the board's seats, the engine's state, a starter that is gone; and the
GPU a KIND_GPU instance's engine is kept on (backend/vllm/checks.py). tests/test_instances.py runs the sharing for
real: two instances in one Triton on one engine."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from backend.vllm.checks import instance_gpu
from backend.vllm.sharing import (
    FAILED,
    READY,
    EngineBoard,
    board_folder,
    engine_alive,
    fingerprint,
    instances_on_device,
    process_alive,
)


def pairs(count: int) -> list[tuple[str, str]]:
    return [(f"ipc:///tmp/in-{i}", f"ipc:///tmp/out-{i}") for i in range(count)]


@pytest.mark.parametrize(
    ("groups", "kind", "device", "expected"),
    [
        ([{"kind": "KIND_MODEL", "count": 2}], "MODEL", 0, 2),
        ([{"kind": "KIND_MODEL", "count": 1}], "KIND_MODEL", 0, 1),
        ([{"kind": "KIND_CPU", "count": 3}], "CPU", 0, 3),
        ([{"kind": "KIND_GPU", "count": 2, "gpus": [0, 1]}], "GPU", 1, 2),  # two on each listed GPU
        ([{"kind": "KIND_GPU", "count": 1, "gpus": [0]}, {"kind": "KIND_GPU", "count": 1, "gpus": [0, 1]}], "GPU", 0, 2),
        ([{"kind": "KIND_GPU", "count": 1, "gpus": [0]}, {"kind": "KIND_GPU", "count": 1, "gpus": [0, 1]}], "GPU", 1, 1),
        ([{"kind": "KIND_MODEL", "count": 2}, {"kind": "KIND_CPU", "count": 4}], "MODEL", 0, 2),  # only its own kind
        ([], "MODEL", 0, 1),
    ],
)
def test_instances_on_a_device(groups, kind, device, expected):
    assert instances_on_device(groups, kind, device) == expected


def test_the_board_is_per_triton_model_version_and_device(tmp_path):
    folders = {board_folder(1, "m", "1", "MODEL0", tmp_path), board_folder(2, "m", "1", "MODEL0", tmp_path),
               board_folder(1, "m", "2", "MODEL0", tmp_path), board_folder(1, "m", "1", "GPU1", tmp_path)}
    assert len(folders) == 4
    assert "/" not in board_folder(1, "a/../b", "1", "MODEL0", tmp_path).name


def test_the_first_instance_starts_the_engine_and_the_others_take_its_seats(tmp_path):
    board = EngineBoard(tmp_path)
    asked = []
    starter = board.take_seat(3, "print", lambda n: asked.append(n) or pairs(n))
    second = board.take_seat(3, "print", lambda n: pytest.fail("a second engine was asked for"))
    third = board.take_seat(3, "print", pairs)
    assert asked == [3]
    assert [s.index for s in (starter, second, third)] == [0, 1, 2] and starter.starts_engine and not second.starts_engine
    assert starter.engine_id == second.engine_id == third.engine_id and second.count == 3
    assert second.client_addresses() == {"input_address": "ipc:///tmp/in-1", "output_address": "ipc:///tmp/out-1"}
    fourth = board.take_seat(3, "print", pairs)  # every seat taken: a reload's instance while the old ones serve
    assert fourth.starts_engine and fourth.engine_id != starter.engine_id


def test_other_settings_or_a_starter_that_is_gone_get_an_engine_of_their_own(tmp_path):
    board = EngineBoard(tmp_path)
    starter = board.take_seat(2, "print", pairs)
    assert board.take_seat(2, "other model.json", pairs).starts_engine
    board = EngineBoard(tmp_path / "two")
    starter = board.take_seat(2, "print", pairs)
    starter._lock.close()  # the starter's process died: its seat's lock is free
    late = board.take_seat(2, "print", pairs)
    assert late.starts_engine and late.engine_id != starter.engine_id


def test_an_instance_waits_for_the_engine_and_learns_its_processes(tmp_path):
    board = EngineBoard(tmp_path)
    starter = board.take_seat(2, "print", pairs)
    member = board.take_seat(2, "print", pairs)
    with pytest.raises(RuntimeError, match="did not start within"):
        board.wait_until_up(member, log=lambda _: None, timeout_s=0.3)
    board.announce(starter, READY, [101, 102])
    said = []
    assert board.wait_until_up(member, log=said.append) == [101, 102] and said == []


def test_a_failed_or_vanished_starter_fails_the_waiting_instances_at_once(tmp_path):
    board = EngineBoard(tmp_path)
    starter = board.take_seat(2, "print", pairs)
    member = board.take_seat(2, "print", pairs)
    board.announce(starter, FAILED, error="CUDA out of memory")
    board.leave(starter)  # the starter gives up at once: the reason stays on the board for those waiting
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        board.wait_until_up(member, log=lambda _: None)
    board = EngineBoard(tmp_path / "two")
    starter = board.take_seat(2, "print", pairs)
    member = board.take_seat(2, "print", pairs)
    starter._lock.close()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="starting the shared engine is gone"):
        board.wait_until_up(member, log=lambda _: None)
    assert time.monotonic() - started < 1


def test_a_starter_that_leaves_takes_its_engine_and_only_its_engine_off_the_board(tmp_path):
    board = EngineBoard(tmp_path)
    old = board.take_seat(2, "print", pairs)
    old_member = board.take_seat(2, "print", pairs)
    new = board.take_seat(2, "print", pairs)  # the old engine's seats are all taken: a new engine
    new_member = board.take_seat(2, "print", pairs)
    assert board.lists(old_member) and board.lists(new_member)
    board.leave(old)
    assert not board.lists(old_member)  # the old engine's instances now know its stop was on purpose
    assert board.lists(new_member)
    for seat in (new, old_member, new_member):
        board.leave(seat)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["board.lock"]


def test_a_dead_process_and_a_zombie_are_not_alive():
    assert process_alive(os.getpid()) and engine_alive([]) and engine_alive([os.getpid()])
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 5
    while process_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # exited, not yet reaped: a zombie
    assert Path(f"/proc/{child.pid}").exists() and not process_alive(child.pid)
    child.wait()
    assert not process_alive(child.pid) and not engine_alive([os.getpid(), child.pid])


def test_the_fingerprint_tells_settings_apart():
    assert fingerprint('{"model": "a"}', "2") == fingerprint('{"model": "a"}', "2")
    assert fingerprint('{"model": "a"}', "2") != fingerprint('{"model": "a"}', "3") != fingerprint('{"model": "b"}', "3")


def test_a_kind_gpu_instance_keeps_its_engine_on_its_gpu():
    assert instance_gpu("GPU", "1", None) == "1"
    assert instance_gpu("KIND_GPU", 1, "4,5,6") == "5"  # Triton's device 1 is the second GPU it was given
    assert instance_gpu("GPU", "0", "GPU-3f2a, GPU-77c1") == "GPU-3f2a"
    assert instance_gpu("MODEL", "0", None) is None and instance_gpu("CPU", "0", "0") is None
    with pytest.raises(ValueError, match="sees only CUDA_VISIBLE_DEVICES=2"):
        instance_gpu("GPU", "1", "2")
