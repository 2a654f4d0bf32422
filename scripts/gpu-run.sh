#!/usr/bin/env bash
# The GPU session, one phase per call of the device tool (each call <10 min; results land in $OUT).
# Prerequisite: the gpu-kit parts copied to /tmp/gpu-parts (../shared/gpu-kit/README.md).
#   setup    build /tmp/gpu-env from the kit, print versions and the GPU
#   compare  time to ready and throughput: our GPU default (no torch.compile, full CUDA graphs)
#            against vLLM's default (torch.compile + graphs), Triton gRPC at concurrency 1/64/256
#   test     the whole suite with the default (full) notebook parameters: make test PYTHON=...
#   bench    the benchmark of record: four targets, concurrency 1/16/64/256, 128 tokens, ~100-token prompts
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH=/tmp/gpu-env/bin:$PATH LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu PYTHONUNBUFFERED=1
PY=/tmp/gpu-env/bin/python
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export TUTORIAL_HOME=/tmp/tutorial-home   # runs/ and models/ outside the copied tree; kept while warm
mkdir -p "$TUTORIAL_HOME"

pack() {  # pack a benchmark folder's results (not its server logs' bulk) into one file under $OUT
  local src=$1 name=$2
  tar -C "$src" -czf "$OUT/$name.tgz" --exclude='*/tmp' --exclude='*/backends' --exclude='*/model_repository' . 2>/dev/null
}

case "${1:-}" in
  setup)
    bash /tmp/gpu-parts/device-setup.sh 2>&1 | tail -5
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    $PY -c "import vllm, torch, numpy; print('vllm', vllm.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__)"
    time make setup PYTHON=$PY
    ;;
  compare)
    for variant in default compiled; do
      overrides='{}'
      [ "$variant" = compiled ] && overrides='{"compilation_config": {}}'
      /usr/bin/time -f "$variant: %e s wall" $PY -m utils.bench --targets triton-grpc --concurrency 1,64,256 \
        --max-tokens 128 --prompt-tokens 100 --engine-overrides "$overrides" --out "$TUTORIAL_HOME/compare-$variant" 2>&1 \
        | grep -v "it/s\]\|s/it\]\|level/s\]" | tee "$OUT/compare-$variant.log"
      cp "$TUTORIAL_HOME/compare-$variant/summary.csv" "$OUT/compare-$variant.csv"
      grep -A3 startup_s "$TUTORIAL_HOME/compare-$variant/environment.json" | tee -a "$OUT/compare-$variant.log"
    done
    ;;
  test)
    start=$(date +%s)
    make test PYTHON=$PY PYTEST_ARGS="--junitxml=$OUT/junit.xml -p no:cacheprovider" 2>&1 \
      | grep -v "Triton starting\|it/s\]\|s/it\]" | tee "$OUT/test.log"
    echo "make test: $(( $(date +%s) - start )) s" | tee -a "$OUT/test.log"
    ;;
  bench)
    $PY -m utils.bench --targets triton-grpc,triton-http,vllm-openai,direct --concurrency 1,16,64,256 \
      --max-tokens 128 --prompt-tokens 100 --repeats 2 --out "$TUTORIAL_HOME/h200" 2>&1 \
      | grep -v "it/s\]\|s/it\]\|level/s\]" | tee "$OUT/bench.log"
    pack "$TUTORIAL_HOME/h200" h200
    ;;
  *)
    echo "usage: $0 setup|compare|test|bench" >&2; exit 2 ;;
esac
