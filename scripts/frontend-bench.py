"""What vLLM's front-end costs per engine step inside our backend's stub, side by side for the backend's choices.

    python scripts/frontend-bench.py MODEL_DIR [STREAMS ...]

Uses vLLM's own OutputProcessor (detokenizing, statistics, one response object per request, each merged into
the request's output collector) and vLLM's stat loggers on made-up engine outputs: one new token per stream
per step for 128 steps, streaming (DELTA) requests, the collectors drained every T steps as the backend's sender
takes them (T = the tokens per response the sender sent on an H200: 10 at 64 streams, 25 at 256). No engine and
no GPU: this is the event loop's share of each step, which a server's front-end pays and the engine does not wait
for. Variants, each run twice, alternated:

- ``vllm``: what AsyncLLM does by default (a response object per token per request; vLLM's Prometheus and
  logging stat loggers), as in vLLM's own server and in the backend before;
- ``no-prometheus``: without vLLM's Prometheus stat logger, whose registry in the stub nobody can scrape
  (Triton's metrics port serves the backend's own metrics);
- ``paced``: that, and response objects built every T/2 tokens per request (``sending.OutputPace``), not every token.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

STEPS = 128
SENDER_TOKENS_PER_RESPONSE = {64: 10, 256: 25}


def one_run(tokenizer, config, streams: int, variant: str, drain_every: int) -> float:
    """Microseconds per step (mean over the steps, the last one's finishing work included), processing plus the
    stat loggers plus the sender's takes."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
    from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerManager
    from vllm.v1.metrics.stats import IterationStats, SchedulerStats

    processor = OutputProcessor(tokenizer, log_stats=True)
    loggers = StatLoggerManager(config)
    if variant != "vllm":
        loggers.stat_loggers[:] = [s for s in loggers.stat_loggers if not isinstance(s, PrometheusStatLogger)]
    rng = random.Random(0)
    collectors = {}
    for index in range(streams):
        request_id = f"stream-{index}"
        params = SamplingParams(max_tokens=STEPS, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        prompt = [rng.randrange(1000, 40000) for _ in range(100)]
        request = EngineCoreRequest(
            request_id, prompt, None, params, None, time.time(), None, None, None, external_req_id=request_id
        )
        collectors[request_id] = RequestOutputCollector(RequestOutputKind.DELTA, request_id)
        processor.add_request(request, None, queue=collectors[request_id])
        if variant == "paced":
            processor.request_states[request_id].stream_interval = max(1, drain_every // 2)
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
            for collector in collectors.values():
                if collector.output is not None:
                    collector.get_nowait()
        step_times.append(time.perf_counter() - started)
    return statistics.mean(step_times) * 1e6


def main(argv: list[str]) -> None:
    from transformers import AutoTokenizer
    from vllm.engine.arg_utils import EngineArgs

    model, levels = argv[0], [int(n) for n in argv[1:]] or [64, 256]
    tokenizer = AutoTokenizer.from_pretrained(model)
    config = EngineArgs(model=model).create_engine_config()
    variants = ("vllm", "no-prometheus", "paced")
    for streams in levels:
        drain_every = SENDER_TOKENS_PER_RESPONSE.get(streams, 10)
        runs = {v: [] for v in variants}
        for _ in range(2):
            for variant in variants:
                runs[variant].append(one_run(tokenizer, config, streams, variant, drain_every))
        base = statistics.mean(runs["vllm"])
        for variant in variants:
            mean = statistics.mean(runs[variant])
            print(
                f"{streams:4d} streams, taken every {drain_every:2d} steps, {variant:14s}: {mean:7.0f} us per step "
                f"({mean / streams:5.2f} per token; runs {', '.join(f'{r:.0f}' for r in runs[variant])}), "
                f"{mean / base:.2f} of vllm"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
