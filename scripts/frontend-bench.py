"""What vLLM's front-end costs per engine step inside our backend's stub, side by side for the backend's choices.

    python scripts/frontend-bench.py MODEL_DIR [STREAMS ...]

Uses vLLM's own OutputProcessor (detokenizing, statistics, one response object per request, each merged into
the request's output collector) and vLLM's stat loggers on made-up engine outputs: one new token per stream
per step for 128 steps, streaming (DELTA) requests, the collectors drained every T steps as the backend's sender
takes them (T = the tokens per response the sender sent on an H200: 10 at 64 streams, 25 at 256). No engine and
no GPU: this is the event loop's share of each step, which a server's front-end pays and the engine does not wait
for. Variants, each run ROUNDS times, alternated (the median run is reported):

- ``vllm``: what AsyncLLM does by default (a response object per token per request; vLLM's Prometheus and
  logging stat loggers), as in vLLM's own server and in the backend before;
- ``no-prometheus``: without vLLM's Prometheus stat logger, whose registry in the stub nobody can scrape
  (Triton's metrics port serves the backend's own metrics);
- ``paced``: that, and response objects built every T/2 tokens per request (``turns.OutputPace``), not every token;
- ``settings-cached``: that, and vLLM's settings read from the environment once (``vllm.envs.enable_envs_cache``,
  as vLLM's engine core does), not at every use: its output path reads one for every token;
- ``text-at-send``: that, and no detokenizing on vLLM's output path (``detokenize=False``): the sender decodes
  each response's tokens as it takes them (``detokenize.SenderText``; its time is counted here).
"""

from __future__ import annotations

import importlib.util
import random
import statistics
import sys
import time
from pathlib import Path

STEPS = 128
VARIANTS = ("vllm", "no-prometheus", "paced", "settings-cached", "text-at-send")
SENDER_TOKENS_PER_RESPONSE = {64: 10, 256: 25}
ROUNDS = 5  # each variant run this many times, the variants alternated


def backend_detokenize():
    """The backend's own detokenize module (the backend is no package: Triton loads it from its folder)."""
    path = Path(__file__).resolve().parents[1] / "backend" / "vllm" / "detokenize.py"
    spec = importlib.util.spec_from_file_location("backend_detokenize", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_run(tokenizer, config, streams: int, variant: str, drain_every: int, detokenize) -> float:
    """Microseconds per step (mean over the steps, the last one's finishing work included), processing plus the
    stat loggers plus the sender's takes (and its decoding, where it decodes)."""
    import vllm.envs
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
    from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerManager
    from vllm.v1.metrics.stats import IterationStats, SchedulerStats

    level = VARIANTS.index(variant)
    if level >= VARIANTS.index("settings-cached"):
        vllm.envs.enable_envs_cache()
    else:
        vllm.envs.disable_envs_cache()
    sender_decodes = level >= VARIANTS.index("text-at-send")
    processor = OutputProcessor(tokenizer, log_stats=True)
    loggers = StatLoggerManager(config)
    if level >= VARIANTS.index("no-prometheus"):
        loggers.stat_loggers[:] = [s for s in loggers.stat_loggers if not isinstance(s, PrometheusStatLogger)]
    rng = random.Random(0)
    collectors, texts = {}, {}
    for index in range(streams):
        request_id = f"stream-{index}"
        params = SamplingParams(
            max_tokens=STEPS, ignore_eos=True, output_kind=RequestOutputKind.DELTA, detokenize=not sender_decodes
        )
        prompt = [rng.randrange(1000, 40000) for _ in range(100)]
        request = EngineCoreRequest(
            request_id, prompt, None, params, None, time.time(), None, None, None, external_req_id=request_id
        )
        collectors[request_id] = RequestOutputCollector(RequestOutputKind.DELTA, request_id)
        processor.add_request(request, None, queue=collectors[request_id])
        if level >= VARIANTS.index("paced"):
            processor.request_states[request_id].stream_interval = max(1, drain_every // 2)
        if sender_decodes:
            texts[request_id] = detokenize.SenderText(detokenize.rust_tokenizer(tokenizer), True, False)
    step_times = []
    for step in range(STEPS):
        last = step == STEPS - 1
        outputs = [
            EngineCoreOutput(request_id=r, new_token_ids=[rng.randrange(1000, 40000)], finish_reason=1 if last else None)
            for r in collectors
        ]
        started = time.perf_counter()
        stats = IterationStats()
        processor.process_outputs(outputs, time.monotonic(), stats)
        loggers.record(scheduler_stats=SchedulerStats(num_running_reqs=streams), iteration_stats=stats, engine_idx=0)
        if step % drain_every == 0 or last:
            for request_id, collector in collectors.items():
                if collector.output is not None:
                    output = collector.get_nowait()
                    if sender_decodes:
                        texts[request_id].next_text(output.prompt_token_ids, output.outputs[0].token_ids, stopped=False)
        step_times.append(time.perf_counter() - started)
    return statistics.mean(step_times) * 1e6


def main(argv: list[str]) -> None:
    from transformers import AutoTokenizer
    from vllm.engine.arg_utils import EngineArgs

    model, levels = argv[0], [int(n) for n in argv[1:]] or [64, 256]
    tokenizer = AutoTokenizer.from_pretrained(model)
    config = EngineArgs(model=model).create_engine_config()
    detokenize = backend_detokenize()
    for streams in levels:
        drain_every = SENDER_TOKENS_PER_RESPONSE.get(streams, 10)
        runs = {v: [] for v in VARIANTS}
        for _ in range(ROUNDS):
            for variant in VARIANTS:
                runs[variant].append(one_run(tokenizer, config, streams, variant, drain_every, detokenize))
        base, paced = statistics.median(runs["vllm"]), statistics.median(runs["paced"])
        for variant in VARIANTS:
            median = statistics.median(runs[variant])
            print(
                f"{streams:4d} streams, taken every {drain_every:2d} steps, {variant:15s}: {median:7.0f} us per step "
                f"({median / streams:5.2f} per token; runs {', '.join(f'{r:.0f}' for r in runs[variant])}), "
                f"{median / base:.2f} of vllm, {median / paced:.2f} of paced"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
