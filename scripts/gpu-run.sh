#!/usr/bin/env bash
# The GPU session, one phase per call of the device tool (each call <10 min; results land in $OUT).
# Prerequisite: the gpu-kit parts copied to /tmp/gpu-parts (../shared/gpu-kit/README.md), built with
# EXTRA_PINS="uvloop==0.23.0 papermill==2.7.0 entrypoints==0.4.2 tenacity==9.2.1 py-spy==0.4.3" (vLLM's server runs
# on uvloop; the notebook-structure tests and `make tutorial` import papermill; `profile` samples with py-spy; the kit
# has none of them). A call that runs `ab` or `bench` after other phases exports CALL_START=$(date +%s) and CALL_LIMIT_S (its
# timeout_s) first: they then end 25 s before the call's limit (`within_call`), and their runs come back even if it is hit.
#   setup      build /tmp/gpu-env from the kit, print versions and the GPU, `make setup` (bytecode), time vLLM's import, convert the model
#   bench      the benchmark of record: the four targets and triton-grpc-per-request (BENCH_TARGETS) in one run, all up at
#              once, each level on every target back to back (HTTP first, then the order rotated at the second repeat),
#              concurrency 1/16/64/256 (BENCH_LEVELS), 128 tokens, ~100-token prompts, 8 s per level (BENCH_DURATION),
#              2 repeats (the first Triton start on a fresh machine is cold); four targets at 8 s took 417 s on an H100,
#              at 6 s 351 s on an H100 and over 440 s on a slow H200 (2026-12-07: 28 of 32 runs in the 437 s left of a 595 s call
#              after `setup`'s 133 s), so on an unknown machine give `bench` a call of its own (the engines start one after another:
#              on an H100 on 2026-12-08 Triton x1, Triton x2 and `direct` took 155 s to be up); BENCH_INSTANCES="1,2" measures
#              each Triton target with one instance and with two sharing the engine (target@x1, target@x2), side by side
#   tests      pytest tests/ with its own session server (the machine's first, cold start: the ready line splits it);
#              `tests PATH...` runs those paths only: on 2026-12-04 a slower H200 ran past 560 s with the whole suite, so
#              split it over three calls: on an H100 on 2026-12-07 `tests/test_[a-c]*.py` (128 tests) took over 335 s,
#              `tests/test_lifecycle.py` 257 s, `tests/test_[m-z]*.py` 64 s after a 23 s start; `tests/test_[d-z]*.py`
#              ran past 330 s (the rest, `tests/test_[d-k]*.py tests/test_lora.py`, not yet timed on its own)
#   notebooks  `make serve` (a second start: compile caches warm), pytest --nbmake notebooks/ (full parameters)
#              on that server, then `make stop`
#   ab         backends side by side in one run: this tree's (`main`) and each one carried as .gpu/ab/NAME/vllm (a changed copy),
#              or the NAME=DIR pairs of AB_VARIANTS, each on a Triton of its own, all up at once (utils.bench --triton-backends):
#              each level runs on every variant and protocol back to back, AB_ROUNDS times (default 2, the order rotated each
#              time: on 2026-12-06 one backend's two rounds five minutes apart differed by 15-30 %), concurrency 1/64/256
#              (AB_LEVELS), 8 s per level (AB_DURATION); compare requests/s (and its min-max over the rounds), TTFT,
#              tokens_per_response, server_execute_ms, the engine's running requests, step time and steps with a prefill per
#              request, where the time went (engine_e2e_ms, vllm_frontend_ms, outside_vllm_ms), and the CPU columns (ab.csv,
#              ab-requests.csv, ab-table.txt); AB_INSTANCES="1 2" also runs every variant with two instances of the model
#              (two Python processes, front-ends of one engine: ab-x2.csv); AB_DIRECT=1 adds the in-process engine, the ceiling, to the same run, AB_VLLM=1 vLLM's server; a second
#              table gives each round's requests/s, arrival_gap_cv and TTFT p50, and per level the correlation, over the Triton
#              runs, of arrival_gap_cv with requests/s over the round's Triton mean (on an H100 on 2026-12-06, -0.72 to -0.79 at
#              256 streams: the rounds where the clients' sends bunched served less); AB_LIMIT_S (default 480) bounds each
#              benchmark: it starts no run within 60 s of the bound and writes the runs measured (SIGTERM at the bound too)
#   coldstart  time to ready from empty caches (each variant its own TUTORIAL_HOME, the converted model shared) and
#              Triton gRPC requests/s at 1/64/256, one run per variant on this machine (COLDSTART_VARIANTS, default
#              "ours v1 v1-fork"; also "fork", and "compiled": vLLM's default, torch.compile + graphs, ~3 min cold):
#              ours = the GPU defaults (no torch.compile, full CUDA graphs), v1 = VLLM_USE_V2_MODEL_RUNNER=0 (no
#              Triton-kernel warm-up), fork = VLLM_WORKER_MULTIPROC_METHOD=fork (no second import of vLLM);
#              COLDSTART_TESTS="tests/test_client.py" also runs those tests on each variant (V1 + fork once
#              answered two identical greedy requests with garbage: test_non_streaming_request_gets_one_response)
#   profile    where the CPU time goes while serving: each of PROFILE_TARGETS (default "triton-grpc vllm-openai direct") at
#              each concurrency of PROFILE_LEVELS ("64 256"), PROFILE_S + 16 s per level; for PROFILE_S (10) seconds of each,
#              py-spy samples the engine's processes (VLLM::*) and the engine core's parent, the frontend (Triton's stub,
#              vLLM's API server, the direct engine's load worker), per thread: profile-TARGET-cLEVEL-ROLE-PID.txt (py-spy raw)
#              and profile-summary.txt (the levels' figures with CPU columns, then scripts/profile-summary.py), the engine
#              core once more with its idle samples (profile-TARGET-cLEVEL-enginecore-waits-PID.txt: where it waits), and
#              in the summary the engine core's threads by name, per target, and per level its busy loop behind each
#              target side by side in ms per engine step (profile-summary.py --compare: where a step takes longer);
#              profile-pyspy.log: py-spy's own messages and whether it may read processes that are not its descendants
#              (if Yama refuses, every Python of the phase names any reader); profile-cpus.txt: the CPU topology;
#              profile-placement-TARGET-cLEVEL.txt: scripts/cpu-placement.py, twice a second, the busy threads of those
#              processes, Triton's and the load generator's, the CPUs they ran on, how often two shared a physical core
#   pin        does an engine core held on a CPU of its own serve faster? (`profile` on 2026-12-06 saw Triton's engine core
#              move from CPU to CPU, the in-process engine's stay on one.) One run, every target of PIN_TARGETS (default
#              triton-grpc,triton-http,direct) up at once, PIN_LEVELS (64), PIN_DURATION (6) s per run, 5 repeats: 1-2 as the
#              kernel places the processes, then each engine core's busy loop (its main thread) held on a CPU of its own
#              and every other thread of the run kept off those CPUs, 4-5 held (3 is the switch); pin.txt: requests/s per
#              target and repeat with each Triton target's share of the in-process engine's; pin-placement-before/after.txt:
#              scripts/cpu-placement.py (with the kernel's migration and context-switch counts per CPU second) over repeat 1
#              and over repeat 4
#   interfere  does work on other CPUs slow the in-process engine's steps? (`profile` on 2026-12-06, 1 stream: behind Triton,
#              whose path to the client keeps ~0.45 of a core more busy, the engine core's step took 3 % longer, spread over
#              every function of it.) One run of `direct` at INTERFERE_LEVEL (1) streams, 6 s per run, 6 repeats: 1-2 alone,
#              3-4 with INTERFERE_N (2) Python processes spinning on the CPU, 5-6 with as many copying 64 MiB arrays (the
#              caches and memory); interfere.txt: per repeat requests/s, the engine's ms per step (a request's inference
#              time over its tokens), the machine's busy cores, and each repeat's requests/s over the mean of 1-2
#   frontend   scripts/frontend-bench.py on this machine's CPU and vLLM (no engine, about a minute): the event loop's time per
#              engine step with vLLM's defaults, without its Prometheus logger, and paced (frontend.txt)
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH=/tmp/gpu-env/bin:$PATH LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu PYTHONUNBUFFERED=1 PYTHONPATH=$PWD  # notebook kernels import utils
PY=${PY:-/tmp/gpu-env/bin/python}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export TUTORIAL_HOME=/tmp/tutorial-home   # runs/ and models/ outside the copied tree; kept while warm
mkdir -p "$TUTORIAL_HOME"

