"""The model class inspected in this process, not in a fresh interpreter.

Before building an engine, vLLM asks what the model's class supports (LoRA, multimodal, pooling...). For a
class it has not imported yet it answers in a new Python process, so that importing the model's module can
never initialize CUDA in the caller, and caches the answer under VLLM_CACHE_ROOT. That process imports torch
and vLLM again: 13 s of the 52 s an engine took to start with empty caches on an H200 (vLLM 0.26). This
process has imported both already and loads the class in about a second, so the backend loads it here and
registers it with vLLM's public ``ModelRegistry.register_model``; vLLM then inspects the loaded class where it
is. The engine runs in a process of its own (spawned), so a module that did touch CUDA here would cost this
process some GPU memory, never the engine's correctness.
"""

from __future__ import annotations

import importlib


def load_model_classes_here(model: str, *, trust_remote_code: bool = False, revision: str | None = None) -> list[str]:
    """Register the classes of ``model``'s architectures as loaded classes; return the architectures done.

    Only vLLM's own lazily registered classes are touched. A model whose config cannot be read here (a hub
    id not downloaded, a GGUF file) is left to vLLM, which then inspects it its own way and explains any
    failure itself.
    """
    from transformers import AutoConfig
    from vllm import ModelRegistry

    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code, revision=revision)
    except (OSError, ValueError):
        return []
    loaded = []
    for architecture in getattr(config, "architectures", None) or []:
        entry = ModelRegistry.models.get(architecture)
        module_name, class_name = getattr(entry, "module_name", None), getattr(entry, "class_name", None)
        if not (module_name and class_name):
            continue  # not one of vLLM's lazily registered classes
        try:
            model_class = getattr(importlib.import_module(module_name), class_name)
        except ImportError:
            continue  # vLLM's own inspection reports it
        ModelRegistry.register_model(architecture, model_class)
        loaded.append(architecture)
    return loaded
