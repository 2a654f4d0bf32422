"""Model repositories: config.pbtxt through protobuf, model.json against vLLM's AsyncEngineArgs."""

import json
import subprocess
import sys

import pytest

from utils import repository as repo
from utils.model import default_model_dir


def test_sample_repository_is_valid_and_is_the_seed():
    report = repo.validate_repository(repo.paths.sample_repository())
    config = report["vllm_model"]["config"]
    assert config["backend"] == "vllm"
    assert config["instance_group"][0]["kind"] == "KIND_MODEL"
    assert report["vllm_model"]["versions"]["1"]["model"] == "facebook/opt-125m"


def test_config_round_trips_through_text_format(tmp_path):
    config = repo.make_config("m", instance_count=2, decoupled=True, parameters={"REPORT_CUSTOM_METRICS": "yes"})
    path = tmp_path / "config.pbtxt"
    path.write_text(repo.config_to_text(config))
    assert repo.read_config(path) == config
    assert 'backend: "vllm"' in path.read_text()


def test_a_typo_in_config_pbtxt_is_an_error_naming_the_field(tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text('backend: "vllm"\ninstance_grup [{ kind: KIND_MODEL }]\n')
    with pytest.raises(repo.RepositoryError, match="instance_grup"):
        repo.read_config(path)


def test_unknown_engine_arg_is_an_error_naming_the_key(tmp_path):
    with pytest.raises(repo.RepositoryError, match="disable_log_requests"):
        repo.write_model(tmp_path, repo.make_config("m"), {"model": "x", "disable_log_requests": True})


def test_the_keys_read_from_vllms_source_are_its_engine_args_fields():
    assert repo.engine_arg_names() == set(repo.engine_arg_fields())


def test_checking_a_repository_imports_no_vllm(tmp_path):
    """Writing and checking model.json stays instant: vLLM's import is left to the server that runs it."""
    script = (
        "import sys; from utils import repository as repo; "
        f"repo.write_model({str(tmp_path)!r}, repo.make_config('m'), {{'model': 'x', 'dtype': 'float32'}}); "
        f"repo.validate_repository({str(tmp_path)!r}); "
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=repo.paths.PROJECT_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_model_is_required():
    with pytest.raises(repo.RepositoryError, match="'model' is required"):
        repo.validate_engine_args({"dtype": "float32"})


def test_broken_model_json_is_reported(tmp_path):
    repo.write_model(tmp_path, repo.make_config("m"), {"model": "x"})
    (tmp_path / "m" / "1" / "model.json").write_text("{not json")
    with pytest.raises(repo.RepositoryError, match="not valid JSON"):
        repo.validate_repository(tmp_path)


def test_folder_and_config_name_must_agree(tmp_path):
    repo.write_model(tmp_path, repo.make_config("m"), {"model": "x"})
    (tmp_path / "m").rename(tmp_path / "other")
    with pytest.raises(repo.RepositoryError, match="names 'm'"):
        repo.validate_repository(tmp_path)


def test_cpu_and_gpu_settings_never_mix():
    cpu, gpu = repo.device_engine_defaults(gpu=False), repo.device_engine_defaults(gpu=True)
    assert cpu["dtype"] == "float32" and cpu["enforce_eager"] is True and "gpu_memory_utilization" not in cpu
    assert gpu["dtype"] == "bfloat16" and "enforce_eager" not in gpu and 0 < gpu["gpu_memory_utilization"] < 1


def test_run_repository_resolves_the_offline_default_and_keeps_explicit_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    messages = []
    run = repo.prepare_run_repository(tmp_path / "run", engine_overrides={"max_num_seqs": 4}, gpu=False, log=messages.append)
    settings = json.loads((run / "vllm_model" / "1" / "model.json").read_text())
    assert settings["model"] == str(default_model_dir())
    assert settings["max_num_seqs"] == 4 and settings["dtype"] == "float32"
    assert any("offline default" in m for m in messages)


def test_run_repository_sets_the_instance_count_and_refuses_zero(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = repo.prepare_run_repository(tmp_path / "run", instance_count=3, gpu=False, log=lambda _: None)
    groups = repo.read_config(run / "vllm_model" / "config.pbtxt").instance_group
    assert [(g.count, repo.mc.ModelInstanceGroup.Kind.Name(g.kind)) for g in groups] == [(3, "KIND_MODEL")]
    with pytest.raises(ValueError, match="instance_count must be at least 1, got 0"):
        repo.prepare_run_repository(tmp_path / "zero", instance_count=0, gpu=False, log=lambda _: None)
    assert not (tmp_path / "zero").exists()


def test_kind_gpu_with_several_gpus_per_engine_is_refused_with_an_explanation(tmp_path):
    repo.write_model(tmp_path, repo.make_config("m", instance_kind="KIND_GPU"), {"model": "x", "tensor_parallel_size": 2})
    with pytest.raises(repo.RepositoryError, match="KIND_GPU gives each instance one GPU.*asks for 2.*KIND_MODEL"):
        repo.validate_repository(tmp_path)


def test_pipeline_parallelism_counts_too(tmp_path):
    settings = {"model": "x", "tensor_parallel_size": 2, "pipeline_parallel_size": 2}
    repo.write_model(tmp_path, repo.make_config("m", instance_kind="KIND_GPU"), settings)
    with pytest.raises(repo.RepositoryError, match="asks for 4"):
        repo.validate_repository(tmp_path)


def test_parallelism_passes_through_to_the_engine_with_kind_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = tmp_path / "source"
    repo.write_model(source, repo.make_config("vllm_model"), {"model": "default", "tensor_parallel_size": 2})
    assert repo.validate_repository(source)["vllm_model"]["versions"]["1"]["tensor_parallel_size"] == 2
    run = repo.prepare_run_repository(tmp_path / "run", source=source, gpu=True, log=lambda _: None)
    settings = json.loads((run / "vllm_model" / "1" / "model.json").read_text())
    assert settings["tensor_parallel_size"] == 2 and settings["dtype"] == "bfloat16"
    from vllm.engine.arg_utils import AsyncEngineArgs

    assert AsyncEngineArgs(**settings).tensor_parallel_size == 2


def test_instance_groups_of_one_gpu_each_are_accepted(tmp_path):
    config = repo.make_config("m", instance_kind="KIND_GPU", instance_count=2, gpus=[0, 1])
    repo.write_model(tmp_path, config, {"model": "x"})
    groups = repo.validate_repository(tmp_path)["m"]["config"]["instance_group"]
    assert groups == [{"count": 2, "kind": "KIND_GPU", "gpus": [0, 1]}]


@pytest.mark.parametrize(
    "parameters, message",
    [
        ({"max_queue_delay_microseconds": "5 ms"}, "'max_queue_delay_microseconds' must be a whole number of microseconds"),
        ({"max_queue_delay_microseconds": "-1"}, "'max_queue_delay_microseconds' must be a whole number"),
        ({"max_queue_delay_microseconds": "2000", "queue_quiet_microseconds": "3000"}, r"\(3000\) exceeds .* \(2000\)"),
    ],
)
def test_a_queue_delay_the_backend_would_refuse_is_refused_with_its_name(tmp_path, parameters, message):
    repo.write_model(tmp_path, repo.make_config("m", parameters=parameters), {"model": "x"})
    with pytest.raises(repo.RepositoryError, match=message):
        repo.validate_repository(tmp_path)


def test_a_queue_delay_alone_gets_the_default_quiet_period_within_it():
    checks = repo._backend_checks()
    read = lambda values: lambda key, default: values.get(key, default)  # noqa: E731 - config.pbtxt's parameters
    assert checks.queue_window(read({})) == (0.0, 0.0)  # no delay: every request goes to the engine at once
    assert checks.queue_window(read({"max_queue_delay_microseconds": "5000"})) == (0.0015, 0.005)
    assert checks.queue_window(read({"max_queue_delay_microseconds": "1000"})) == (0.001, 0.001)
    assert checks.queue_window(read({"max_queue_delay_microseconds": "8000", "queue_quiet_microseconds": "500"})) == (0.0005, 0.008)