shared_address() {  # the background server of `make serve`, as TUTORIAL_TRITON wants it
  $PY -c "import json; i=json.load(open('$TUTORIAL_HOME/runs/serve.json')); print(json.dumps({k: i[k] for k in ('host','http','grpc','metrics')}))"
}

without_progress() {  # progress bars redraw in place (carriage returns, cursor moves): in a log file, thousands of lines
  tr '\r' '\n' | sed 's/\x1b\[[0-9;]*[A-Za-z]//g' | grep -v '^\s*$\|\[[0-9:]*[0-9][<,]\|\[[0-9:]*[0-9]\]'
}

pack() {  # pack a benchmark folder's results into one file under $OUT: at most 8 files of 16 MiB come back from a call,
  # so not its server logs' bulk nor requests.csv (a 4-target run's was 23 MiB gzipped on 2026-12-06)
  local src=$1 name=$2
  tar -C "$src" -czf "$OUT/$name.tgz" --exclude='*/tmp' --exclude='*/backends' --exclude='*/model_repository' \
    --exclude=requests.csv . 2>/dev/null
}

within_call() {  # $1 seconds, or what is left of the device call if fewer: CALL_START (date +%s) and CALL_LIMIT_S (the
  # run's timeout_s), exported by its command line, less 25 s to stop and copy; a call that runs past its limit is killed
  # outright (2026-12-07: `setup` took 125 s on a fresh H100, and the `ab` after it, bounded at 470 s, lost 28 runs)
  local left=$1
  if [ -n "${CALL_LIMIT_S:-}" ]; then
    left=$(( ${CALL_START:?export CALL_START=\$(date +%s) with CALL_LIMIT_S} + CALL_LIMIT_S - $(date +%s) - 25 ))
    [ "$left" -lt "$1" ] || left=$1
    [ "$left" -ge 1 ] || left=1  # `timeout 0` would mean no limit at all
  fi
  echo "$left"
}

