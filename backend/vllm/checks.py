"""Rules about a model's configuration that need neither Triton nor vLLM: shared by the backend (which
refuses to load) and utils.repository (which refuses to write), so both say the same thing.
"""

from __future__ import annotations


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
