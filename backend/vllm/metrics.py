"""vLLM's engine statistics as Triton custom metrics (served on Triton's metrics port, 8002 by default).

vLLM calls ``record`` on its output loop once per engine step. Every Triton metric update is an IPC round
trip from the stub to the server, so updates are never made there: ``record`` only adds to in-process
totals (a few additions), and a flusher thread publishes them once per ``FLUSH_S``. Histograms are per
request (time to first token, mean time per output token, end to end, and the engine's share of it: waiting
in its queue, and from scheduling to the last token), and per engine step its tokens (``utils.bench`` counts
the steps that carried a prefill from it), observed by the flusher. vLLM measures end to end from
``add_request`` to the last output processed on the event loop, the other two in the engine's process, so
the difference is the time a request spends between the event loop and the engine (``utils.bench``).
"""

from __future__ import annotations

import threading
from collections import deque

import triton_python_backend_utils as pb_utils
from vllm.v1.metrics.loggers import StatLoggerBase

FLUSH_S = 1.0
LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
STEP_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]  # vLLM's own


def step_tokens(iteration_stats) -> int:
    """The tokens an engine step computed, as vLLM's own ``vllm:iteration_tokens_total`` counts them: the prompt
    tokens it prefilled (``prompt_token_stats.computed``; ``num_prompt_tokens`` in vLLMs without it) and the
    tokens it generated. A step with a prefill in it is larger than its batch's decode tokens alone."""
    prompt = getattr(iteration_stats, "prompt_token_stats", None)
    prefilled = prompt.computed if prompt is not None else iteration_stats.num_prompt_tokens
    return prefilled + iteration_stats.num_generation_tokens


class TritonStatLogger(StatLoggerBase):
    """A vLLM stat logger whose sink is Triton's Prometheus endpoint, labelled by model and version."""

    def __init__(self, labels: dict[str, str], vllm_config=None, engine_index: int = 0):
        self.labels = dict(labels)
        self._families = []  # a MetricFamily must outlive its Metric objects
        family = pb_utils.MetricFamily
        self._counters = {
            "prompt": self._metric("vllm:prompt_tokens_total", "Prompt tokens processed", family.COUNTER),
            "generation": self._metric("vllm:generation_tokens_total", "Tokens generated", family.COUNTER),
            "finished": self._metric("vllm:request_success_total", "Requests finished", family.COUNTER),
        }
        self._gauges = {
            "running": self._metric("vllm:num_requests_running", "Requests running on the engine", family.GAUGE),
            "waiting": self._metric("vllm:num_requests_waiting", "Requests waiting to be scheduled", family.GAUGE),
            "kv_cache": self._metric("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full)", family.GAUGE),
        }
        latency, histogram = LATENCY_BUCKETS, family.HISTOGRAM
        self._histograms = {
            "ttft": self._metric("vllm:time_to_first_token_seconds", "Time to first token, per request", histogram, latency),
            "tpot": self._metric("vllm:time_per_output_token_seconds", "Mean time per output token, per request", histogram, latency),
            "e2e": self._metric("vllm:e2e_request_latency_seconds", "End-to-end request latency", histogram, latency),
            "queue": self._metric("vllm:request_queue_time_seconds", "Time a request waited in the engine's queue", histogram, latency),
            "inference": self._metric(
                "vllm:request_inference_time_seconds", "Time from a request's scheduling to its last token", histogram, latency
            ),
            "step_tokens": self._metric(
                "vllm:iteration_tokens_total", "Tokens per engine step (prompt and generated)", histogram, STEP_TOKEN_BUCKETS
            ),
        }
        self._lock = threading.Lock()
        self._totals = dict.fromkeys(self._counters, 0)
        self._levels: dict[str, float] = {}
        self._observations: deque[tuple[str, float]] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flush_forever, name="vllm-metrics", daemon=True)
        self._thread.start()

    def _metric(self, name: str, description: str, kind, buckets: list | None = None):
        metric_family = pb_utils.MetricFamily(name=name, description=description, kind=kind)
        self._families.append(metric_family)
        if buckets is not None:
            return metric_family.Metric(labels=self.labels, buckets=buckets)
        return metric_family.Metric(labels=self.labels)

    # vLLM's interface ---------------------------------------------------------------------------
    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        with self._lock:
            if scheduler_stats is not None:
                self._levels["running"] = scheduler_stats.num_running_reqs
                self._levels["waiting"] = scheduler_stats.num_waiting_reqs
                self._levels["kv_cache"] = scheduler_stats.kv_cache_usage
            if iteration_stats is not None:
                self._totals["prompt"] += iteration_stats.num_prompt_tokens
                self._totals["generation"] += iteration_stats.num_generation_tokens
                self._observations.append(("step_tokens", step_tokens(iteration_stats)))
                self._observations.extend(("ttft", t) for t in iteration_stats.time_to_first_tokens_iter)
                for finished in iteration_stats.finished_requests:
                    self._totals["finished"] += 1
                    self._observations.append(("e2e", finished.e2e_latency))
                    self._observations.append(("queue", finished.queued_time))
                    self._observations.append(("inference", finished.inference_time))
                    if finished.num_generation_tokens > 1:
                        self._observations.append(("tpot", finished.mean_time_per_output_token))

    def log_engine_initialized(self):
        pass

    # the flusher --------------------------------------------------------------------------------
    def _flush_forever(self) -> None:
        while not self._stop.wait(FLUSH_S):
            self.flush()

    def flush(self) -> None:
        with self._lock:
            totals, self._totals = self._totals, dict.fromkeys(self._counters, 0)
            levels = dict(self._levels)
            observations, self._observations = self._observations, deque()
        for key, amount in totals.items():
            if amount:
                self._counters[key].increment(amount)
        for key, level in levels.items():
            self._gauges[key].set(level)
        for key, value in observations:
            self._histograms[key].observe(value)

    def close(self) -> None:
        """Publish the last totals, then drop every Metric before its MetricFamily (Triton requires that
        order, and doing it here, while the stub still talks to the server, avoids a crash at exit)."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.flush()
        for metrics in (self._counters, self._gauges, self._histograms):
            metrics.clear()
        self._families.clear()
