"""Where the project keeps what it makes: converted models and server runs.

Everything generated lives under one root (the checkout by default, ``TUTORIAL_HOME`` to move it), in
gitignored folders, so `make clean` can remove it and nothing leaks into a user's home directory.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def home() -> Path:
    """The folder that holds ``models/`` and ``runs/``."""
    return Path(os.environ.get("TUTORIAL_HOME", PROJECT_ROOT)).resolve()


def models_dir() -> Path:
    return home() / "models"


def runs_dir() -> Path:
    return home() / "runs"


def sample_repository() -> Path:
    """The checked-in model repository (the seed's sample)."""
    return PROJECT_ROOT / "model_repository"


def backend_source() -> Path:
    """Our Python-based vLLM backend: ``backend/vllm/model.py``; ``TUTORIAL_BACKEND_DIR`` serves another
    folder instead (to benchmark two versions of the backend on one machine)."""
    return Path(os.environ.get("TUTORIAL_BACKEND_DIR", PROJECT_ROOT / "backend" / "vllm")).resolve()
