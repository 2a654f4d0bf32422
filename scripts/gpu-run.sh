#!/usr/bin/env bash
# The GPU session, one phase per call of the device tool (each call <10 min; results land in $OUT).
# Prerequisite: the gpu-kit parts copied to /tmp/gpu-parts (../shared/gpu-kit/README.md).
#   setup    build /tmp/gpu-env from the kit, print versions and the GPU
#   compare  time to ready and throughput: our GPU default (no torch.compile, full CUDA graphs)
#            against vLLM's default (torch.compile + graphs), Triton gRPC at concurrency 1/64/256
#   test     the whole suite with the default (full) notebook parameters: make test PYTHON=...
#   final    one Triton: core tests, then Triton gRPC against vLLM's server (a short device budget)
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
  final)
    # one short session: one Triton for the core tests and the benchmark (each vLLM start costs minutes)
    t0=$(date +%s)
    make serve PYTHON=$PY 2>&1 | grep -v "Triton starting" | tail -3 | tee "$OUT/final.log"
    echo "triton ready after $(( $(date +%s) - t0 )) s (model conversion included)" | tee -a "$OUT/final.log"
    export TUTORIAL_TRITON=$($PY -c "import json; i=json.load(open('$TUTORIAL_HOME/runs/serve.json')); print(json.dumps({k: i[k] for k in ('host','http','grpc','metrics')}))")
    timeout 150 $PY -m pytest tests/test_server.py tests/test_backend.py -q --tb=short -p no:cacheprovider 2>&1 \
      | tail -40 | tee -a "$OUT/final.log"
    timeout $(( 560 - ($(date +%s) - t0) )) $PY -m utils.bench --targets triton-grpc,vllm-openai --concurrency 1,16,64,256 \
      --max-tokens 128 --prompt-tokens 100 --out "$TUTORIAL_HOME/h200" 2>&1 | grep -v "it/s\]\|s/it\]\|level/s\]" | tail -30 | tee -a "$OUT/final.log"
    serve_dir=$($PY -c "import json; print(json.load(open('$TUTORIAL_HOME/runs/serve.json'))['run_dir'])")
    cp "$serve_dir/server.log" "$OUT/triton-server.log"
    make stop PYTHON=$PY | tee -a "$OUT/final.log"
    pack "$TUTORIAL_HOME/h200" h200
    echo "final: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/final.log"
    ;;
  *)
    echo "usage: $0 setup|compare|test|bench" >&2; exit 2 ;;
esac
