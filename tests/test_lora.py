"""Multi-LoRA through the backend, with an adapter made here (peft) for the default model. The same server runs
with Triton custom metrics switched off (one server start fewer for the suite), which is tested here too."""

from __future__ import annotations

import json
import time

import pytest

from tests.backend_helpers import generate, metrics, stream
from utils import paths
from utils.model import prepare_default_model
from utils.repository import make_config, prepare_run_repository, write_model
from utils.server import TritonServer

PROMPT = {"text_input": "The capital of France is", "temperature": 0, "max_tokens": 12, "exclude_input_in_output": True}


def make_adapter(folder) -> str:
    """A rank-8 LoRA on the attention projections, randomly initialised so it visibly changes the output."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(prepare_default_model(progress=False), dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    source = tmp_path_factory.mktemp("lora-repository")
    adapter = make_adapter(tmp_path_factory.mktemp("adapter") / "smol-random")
    engine = {"model": "default", "enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
    model_dir = write_model(source, make_config("vllm_model", parameters={"REPORT_CUSTOM_METRICS": "no"}), engine)
    (model_dir / "1" / "multi_lora.json").write_text(json.dumps({"smol-random": adapter}))
    run_dir = paths.runs_dir() / f"pytest-lora-{time.strftime('%Y%m%d-%H%M%S')}"
    repository = prepare_run_repository(run_dir / "model_repository", source=source, log=lambda _: None)
    server = TritonServer(repository, run_dir=run_dir, free_ports=True)
    server.start().wait_ready(timeout=900, progress=False)
    yield server
    server.stop()


def test_adapter_changes_the_reply_and_the_base_model_is_unchanged(lora_server):
    _, base = generate(lora_server.http_url, PROMPT)
    status, adapted = generate(lora_server.http_url, {**PROMPT, "lora_name": "smol-random"})
    _, base_again = generate(lora_server.http_url, PROMPT)
    assert status == 200 and adapted["text_output"]
    assert adapted["text_output"] != base["text_output"]
    assert base_again["text_output"] == base["text_output"]


def test_lora_name_in_sampling_parameters_json(lora_server):
    status, body = generate(
        lora_server.http_url,
        {"text_input": "Hi", "sampling_parameters": json.dumps({"lora_name": "smol-random", "max_tokens": 4})},
    )
    assert status == 200 and body["text_output"].startswith("Hi")


def test_unknown_adapter_names_the_known_ones(lora_server):
    status, body = generate(lora_server.http_url, {**PROMPT, "lora_name": "smol-other"})
    assert status == 400
    assert "unknown lora_name 'smol-other'" in body["error"] and "smol-random" in body["error"]


def test_with_custom_metrics_off_nothing_is_published_and_streams_are_whole(lora_server):
    """REPORT_CUSTOM_METRICS no: no vllm: series on Triton's metrics port, and vLLM keeps no statistics
    (disable_log_stats) while streams still carry every token."""
    sampling = {"temperature": 0, "ignore_eos": True, "max_tokens": 9}
    streamed = stream(lora_server.grpc_url, "The capital of France is", sampling=sampling)
    assert streamed.error is None and sum(streamed.tokens) == 9
    assert not [name for name in metrics(lora_server.metrics_url) if name.startswith("vllm:")]
    assert "nv_inference_request_success" in " ".join(metrics(lora_server.metrics_url))  # the page itself is served


def test_enable_lora_without_a_table_fails_the_load_with_the_reason(tmp_path):
    source = tmp_path / "repository"
    write_model(source, make_config("vllm_model"), {"model": "default", "enable_lora": True})
    repository = prepare_run_repository(tmp_path / "run" / "model_repository", source=source, log=lambda _: None)
    server = TritonServer(repository, run_dir=tmp_path / "run", free_ports=True)
    server.start()
    try:
        with pytest.raises(Exception, match="multi_lora.json"):
            server.wait_ready(timeout=300, progress=False)
    finally:
        server.stop()
