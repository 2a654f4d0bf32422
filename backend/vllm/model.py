"""Triton's entry point for ``backend: "vllm"``: the stub loads this file by path and calls
``TritonPythonModel``. The work is in ``serving.py`` (see its docstring for the design); this file stays
light because Triton first starts a stub only to call ``auto_complete_config``, and importing vLLM there
cost about 20 s of every cold start (measured on an H200)."""

from __future__ import annotations

import importlib.util
import locale
import sys
import time
from pathlib import Path


def _use_utf8_locale() -> None:
    """The stub embeds Python without calling setlocale; vLLM and its tokenizers need a UTF-8 LC_CTYPE."""
    for name in ("C.UTF-8", "C.utf8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_CTYPE, name)
            return
        except locale.Error:
            continue


def _import_backend_package() -> None:
    """This folder as the package ``vllm_backend``, so its modules import each other by relative imports."""
    if "vllm_backend" in sys.modules:
        return
    here = Path(__file__).resolve().parent
    spec = importlib.util.spec_from_file_location("vllm_backend", here / "__init__.py", submodule_search_locations=[str(here)])
    package = importlib.util.module_from_spec(spec)
    sys.modules["vllm_backend"] = package
    spec.loader.exec_module(package)


_use_utf8_locale()  # before anything imports vLLM
_import_backend_package()

from vllm_backend.interface import auto_complete_config  # noqa: E402


class TritonPythonModel:
    """Triton's entry points: auto_complete_config, initialize, execute, finalize."""

    auto_complete_config = staticmethod(auto_complete_config)

    def initialize(self, args):
        started = time.perf_counter()
        from vllm_backend.serving import VllmModel  # vLLM is imported here, by the stub that serves

        self.model = VllmModel(args, import_s=time.perf_counter() - started)

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.finalize()