sending_measured() {  # every 15 s, the runs the benchmark writing $1 has saved (utils.bench's measured/) and its
  # environment.json, packed as $OUT/$2-measured.tgz, which comes back should the call be killed; locally
  # `tar -xzf NAME-measured.tgz -C DIR && python -m utils.bench --summarize DIR` makes their results
  local src=$1 name=$2
  while sleep 15; do
    [ -d "$src/measured" ] && tar -C "$src" -czf "$OUT/$name-measured.partial" measured environment.json 2>/dev/null \
      && mv "$OUT/$name-measured.partial" "$OUT/$name-measured.tgz"
  done
}

reached() {  # until the benchmark writing $log (pid $bench) starts repeat $1 of its level, or has ended
  until grep -q "#$1:" "$log" 2>/dev/null || ! kill -0 "$bench" 2>/dev/null; do sleep 0.5; done
}

labelled() {  # LABEL=PID for scripts/cpu-placement.py, each process once: vLLM's by role, Triton, its stubs, other Pythons
  local pid role seen=" "
  for pid in "$@"; do
    case $seen in *" $pid "*) continue ;; esac
    seen+="$pid "
    role=$(ps -o args= -p "$pid" | grep -o '^VLLM::[A-Za-z]*\|tritonserver\|triton_python_backend_stub' | head -1 | sed 's/^VLLM:://')
    echo "${role:-python}-$pid=$pid"
  done
}

