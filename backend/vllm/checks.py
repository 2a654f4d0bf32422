"""Rules about a model's configuration that need neither Triton nor vLLM: shared by the backend (which
refuses to load) and utils.repository (which refuses to write), so both say the same thing.
"""

from __future__ import annotations

from typing import Callable


def gpus_per_engine(engine_settings: dict) -> int:
    """How many GPUs one vLLM engine uses: tensor_parallel_size x pipeline_parallel_size."""
    return int(engine_settings.get("tensor_parallel_size", 1)) * int(engine_settings.get("pipeline_parallel_size", 1))


def instance_kind_problem(instance_kind: str, engine_settings: dict) -> str | None:
    """Why an instance group cannot host this engine, or None.

    Triton gives a KIND_GPU instance exactly one GPU (CUDA_VISIBLE_DEVICES-like placement), while an
    engine with tensor or pipeline parallelism needs several: vLLM must place its workers itself
    (KIND_MODEL).
    """
    gpus = gpus_per_engine(engine_settings)
    if instance_kind.upper().removeprefix("KIND_") == "GPU" and gpus > 1:
        return (
            f"instance_group KIND_GPU gives each instance one GPU, but model.json asks for {gpus} "
            "(tensor_parallel_size x pipeline_parallel_size): use KIND_MODEL so vLLM places its workers itself"
        )
    return None


def instance_gpu(instance_kind: str, device_id: str | int | None, visible: str | None) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` that keeps a KIND_GPU instance's engine on the GPU Triton gave it; None for the
    other kinds, whose engine vLLM places itself.

    Triton numbers the GPUs it sees, so when Triton itself was started with ``CUDA_VISIBLE_DEVICES`` (``visible``),
    its device 1 is that list's second entry. vLLM's engine core is a process spawned by the stub: only the
    environment reaches it (``torch.cuda.set_device`` in the stub, what the published backend does, would not).
    """
    if instance_kind.upper().removeprefix("KIND_") != "GPU" or device_id in (None, ""):
        return None
    index = int(device_id)
    if not visible:
        return str(index)
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if not 0 <= index < len(entries):
        raise ValueError(f"KIND_GPU instance on device {index}, but Triton sees only CUDA_VISIBLE_DEVICES={visible}")
    return entries[index]


QUIET_US = 1500  # the default quiet period: about one engine step of a small model under load on an H100/H200


def _microseconds(parameter: Callable[[str, str], str], key: str, default: str) -> int:
    text = parameter(key, default).strip()
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"config parameter '{key}' must be a whole number of microseconds >= 0, got '{text}'")
    return int(text)


def queue_window(parameter: Callable[[str, str], str]) -> tuple[float, float]:
    """(quiet_s, longest_s) of the backend's queue window (``admission``) from config.pbtxt's
    ``max_queue_delay_microseconds`` (default 0: none) and ``queue_quiet_microseconds`` (default 1500, at most the
    delay); ``parameter(key, default)`` reads one. A bad value raises ValueError naming the parameter."""
    longest = _microseconds(parameter, "max_queue_delay_microseconds", "0")
    quiet = _microseconds(parameter, "queue_quiet_microseconds", str(min(QUIET_US, longest)))
    if quiet > longest:
        raise ValueError(
            f"config parameter 'queue_quiet_microseconds' ({quiet}) exceeds 'max_queue_delay_microseconds' ({longest})"
        )
    return quiet / 1e6, longest / 1e6
