"""The offline default model: conversion, caching, the end-of-turn fix, and resolving model specs."""

import json
import time

import pytest

from utils import model


def test_default_model_is_a_complete_hugging_face_folder():
    folder = model.prepare_default_model(progress=False)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "chat_template.jinja"):
        assert (folder / name).is_file(), name


def test_second_call_reuses_the_cached_folder():
    model.prepare_default_model(progress=False)
    started = time.monotonic()
    folder = model.prepare_default_model(progress=False)
    assert time.monotonic() - started < 0.5
    assert model.is_converted(folder)


def test_end_of_turn_is_the_eos_token():
    folder = model.prepare_default_model(progress=False)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokens = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    im_end = next(t["id"] for t in tokens if t["content"] == "<|im_end|>")
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == im_end
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == im_end


def test_gguf_is_found_without_importing_the_package():
    assert model.default_gguf().suffix == ".gguf"


@pytest.mark.parametrize("alias", ["default", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_default_aliases_resolve_to_the_converted_folder(alias):
    assert model.resolve_model(alias) == str(model.default_model_dir())


def test_local_folder_resolves_to_itself(tmp_path):
    assert model.resolve_model(tmp_path) == str(tmp_path.resolve())


def test_missing_local_folder_is_a_clear_error(tmp_path):
    with pytest.raises(model.ModelUnavailable, match="does not exist"):
        model.resolve_model(str(tmp_path / "nope"))


def test_unreachable_hub_names_the_offline_default(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.monotonic()
    with pytest.raises(model.ModelUnavailable, match="SmolLM2-135M-Instruct") as err:
        model.resolve_model("facebook/opt-125m")
    assert "facebook/opt-125m" in str(err.value)
    assert time.monotonic() - started < 10  # no hang on the network