case "${1:-}" in
  setup)
    bash /tmp/gpu-parts/device-setup.sh 2>&1 | tail -5
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    $PY -c "import vllm, torch, numpy, uvloop, papermill; print('vllm', vllm.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__, 'uvloop', uvloop.__version__)"
    time make setup PYTHON=$PY
    echo "vLLM's engine import, bytecode compiled:"; time $PY -c "from vllm.v1.engine.async_llm import AsyncLLM"
    echo "the default model, converted once (the servers' starts then leave it out):"
    time $PY -c "from utils.model import prepare_default_model; print(prepare_default_model(progress=False))"
    ;;
  coldstart)
    for variant in ${COLDSTART_VARIANTS:-ours v1 v1-fork}; do
      home=/tmp/cold-$variant overrides=null settings=()
      rm -rf "$home" && mkdir -p "$home" && ln -s "$TUTORIAL_HOME/models" "$home/models"
      case $variant in
        ours) ;;
        v1) settings=(VLLM_USE_V2_MODEL_RUNNER=0) ;;
        fork) settings=(VLLM_WORKER_MULTIPROC_METHOD=fork) ;;
        v1-fork) settings=(VLLM_USE_V2_MODEL_RUNNER=0 VLLM_WORKER_MULTIPROC_METHOD=fork) ;;
        compiled) overrides='{"optimization_level": 2, "compilation_config": {}}' ;;
        *) echo "unknown variant $variant" >&2; continue ;;
      esac
      echo "== $variant: ${settings[*]} engine overrides $overrides" | tee -a "$OUT/coldstart.log"
      env TUTORIAL_HOME="$home" "${settings[@]}" timeout "${COLDSTART_LIMIT_S:-300}" $PY -m utils.bench --targets triton-grpc \
        --concurrency "${COLDSTART_LEVELS:-1,64,256}" --max-tokens 128 --prompt-tokens 100 --duration "${COLDSTART_DURATION:-6}" --no-plots \
        --engine-overrides "$overrides" --out "$home/bench" 2>&1 | without_progress >> "$OUT/coldstart.log"
      grep -ho "ready: model=.*" "$home"/bench/*/server.log | grep -o "started in.*" | tee -a "$OUT/coldstart.log"
      cp "$home/bench/summary.csv" "$OUT/coldstart-$variant.csv" 2>/dev/null
      if [ -n "${COLDSTART_TESTS:-}" ]; then  # does the variant still answer right? (V1 + fork once did not)
        env TUTORIAL_HOME="$home" "${settings[@]}" timeout 300 $PY -m pytest -q -p no:cacheprovider --tb=line $COLDSTART_TESTS 2>&1 \
          | without_progress | tail -6 | tee -a "$OUT/coldstart.log"
      fi
      $PY -c "import json, pandas as pd; e = json.load(open('$home/bench/environment.json')); s = pd.read_csv('$home/bench/summary.csv'); \
print('startup_s', e.get('startup_s'), '| req/s', s.requests_per_s.round(1).tolist(), '| ttft p50', s.ttft_p50_ms.round(1).tolist(), \
'| itl p50', s.itl_p50_ms.round(2).tolist())" 2>&1 | tee -a "$OUT/coldstart.log"
    done
    ;;
  ab)
    rm -rf /tmp/ab && mkdir -p /tmp/ab && cp -r .gpu/ab/. /tmp/ab/ 2>/dev/null  # carried backends, out of the tree Triton copies
    carried=$(for dir in /tmp/ab/*/vllm; do [ -d "$dir" ] && echo "$(basename "$(dirname "$dir")")=$dir"; done)
    backends=$(echo ${AB_VARIANTS:-main=backend/vllm $carried} | tr ' ' ,)
    for instances in ${AB_INSTANCES:-1}; do  # every variant's Triton up at once, each level on all of them back to back
      name=ab$([ "$instances" = 1 ] || echo "-x$instances")
      limit=$(within_call "${AB_LIMIT_S:-480}")
      sending_measured "$TUTORIAL_HOME/$name" "$name" & sender=$!
      timeout -k 20 "$limit" $PY -m utils.bench --targets "triton-grpc,triton-http${AB_DIRECT:+,direct}${AB_VLLM:+,vllm-openai}" \
        --triton-backends "$backends" --concurrency "${AB_LEVELS:-1,64,256}" --max-tokens 128 --prompt-tokens 100 \
        --duration "${AB_DURATION:-8}" --repeats "${AB_ROUNDS:-2}" --triton-instances "$instances" --no-plots \
        --time-limit $(( limit > 61 ? limit - 60 : 1 )) --out "$TUTORIAL_HOME/$name" 2>&1 \
        | without_progress | tee "$OUT/$name.log"
      kill $sender; rm -f "$OUT/$name-measured".*  # the benchmark wrote its results
      grep -o "ready: model=.*" "$TUTORIAL_HOME/$name"/triton-*/server.log | grep -o "^[^:]*\|started in.*" | paste - - | tee -a "$OUT/$name.log"
      cp "$TUTORIAL_HOME/$name/summary.csv" "$OUT/$name.csv"
      cp "$TUTORIAL_HOME/$name/requests.csv" "$OUT/$name-requests.csv"
    done
    $PY - "$OUT" <<'PY' | tee "$OUT/ab-table.txt"  # one table: the variants side by side per protocol and level
import glob, os, sys
import pandas as pd
runs = []
for f in sorted(glob.glob(f"{sys.argv[1]}/ab*.csv")):
    if not f.endswith("-requests.csv"):
        s = pd.read_csv(f)
        parts = s["target"].str.partition("@")  # target@variant; the in-process engine has no variant
        runs.append(s.assign(target=parts[0], run=parts[2].replace("", "-"), instances=os.path.basename(f)[:-4]))
