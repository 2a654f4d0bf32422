"""The backend loads the model's class in its own process, so vLLM inspects it there instead of starting a
new interpreter that imports torch and vLLM again (13 s of a cold start on an H200). Run in a fresh
process with empty vLLM caches, as the stub runs it, so the pytest process never imports vLLM."""

from __future__ import annotations

import os
import subprocess
import sys

from utils.model import prepare_default_model
from utils.paths import backend_source

SCRIPT = """
import importlib.util, subprocess, sys
spec = importlib.util.spec_from_file_location("inspection", sys.argv[1])
inspection = importlib.util.module_from_spec(spec)
spec.loader.exec_module(inspection)
model, load_here = sys.argv[2], sys.argv[3] == "yes"
assert inspection.load_model_classes_here(sys.argv[4]) == []  # no config to read: left to vLLM
if load_here:
    print("loaded", inspection.load_model_classes_here(model))

def no_interpreter(*args, **kwargs):  # vLLM may wrap the error (vLLM 0.26 does): the mark goes out first
    print("vLLM started an interpreter to inspect the model class", file=sys.stderr, flush=True)
    raise RuntimeError("no interpreter here")

subprocess.run = no_interpreter
from vllm.config import ModelConfig
print("architecture", ModelConfig(model=model).architecture)
"""


def _inspect(tmp_path, load_here: bool) -> subprocess.CompletedProcess:
    empty = tmp_path / "empty"
    empty.mkdir(exist_ok=True)
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"), "VLLM_NO_USAGE_STATS": "1"}
    command = [
        sys.executable, "-c", SCRIPT, str(backend_source() / "inspection.py"), str(prepare_default_model(progress=False)),
        "yes" if load_here else "no", str(empty),
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def test_a_loaded_class_is_inspected_without_a_new_interpreter(tmp_path):
    done = _inspect(tmp_path, load_here=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "vLLM started an interpreter" not in done.stderr
    assert "loaded ['LlamaForCausalLM']" in done.stdout and "architecture LlamaForCausalLM" in done.stdout


def test_without_it_vllm_would_start_one(tmp_path):
    """The check above can fail: with the class left lazy, vLLM's inspection reaches for an interpreter."""
    done = _inspect(tmp_path, load_here=False)
    assert done.returncode != 0 and "vLLM started an interpreter to inspect the model class" in done.stderr