table = pd.concat(runs).pivot_table(index=["instances", "target", "concurrency"], columns="run", sort=False,
                                    values=["requests_per_s", "requests_per_s_min", "requests_per_s_max", "ttft_p50_ms",
                                            "tokens_per_response", "arrival_gap_cv", "server_execute_ms",
                                            "engine_running_mean", "engine_step_ms", "engine_ttft_ms", "engine_e2e_ms",
                                            "engine_inference_ms", "engine_prefill_steps_per_request", "engine_tokens_per_step",
                                            "vllm_frontend_ms", "outside_vllm_ms",
                                            "cpu_machine", "cpu_frontend", "cpu_engine", "cpu_load_busiest", "cpu_steal"])
print(table.round(2).to_string())
PY
    $PY - "$OUT" <<'PY' | tee -a "$OUT/ab-table.txt"  # per round: how bunched the clients' sends were, and the requests/s
import glob, sys
import numpy as np
import pandas as pd
from utils.bench import arrival_gap_cv, read_records, repeat_throughput
for path in sorted(glob.glob(f"{sys.argv[1]}/ab*-requests.csv")):
    rounds = pd.DataFrame([
        {"target": target, "concurrency": level, "round": repeat + 1, "requests_per_s": repeat_throughput(run)["requests_per_s"],
         "arrival_gap_cv": arrival_gap_cv(run), "ttft_p50_ms": run["ttft_ms"].median()}
        for (target, level, repeat), run in read_records(path).groupby(["target", "concurrency", "repeat"])
    ])
    triton = rounds[rounds["target"].str.startswith("triton")].copy()  # over the round's Triton mean: the machine's drift out
    triton["of_round_mean"] = triton["requests_per_s"] / triton.groupby(["concurrency", "round"])["requests_per_s"].transform("mean")
    print(f"\n{path}: each round, requests/s over the mean of that round's Triton runs, against arrival_gap_cv")
    print(rounds.pivot_table(index=["concurrency", "target"], columns="round", values=["requests_per_s", "arrival_gap_cv", "ttft_p50_ms"]).round(2).to_string())
    for level, runs in triton.groupby("concurrency"):
        if len(runs) > 2:
            print(f"{level} streams, {len(runs)} Triton runs: correlation of arrival_gap_cv with requests/s over the round's mean "
                  f"{np.corrcoef(runs['arrival_gap_cv'], runs['of_round_mean'])[0, 1]:.2f}, with TTFT p50 "
                  f"{np.corrcoef(runs['arrival_gap_cv'], runs['ttft_p50_ms'])[0, 1]:.2f}")
PY
    ;;
  bench)
    make stop PYTHON=$PY >/dev/null 2>&1  # a background server left by the notebooks phase: the benchmark starts its own
    limit=$(within_call "${BENCH_LIMIT_S:-540}")
    sending_measured "$TUTORIAL_HOME/bench" bench & sender=$!
    timeout -k 20 "$limit" $PY -m utils.bench --targets "${BENCH_TARGETS:-triton-http,triton-grpc,triton-grpc-per-request,vllm-openai,direct}" \
      --concurrency "${BENCH_LEVELS:-1,16,64,256}" --max-tokens 128 --prompt-tokens 100 --duration "${BENCH_DURATION:-8}" --repeats "${BENCH_REPEATS:-2}" \
      --triton-instances "${BENCH_INSTANCES:-1}" --time-limit $(( limit > 61 ? limit - 60 : 1 )) --out "$TUTORIAL_HOME/bench" 2>&1 \
      | without_progress | tee "$OUT/bench.log"
    kill $sender; rm -f "$OUT/bench-measured".*
    for f in summary.csv environment.json; do cp "$TUTORIAL_HOME/bench/$f" "$OUT/bench-$f"; done
    pack "$TUTORIAL_HOME/bench" bench  # summary, environment, plots: notebooks/results/<gpu>/ takes them
    ;;
  tests)
    t0=$(date +%s)
    shift  # any further arguments: the test paths of this call (a slower machine ran past one call's 10 min with all)
    timeout "${TESTS_LIMIT_S:-560}" $PY -m pytest "${@:-tests}" -p no:cacheprovider --tb=short \
      --junitxml="$OUT/tests-junit.xml" 2>&1 | without_progress | tee "$OUT/tests.log"
    echo "tests: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/tests.log"
    log=$(ls -t "$TUTORIAL_HOME"/runs/pytest-*/server.log | head -1)
    cp "$log" "$OUT/tests-server.log"  # the machine's first start, with vLLM's timings
    grep -o "ready: model=.*" "$log" | tee -a "$OUT/tests.log"
    ;;
  notebooks)
    t0=$(date +%s)
    make serve PYTHON=$PY 2>&1 | without_progress | tail -2 | tee "$OUT/notebooks.log"
    echo "background triton ready after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/notebooks.log"
    grep -o "ready: model=.*" "$TUTORIAL_HOME"/runs/serve-*/server.log | tee -a "$OUT/notebooks.log"
    export TUTORIAL_TRITON=$(shared_address)
    timeout $(( ${NOTEBOOKS_LIMIT_S:-560} - ($(date +%s) - t0) )) $PY -m pytest notebooks -p no:cacheprovider --tb=short --durations=0 \
      --junitxml="$OUT/notebooks-junit.xml" 2>&1 | without_progress | tee -a "$OUT/notebooks.log"
    make stop PYTHON=$PY | tee -a "$OUT/notebooks.log"
    cp "$(ls -td "$TUTORIAL_HOME"/runs/serve-*/ | head -1)server.log" "$OUT/notebooks-server.log"  # when Triton started, what it waited on
    echo "notebooks: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/notebooks.log"
    ;;
  profile)
    rate=${PROFILE_RATE:-100} seconds=${PROFILE_S:-10} levels=${PROFILE_LEVELS:-64 256} files=()
    targets=${PROFILE_TARGETS:-triton-grpc vllm-openai direct}
    site=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    spy=$(command -v py-spy || ls "$(dirname "$PY")/py-spy" "$site/bin/py-spy" 2>/dev/null | head -1)  # the kit installs with --target
    diag="$OUT/profile-pyspy.log"  # why py-spy could not look, if it could not (the run of 2026-12-04 19:30 got nothing)
    { echo "py-spy: $spy ($($spy --version 2>&1))"; echo "ptrace_scope: $(cat /proc/sys/kernel/yama/ptrace_scope 2>&1)"
      grep CapEff /proc/self/status; } > "$diag"
    can_attach() {  # py-spy reads a Python process that is not its descendant (as it must: the servers are the bench's)
      $PY -c "import time; time.sleep(20)" & local pid=$!
      sleep 1; $spy dump --pid $pid --nonblocking >> "$diag" 2>&1; local rc=$?
      kill $pid; return $rc
    }
    if ! can_attach; then
      # Yama's ptrace_scope 1 lets a process read only its descendants, unless the process names a reader: every Python
      # started from here on (the stub, vLLM's processes) says "anyone" (PR_SET_PTRACER_ANY), for this phase only
      echo "import ctypes; ctypes.CDLL(None).prctl(0x59616d61, ctypes.c_ulong(2**64 - 1), 0, 0, 0)" > "$site/profile_ptracer_any.pth"
      can_attach && echo "attach: allowed once Python processes name any reader" >> "$diag" || echo "attach: refused either way" >> "$diag"
    fi
    lscpu -e=CPU,CORE,SOCKET,NODE > "$OUT/profile-cpus.txt" 2>&1  # which logical CPUs share a physical core
    for target in $targets; do
      log="$OUT/profile-$target.log"
      $PY -m utils.bench --targets "$target" --concurrency "$(echo $levels | tr ' ' ,)" --max-tokens 128 --prompt-tokens 100 \
        --repeats 1 --duration $(( seconds + 16 )) --no-plots --out "$TUTORIAL_HOME/profile-$target" > "$log" 2>&1 &
      bench=$!
      for level in $levels; do
        until grep -q "$target c=$level:" "$log" 2>/dev/null || ! kill -0 $bench 2>/dev/null; do sleep 1; done  # the level's bar
        sleep 4  # past the level's ramp-up
        core=$(pgrep -f '^VLLM::EngineCore' | head -1)
        if [ -z "$core" ]; then echo "$target: no engine core running (see $log)" | tee -a "$OUT/profile-summary.txt"; break; fi
        frontend=$(ps -o ppid= -p "$core" | tr -d ' ')
        echo "$target c=$level: frontend $frontend ($(ps -o args= -p "$frontend" | cut -c1-80))" | tee -a "$OUT/profile-summary.txt"
        # the engine core's threads by name (an OpenMP pool, say, would wake on every CPU op); not its environment: once
        # vLLM renames the process (setproctitle), /proc/PID/environ no longer holds it
        echo "  engine core $core threads: $(cat /proc/$core/task/*/comm | sort | uniq -c | sort -rn | awk '{printf "%s x%s, ", $2, $1}')" \
          | tee -a "$OUT/profile-summary.txt"
        pids="$frontend $(pgrep -f '^VLLM::' | tr '\n' ' ')"  # the frontend, the engine core, its workers if any
        for pid in $pids; do
          role=$(ps -o args= -p "$pid" | grep -o '^VLLM::[A-Za-z]*' | cut -c7- | tr A-Z a-z)
          name="$OUT/profile-$target-c$level-${role:-frontend}-$pid.txt"
          echo "--- $name" >> "$diag"
          $spy record --pid "$pid" --duration "$seconds" --rate "$rate" --nonblocking --threads --format raw -o "$name" >> "$diag" 2>&1 &
          files+=("$name")
        done
        # where the engine core waits, too (idle samples kept): behind Triton it gave its CPU up ~1070 times a second
        name="$OUT/profile-$target-c$level-enginecore-waits-$core.txt"
        $spy record --pid "$core" --duration "$seconds" --rate "$rate" --nonblocking --threads --idle --format raw -o "$name" >> "$diag" 2>&1 &
        files+=("$name")
        # where the busy threads ran: two on one physical core (SMT siblings) slow each other
        placed=$(labelled $pids $(pgrep -x tritonserver) $bench $(pgrep -P "$bench"))  # front-end, engine, Triton, load
        $PY scripts/cpu-placement.py "$seconds" 0.5 $placed > "$OUT/profile-placement-$target-c$level.txt" 2>&1 &
      done
      wait $bench
      $PY -c "import pandas as pd; s = pd.read_csv('$TUTORIAL_HOME/profile-$target/summary.csv'); print(s[['target', 'concurrency', \
'requests_per_s', 'ttft_p50_ms', 'tokens_per_response', 'engine_running_mean', 'engine_step_ms', 'cpu_machine', 'cpu_load_busiest', \
'cpu_frontend', 'cpu_engine', 'cpu_server', 'cpu_steal']].round(2).to_string(index=False))" \
        | tee -a "$OUT/profile-summary.txt"
    done
    wait
    rm -f "$site/profile_ptracer_any.pth"
    $PY scripts/profile-summary.py "$rate" "$seconds" "${files[@]}" >> "$OUT/profile-summary.txt"
    for level in $levels; do  # the engine core's busy loop behind each front-end side by side, in ms per engine step
      specs=()
      for target in $targets; do
        file=$(ls "$OUT/profile-$target-c$level-enginecore-"[0-9]*.txt 2>/dev/null | head -1)
        step=$($PY -c "import pandas as pd; s = pd.read_csv('$TUTORIAL_HOME/profile-$target/summary.csv').set_index('concurrency'); \
print(s.engine_step_ms[$level])" 2>/dev/null)
        [ -n "$file" ] && [ -n "$step" ] && specs+=("$target=$file=$step")
      done
      [ ${#specs[@]} -gt 1 ] && $PY scripts/profile-summary.py --compare MainThread "${specs[@]}" >> "$OUT/profile-summary.txt"
    done
    # at most 8 files come back from a call: everything but the summary and py-spy's log in one archive
    (cd "$OUT" && tar -czf profile.tgz --exclude=profile-summary.txt --exclude=profile-pyspy.log profile-* \
      && find . -maxdepth 1 -name 'profile-*' ! -name profile-summary.txt ! -name profile-pyspy.log -delete)
    ;;
  pin)
    log="$OUT/pin.log" run_dir="$TUTORIAL_HOME/pin" targets=${PIN_TARGETS:-triton-grpc,triton-http,direct}
    $PY -m utils.bench --targets "$targets" --concurrency "${PIN_LEVELS:-64}" --max-tokens 128 \
      --prompt-tokens 100 --duration "${PIN_DURATION:-6}" --repeats 5 --no-plots --out "$run_dir" > "$log" 2>&1 &
    bench=$!
    descendants() { local child; for child in $(pgrep -P "$1"); do echo "$child"; descendants "$child"; done; }
    placement() {  # every process of the run: the load generator, Triton, the stubs, the engine cores
      $PY scripts/cpu-placement.py "$window" 0.5 $(labelled $bench $(descendants $bench)) > "$OUT/pin-placement-$1.txt" 2>&1
    }
    window=$(( $(echo "$targets" | tr , ' ' | wc -w) * (${PIN_DURATION:-6} + 2) ))  # about one repeat: every target's run
    reached 1; placement before
    reached 3
    cores=$(pgrep -f '^VLLM::EngineCore' | tr '\n' ' ') held=""
    rest=$(( $(nproc) - $(echo $cores | wc -w) ))  # CPUs 0..rest-1 for the rest of the run, one above them per engine core
    if [ $rest -lt 1 ]; then
      echo "not held: $(nproc) CPUs for the engine cores $cores and the rest" | tee "$OUT/pin.txt"
    else
      for pid in $bench $(descendants $bench); do  # every thread of the run, the engine cores' other threads too, ...
        taskset -a -p -c "0-$(( rest - 1 ))" "$pid" > /dev/null 2>&1
      done
      cpu=$rest
      for core in $cores; do  # ... off the CPUs that hold one engine core's busy loop each (its main thread; held with its
        # process's 70-odd threads on 2026-12-06, it was preempted 2100 times a second by them and served 2-9 % less)
        taskset -p -c $cpu "$core" > /dev/null; held+="$cpu "; cpu=$(( cpu + 1 ))
      done
      echo "from repeat 3: the busy loops of engine cores $cores held on CPUs $held; the rest of the run on CPUs 0-$(( rest - 1 ))" | tee "$OUT/pin.txt"
    fi
    reached 4; placement after
    wait $bench
    $PY - "$run_dir/requests.csv" <<'PY' | tee -a "$OUT/pin.txt"
import sys
import pandas as pd
from utils.bench import read_records, repeat_throughput
records = read_records(sys.argv[1])
rows = [{"target": target, "concurrency": level, "repeat": repeat + 1, **repeat_throughput(group)}
        for (target, level, repeat), group in records.groupby(["target", "concurrency", "repeat"])]
table = pd.DataFrame(rows).pivot_table(index=["concurrency", "repeat"], columns="target", values="requests_per_s")
for target in [t for t in table.columns if t != "direct" and "direct" in table.columns]:
    table[f"{target} / direct"] = table[target] / table["direct"]
print(table.round(3).to_string())
PY
    ;;
  interfere)
    log="$OUT/interfere.log" run_dir="$TUTORIAL_HOME/interfere" busy=()
    $PY -m utils.bench --targets direct --concurrency "${INTERFERE_LEVEL:-1}" --max-tokens 128 --prompt-tokens 100 \
      --duration 6 --repeats 6 --no-plots --out "$run_dir" > "$log" 2>&1 &
    bench=$!
    load() {  # INTERFERE_N processes running CODE until stopped
      local n; for n in $(seq "${INTERFERE_N:-2}"); do $PY -c "$1" & busy+=($!); done
    }
    reached 3; load "while True: pass"
    reached 5; kill "${busy[@]}"; busy=()
    load "import numpy as np
a = np.ones(8 << 20); b = np.empty_like(a)  # 64 MiB each: more than a CPU's last-level cache
while True: np.copyto(b, a)"
    wait $bench
    kill "${busy[@]}"
    $PY - "$run_dir/requests.csv" <<'PY' | tee "$OUT/interfere.txt"
import sys
import pandas as pd
from utils.bench import read_records, repeat_throughput
records = read_records(sys.argv[1])
rows = []
for repeat, group in records.groupby("repeat"):
    run = group.iloc[0]
    rows.append({"repeat": repeat + 1, "others": ["none", "none", "spinning", "spinning", "copying", "copying"][repeat],
                 "requests_per_s": repeat_throughput(group)["requests_per_s"],
                 # each running request gains a token a step: its time in the engine over its tokens is the step
                 "engine_ms_per_step": (group["engine_inference_ms"] / group["output_tokens"]).mean(),
                 "cpu_machine": run["cpu_machine"]})
table = pd.DataFrame(rows)
table["of_alone"] = table["requests_per_s"] / table["requests_per_s"][table["others"] == "none"].mean()
print(table.round(3).to_string(index=False))
PY
    ;;
  frontend)
    model=$($PY -c "from utils.model import prepare_default_model; print(prepare_default_model(progress=False))")
    $PY scripts/frontend-bench.py "$model" 64 256 2>&1 | grep "streams," | tee "$OUT/frontend.txt"
    ;;
  *)
    echo "usage: $0 setup|bench|tests|notebooks|ab|coldstart|profile|pin|interfere|frontend" >&2; exit 2 ;;
esac
