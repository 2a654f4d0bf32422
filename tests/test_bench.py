"""utils.bench and utils.plots: the statistics on made-up timings, the load generator's bookkeeping, and
tiny real sweeps of every target (Triton through the session server; vLLM's server and the direct engine
started by the benchmark itself). Timings on this shared 2-core machine are noise: the sweeps assert
counts and correctness, never speed."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import pytest

from utils import bench, paths, plots
from utils.repository import device_engine_defaults, has_gpu
from utils.server import http_ready


# ---- per-token inter-token latency ---------------------------------------------------------------------------
def test_itl_one_token_per_chunk_is_the_gap_between_chunks():
    assert bench.itl_samples([0.30, 0.35, 0.45], [1, 1, 1]) == pytest.approx([0.05, 0.10])


def test_itl_chunk_of_k_tokens_gives_k_samples_of_dt_over_k():
    assert bench.itl_samples([0.2, 0.5], [1, 3]) == pytest.approx([0.1, 0.1, 0.1])


def test_itl_first_chunk_tokens_are_covered_by_ttft():
    assert bench.itl_samples([0.2, 0.3], [2, 1]) == pytest.approx([0.1])
    assert bench.itl_samples([0.2], [5]) == []


def test_itl_chunks_without_tokens_are_skipped():
    assert bench.itl_samples([0.1, 0.2, 0.4], [1, 0, 2]) == pytest.approx([0.15, 0.15])


def test_itl_samples_add_up_to_the_decode_time_one_per_later_token():
    rng = np.random.default_rng(3)
    offsets = np.cumsum(rng.uniform(0.01, 0.2, size=40)).tolist()
    tokens = rng.integers(1, 5, size=40).tolist()
    samples = bench.itl_samples(offsets, tokens)
    assert len(samples) == sum(tokens) - tokens[0]
    assert sum(samples) == pytest.approx(offsets[-1] - offsets[0])


# ---- percentiles and schedules ----------------------------------------------------------------------------------
def test_percentile_ms_is_numpys_in_milliseconds():
    values = [0.010, 0.020, 0.030, 0.100]
    assert bench.percentile_ms(values, 50) == pytest.approx(np.percentile(values, 50) * 1000)
    assert bench.percentile_ms(values, 99) == pytest.approx(97.9)
    assert np.isnan(bench.percentile_ms([], 50))


def test_poisson_arrivals_are_increasing_reproducible_and_exponentially_spaced():
    arrivals = bench.poisson_arrivals(8.0, 20_000, seed=1)
    gaps = np.diff(np.r_[0.0, arrivals])
    assert len(arrivals) == 20_000 and (gaps > 0).all()
    assert np.array_equal(arrivals, bench.poisson_arrivals(8.0, 20_000, seed=1))
    assert not np.array_equal(arrivals, bench.poisson_arrivals(8.0, 20_000, seed=2))
    assert gaps.mean() == pytest.approx(1 / 8, rel=0.03)  # mean gap 1/rate
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: std equals mean
    with pytest.raises(ValueError, match="positive"):
        bench.poisson_arrivals(0, 3)


# ---- aggregation into rows ----------------------------------------------------------------------------------------
def _stream(index, start, offsets, tokens, error="", worker=0):
    stream = bench.Stream(index=index, worker=worker, start=start, offsets=list(offsets), tokens=list(tokens), error=error)
    stream.end = start + (offsets[-1] if offsets else 0.5)
    return stream


def _level_records(repeat, streams, concurrency=2):
    level = {"target": "t", "mode": "closed", "concurrency": concurrency, "request_rate": float("nan"), "repeat": repeat, "workers": 1}
    return bench.records_frame(streams, level)


def made_up_records() -> pd.DataFrame:
    """Two repeats of one level: repeat 0 spans 2 s with 2 good requests; repeat 1 spans 1 s with 1 good and 1 failed."""
    first = _level_records(0, [_stream(0, 100.0, [0.1, 0.2, 0.4], [1, 1, 2]), _stream(1, 100.5, [0.3, 1.5], [1, 3])])
    second = _level_records(1, [_stream(2, 200.0, [0.2, 1.0], [2, 2]), _stream(3, 200.2, [], [], error="boom")])
    return pd.concat([first, second], ignore_index=True)


def test_records_frame_times_in_ms_from_the_levels_first_send():
    records = made_up_records()
    assert records["start_s"].tolist() == pytest.approx([0.0, 0.5, 0.0, 0.2])
    assert records["ttft_ms"].iloc[0] == pytest.approx(100.0)
    assert records["e2e_ms"].iloc[1] == pytest.approx(1500.0)
    assert records["output_tokens"].tolist() == [4, 4, 4, 0]
    assert records["chunk_offsets_ms"].iloc[1] == pytest.approx([300.0, 1500.0])


def test_summary_row_rates_percentiles_and_spread():
    row = bench.summarize(made_up_records()).iloc[0]
    assert row["requests"] == 3 and row["errors"] == 1 and row["repeats"] == 2
    # repeat 0: 2 requests in 2.0 s (100.0 -> 102.0); repeat 1: 1 in 1.0 s (200.0 -> 201.0)
    assert row["duration_s"] == pytest.approx(3.0)
    assert row["requests_per_s"] == pytest.approx(3 / 3.0)
    assert row["output_tokens_per_s"] == pytest.approx(12 / 3.0)
    assert row["requests_per_s_min"] == pytest.approx(1.0) and row["requests_per_s_max"] == pytest.approx(1.0)
    assert row["requests_per_s_std"] == pytest.approx(0.0)
    assert row["ttft_p50_ms"] == pytest.approx(200.0)  # 100, 200, 300 ms: the failed request is left out
    assert row["e2e_p99_ms"] == pytest.approx(np.percentile([400, 1500, 1000], 99))
    # per-token ITL: [100, 100, 100] from request 0, [400]*3 from request 1, [400, 400] from request 2
    itl = [100, 100, 100, 400, 400, 400, 400, 400]
    assert row["itl_p50_ms"] == pytest.approx(np.percentile(itl, 50))
    assert row["itl_p99_ms"] == pytest.approx(np.percentile(itl, 99))
    assert row["tokens_per_response"] == pytest.approx(12 / 7)  # 12 tokens in 3 + 2 + 2 responses


def test_a_stream_sent_at_once_shows_in_tokens_per_response():
    """A server that holds a stream back and sends it whole: one response of 8 tokens, and no ITL sample."""
    held_back = _level_records(0, [_stream(0, 0.0, [0.8], [8]), _stream(1, 0.1, [0.9], [8])])
    row = bench.summarize(held_back).iloc[0]
    assert row["tokens_per_response"] == pytest.approx(8.0) and math.isnan(row["itl_p50_ms"])


def _sends(starts, mode="closed", concurrency=2, repeat=0):
    return pd.DataFrame({"start_s": starts, "mode": mode, "concurrency": concurrency, "repeat": repeat})


def test_arrival_gap_cv_tells_waves_from_even_sends_and_leaves_out_the_closed_loops_first_sends():
    even = [0.0, 0.0, 0.1, 0.2, 0.3, 0.4, 0.5]  # two clients start at once, then one send every 100 ms
    assert bench.arrival_gap_cv(_sends(even)) == pytest.approx(0.0)
    waves = [0.0, 0.0, 0.3, 0.3, 0.3, 0.6, 0.6, 0.6]  # three sends together every 300 ms
    gaps = np.diff(waves[2:])
    assert bench.arrival_gap_cv(_sends(waves, concurrency=2)) == pytest.approx(gaps.std() / gaps.mean())
    assert bench.arrival_gap_cv(_sends(waves, concurrency=2)) > 1.0
    assert bench.arrival_gap_cv(_sends(bench.poisson_arrivals(50.0, 5000, seed=3), mode="open")) == pytest.approx(1.0, rel=0.05)
    assert math.isnan(bench.arrival_gap_cv(_sends([0.0, 0.0, 0.1])))  # one gap: nothing to measure


def test_summary_averages_the_arrival_gap_cv_over_repeats():
    records = pd.concat([_sends([0.0, 0.0, 0.1, 0.2, 0.3]), _sends([0.0, 0.0, 0.1, 0.1, 0.4], repeat=1)])
    records = records.assign(target="t", request_rate=float("nan"), workers=1, e2e_ms=100.0, error="",
                             output_tokens=4, ttft_ms=10.0, chunks=4, chunk_offsets_ms=[[10.0]] * 10,
                             chunk_tokens=[[4]] * 10)
    second = np.diff([0.1, 0.1, 0.4])
    expected = (0.0 + second.std() / second.mean()) / 2
    assert bench.summarize(records).iloc[0]["arrival_gap_cv"] == pytest.approx(expected)


def test_summary_starts_with_exactly_the_agreed_columns():
    summary = bench.summarize(made_up_records())
    assert list(summary.columns[: len(bench.SUMMARY_COLUMNS)]) == bench.SUMMARY_COLUMNS
    assert bench.SUMMARY_COLUMNS == [
        "target", "concurrency", "request_rate", "requests", "duration_s", "requests_per_s", "output_tokens_per_s",
        "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms",
    ]  # fmt: skip


def test_requests_csv_round_trip_gives_the_same_summary(tmp_path):
    records = made_up_records()
    path = bench.write_records(records, tmp_path / "requests.csv")
    again = bench.read_records(path)
    assert again["chunk_tokens"].tolist() == records["chunk_tokens"].tolist()
    pd.testing.assert_frame_equal(bench.summarize(again), bench.summarize(records), check_dtype=False)


def test_runs_saved_one_by_one_come_back_in_the_finished_benchmarks_order(tmp_path):
    """Two targets, two levels, two repeats, measured side by side (the order rotated at each repeat) and saved as
    they were measured: read back by target, level and repeat, as requests.csv holds them, with the same summary."""
    runs = {}
    for run_order, (position, number, repeat) in enumerate(bench.side_by_side_order(2, bench.Plan((bench.Level(1), bench.Level(16)), repeats=2))):
        run = made_up_records().query(f"repeat == {repeat}").assign(
            target=["a", "b"][position], concurrency=[1, 16][number], run_order=run_order
        )
        bench.save_run(run, tmp_path)
        runs[(position, number, repeat)] = run
    finished = pd.concat([runs[key] for key in sorted(runs)], ignore_index=True)
    saved = bench.saved_records(tmp_path)
    assert saved[["target", "concurrency", "repeat"]].drop_duplicates().values.tolist() == [
        ["a", 1, 0], ["a", 1, 1], ["a", 16, 0], ["a", 16, 1], ["b", 1, 0], ["b", 1, 1], ["b", 16, 0], ["b", 16, 1],
    ]  # fmt: skip
    pd.testing.assert_frame_equal(bench.summarize(saved), bench.summarize(finished), check_dtype=False)
    assert not list(tmp_path.glob("measured/.*"))  # each file written beside and renamed into place
    with pytest.raises(ValueError, match="holds no benchmark's requests"):
        bench.saved_records(tmp_path / "empty")
    with pytest.raises(ValueError, match="no environment.json"):
        bench.summarize_folder(tmp_path)



# ---- ratios, and the runs of record ------------------------------------------------------------------------------
def test_relative_to_divides_each_target_by_the_reference_at_its_concurrency():
    summary = pd.DataFrame({
        "target": ["a", "ref", "a", "ref", "a", "ref"],
        "concurrency": [1, 1, 16, 16, None, None],  # the open-loop rows have no concurrency: left out
        "request_rate": [None, None, None, None, 8.0, 8.0],
        "requests_per_s": [3.0, 4.0, 50.0, 40.0, 7.0, 1.0],
        "ttft_p50_ms": [10.0, 5.0, 20.0, 40.0, 1.0, 1.0],
    })  # fmt: skip
    ratios = bench.relative_to(summary, "ref")
    assert list(ratios.columns) == ["a"] and list(ratios.index) == [1, 16]
    assert ratios["a"].tolist() == pytest.approx([0.75, 1.25])
    assert bench.relative_to(summary, "ref", "ttft_p50_ms")["a"].tolist() == pytest.approx([2.0, 0.5])


def test_relative_to_a_target_not_measured_names_those_that_were():
    summary = pd.DataFrame({"target": ["a", "b"], "concurrency": [1, 1], "requests_per_s": [1.0, 2.0]})
    with pytest.raises(ValueError, match=r"'vllm-openai' was not measured; the targets are a, b"):
        bench.relative_to(summary, "vllm-openai")


@pytest.mark.parametrize("gpu, name", [("h200", "H200"), ("h100", "H100")])
def test_a_run_of_record_holds_every_target_at_every_level_with_the_agreed_columns(gpu, name):
    summary, environment = bench.recorded_run(gpu)
    assert name in environment["gpu_name"] and environment["versions"]["vllm"] == "0.26.0"
    assert list(summary.columns[: len(bench.SUMMARY_COLUMNS)]) == bench.SUMMARY_COLUMNS
    levels = summary.groupby("target")["concurrency"].apply(sorted).to_dict()
    assert set(bench.TARGETS) <= set(levels) <= set(bench.TARGETS + bench.EXTRA_TARGETS)
    assert all(measured == [1, 16, 64, 256] for measured in levels.values())
    assert (summary["errors"] == 0).all() and (summary["requests"] > 0).all()
    assert (bench.relative_to(summary, "direct") > 0).all().all()


def test_a_gpu_without_a_run_of_record_is_named_with_those_recorded():
    with pytest.raises(ValueError, match=r"no recorded run for 'a100'; recorded: h100, h200"):
        bench.recorded_run("a100")

# ---- splitting a level over workers --------------------------------------------------------------------------------
ENDPOINT = bench.Endpoint("triton-grpc", "127.0.0.1:1")


def test_server_time_columns_are_mean_ms_per_request_between_readings():
    before = {"queue.count": 10, "queue.ns": 5_000_000, "compute_infer.count": 10, "compute_infer.ns": 1_000_000}
    after = {"queue.count": 14, "queue.ns": 25_000_000, "compute_infer.count": 14, "compute_infer.ns": 3_000_000}
    assert bench.server_time_columns(before, after) == {"server_queue_ms": 5.0, "server_execute_ms": 0.5}
    assert math.isnan(bench.server_time_columns(before, before)["server_queue_ms"])  # no request: no mean
    assert bench.server_time_columns(None, None) == {}  # not a Triton target


def test_cpu_columns_are_cores_per_role_between_readings():
    before = bench.CpuReading(
        at=10.0, machine_busy_s=100.0, processes={1: ("load", 1.0), 2: ("load", 2.0), 3: ("engine", 5.0)}, machine_steal_s=3.0
    )
    after = bench.CpuReading(
        at=12.0, machine_busy_s=112.0,
        processes={1: ("load", 2.5), 2: ("load", 2.2), 3: ("engine", 7.0), 4: ("frontend", 0.8), 5: ("frontend", 0.2)},
        machine_steal_s=4.0,
    )  # fmt: skip
    columns = bench.cpu_columns(before, after)
    assert columns["cpu_machine"] == pytest.approx(6.0)  # 12 CPU seconds in 2 s
    assert columns["cpu_steal"] == pytest.approx(0.5)  # the host took 1 CPU second of the guest's in 2 s
    assert columns["cpu_load_busiest"] == pytest.approx(0.75)  # worker 1: 1.5 s of 2, not the sum of the workers
    assert columns["cpu_engine"] == pytest.approx(1.0)
    assert columns["cpu_frontend"] == pytest.approx(0.5)  # processes born during the level count from zero
    assert math.isnan(columns["cpu_server"])  # no Triton in this level


RUNNING_PAGE = """# HELP vllm:num_requests_running Requests running on the engine
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{instance="vllm_model_0",model="vllm_model",version="1"} 5
vllm:num_requests_running{instance="vllm_model_1",model="vllm_model",version="1"} 7
vllm:num_requests_running{instance="other_0",model="other",version="1"} 100
# HELP vllm:num_requests_waiting Requests waiting to be scheduled
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{instance="vllm_model_0",model="vllm_model",version="1"} 3
"""


def test_running_requests_sum_the_measured_models_engines_only():
    assert bench.running_requests(RUNNING_PAGE, "vllm_model") == 12  # two instances of it, not the other model
    vllm_page = 'vllm:num_requests_running{engine="0",model_name="/models/m"} 3.0\n'  # vLLM labels by model_name
    assert bench.running_requests(vllm_page, "vllm_model") == 3
    assert bench.running_requests("# metrics switched off\n", "vllm_model") is None


def test_running_sampler_averages_only_the_samples_taken_in_flight():
    sampler = bench.RunningSampler(None, "vllm_model")
    sampler.samples = [(0.5, 100.0), (1.0, 2.0), (2.0, 4.0), (3.5, 100.0)]
    assert sampler.mean_between(1.0, 3.0) == pytest.approx(3.0)
    assert math.isnan(sampler.mean_between(5.0, 6.0))


def test_engine_step_time_is_running_requests_over_token_rate():
    # 64 requests running, 16,000 tokens/s: 250 steps/s of one token each, 4 ms per step
    assert bench.engine_columns(64.0, 16000.0) == {"engine_running_mean": 64.0, "engine_step_ms": pytest.approx(4.0)}
    assert math.isnan(bench.engine_columns(1.0, 0.0)["engine_step_ms"])


def test_closed_loop_shares_split_clients_evenly_and_requests_in_proportion():
    requests = [(i, f"p{i}") for i in range(10)]
    shares = bench.plan_shares(ENDPOINT, requests, 2, max_tokens=8, start_at=0.0, concurrency=5)
    assert [s.concurrency for s in shares] == [3, 2]
    assert [len(s.requests) for s in shares] == [6, 4]
    assert sorted(r for s in shares for r in s.requests) == requests
    assert len(bench.plan_shares(ENDPOINT, requests, 8, max_tokens=8, start_at=0.0, concurrency=3)) == 3


def test_open_loop_shares_together_send_the_global_schedule():
    requests = [(i, f"p{i}") for i in range(7)]
    arrivals = bench.poisson_arrivals(4.0, 7, seed=0)
    shares = bench.plan_shares(ENDPOINT, requests, 3, max_tokens=8, start_at=0.0, arrivals=arrivals)
    sent = sorted((a, r) for s in shares for a, r in zip(s.arrivals, s.requests))
    assert [a for a, _ in sent] == pytest.approx(arrivals.tolist())
    assert [r for _, r in sent] == requests
    with pytest.raises(ValueError, match="either"):
        bench.plan_shares(ENDPOINT, requests, 1, max_tokens=8, start_at=0.0)


def test_rotated_puts_each_repeats_first_target_in_turn():
    assert [bench.rotated("abc", repeat) for repeat in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert bench.rotated([], 3) == []


def test_worker_counts():
    assert bench.auto_workers(1, cpus=16) == 1
    assert bench.auto_workers(256, cpus=16) == 8
    assert bench.auto_workers(256, cpus=2) == 1
    plan = bench.Plan(levels=(bench.Level(concurrency=2),), workers=4)
    assert plan.workers_for(bench.Level(concurrency=2), "triton-grpc") == 2  # never more than the clients
    assert plan.workers_for(bench.Level(concurrency=64), "direct") == 1  # the engine lives in the worker
    assert plan.workers_for(bench.Level(request_rate=8.0), "vllm-openai") == 4


# ---- the load generator on a stand-in for a server ------------------------------------------------------------------
async def fake_send(prompt: str, stream: bench.Stream, *, in_flight: list[int], peak: list[int]) -> None:
    """Stands in for a server: 3 chunks of 2 tokens, 10 ms apart, counting requests in flight."""
    in_flight[0] += 1
    peak[0] = max(peak[0], in_flight[0])
    for _ in range(3):
        await asyncio.sleep(0.01)
        stream.arrived(2)
    in_flight[0] -= 1


def test_closed_loop_never_exceeds_its_clients_and_sends_every_request():
    in_flight, peak, reported = [0], [0], []
    send = lambda p, s: fake_send(p, s, in_flight=in_flight, peak=peak)  # noqa: E731
    share = bench.Share(ENDPOINT, [(i, "x") for i in range(9)], max_tokens=6, start_at=time.monotonic(), concurrency=3)
    streams = asyncio.run(bench.run_closed_loop(send, share, worker=0, report=lambda: reported.append(1)))
    assert sorted(s.index for s in streams) == list(range(9))
    assert peak[0] == 3 and len(reported) == 9
    assert all(sum(s.tokens) == 6 and s.error == "" for s in streams)


def test_open_loop_sends_no_request_before_its_time():
    in_flight, peak = [0], [0]
    send = lambda p, s: fake_send(p, s, in_flight=in_flight, peak=peak)  # noqa: E731
    start = time.monotonic() + 0.05
    share = bench.Share(ENDPOINT, [(i, "x") for i in range(4)], max_tokens=6, start_at=start, arrivals=[0.0, 0.01, 0.02, 0.2])
    streams = asyncio.run(bench.run_open_loop(send, share, worker=0, report=lambda: None))
    assert all(s.start >= s.scheduled for s in streams)
    assert [s.scheduled - start for s in streams] == pytest.approx([0.0, 0.01, 0.02, 0.2])
    assert peak[0] >= 2  # arrivals 10 ms apart overlap requests of 30 ms: not a closed loop


def test_failures_and_timeouts_become_records_not_exceptions():
    async def fails(prompt, stream):
        raise bench.BenchmarkError("Triton: unknown sampling parameter")

    async def hangs(prompt, stream):
        await asyncio.sleep(10)

    failed = asyncio.run(bench.timed_request(fails, 1, "x", timeout_s=5, worker=0))
    late = asyncio.run(bench.timed_request(hangs, 2, "x", timeout_s=0.05, worker=0))
    assert "unknown sampling parameter" in failed.error
    assert late.error == "timed out after 0.05 s" and late.end - late.start < 1


# ---- prompts and engine settings ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return bench.load_tokenizer(bench.engine_settings(log=lambda _m: None)["model"])


@pytest.mark.parametrize("tokens", [1, 7, 100, 300])
def test_prompts_have_exactly_the_asked_tokens_and_distinct_prefixes(tokenizer, tokens):
    prompts = [bench.synthesize_prompt(tokenizer, i, tokens) for i in range(12)]
    assert all(len(tokenizer.encode(p, add_special_tokens=False)) == tokens for p in prompts)
    assert prompts == [bench.synthesize_prompt(tokenizer, i, tokens) for i in range(12)]
    if tokens > 1:
        assert len({tokenizer.encode(p, add_special_tokens=False)[0] for p in prompts[:10]}) == 10


def same_setting(parsed, wanted) -> bool:
    """vLLM's parser turns dicts into config objects, enums into members and some numbers into strings."""
    if isinstance(wanted, dict):
        return all(same_setting(parsed[k] if isinstance(parsed, dict) else getattr(parsed, k), v) for k, v in wanted.items())
    if isinstance(wanted, str) and hasattr(parsed, "name"):
        return parsed.name == wanted
    return parsed == wanted or str(parsed) == str(wanted)


def test_environment_records_the_vllm_variables_the_engines_get(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # a caller's choice: the V1 model runner
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    recorded = bench.environment_info({"model": "m"}, {})["engine_variables"]
    assert recorded["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert recorded["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"  # ours, by default
    assert "VLLM_CACHE_ROOT" not in recorded and all(k.startswith("VLLM_") for k in recorded)


def test_engine_cli_flags_parse_back_into_the_same_engine_args():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    settings = {**bench.engine_settings(log=lambda _m: None), "enable_prefix_caching": False, "max_num_batched_tokens": 4096}
    args = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(bench.engine_cli_flags(settings))
    parsed = AsyncEngineArgs.from_cli_args(args)
    for key, wanted in settings.items():
        assert same_setting(getattr(parsed, key), wanted), (key, getattr(parsed, key), wanted)
    assert "--no-enable-prefix-caching" in bench.engine_cli_flags(settings)


def test_cli_lists_and_defaults():
    args = bench.parse_args(["--targets", "triton-grpc,direct", "--concurrency", "", "--request-rate", "2,8"])
    assert args.targets == ["triton-grpc", "direct"] and args.concurrency == [] and args.request_rate == [2.0, 8.0]
    assert bench.parse_args([]).concurrency == [1, 16, 64, 256]
    with pytest.raises(SystemExit):
        bench.parse_args(["--concurrency", "1,many"])
    with pytest.raises(ValueError, match="unknown target"):
        bench.group_targets(["triton-grpc", "tgi"])
    assert bench.group_targets(["triton-grpc", "direct", "triton-http"]) == {
        "triton": ["triton-grpc", "triton-http"],
        "direct": ["direct"],
    }


def test_several_instance_counts_get_a_triton_each(tmp_path):
    """--triton-instances 1,2: one Triton per count (this tree's backend), per backend with --triton-backends."""
    ours = paths.backend_source()
    assert bench.triton_variants({}, (1,)) == {}
    assert bench.triton_variants({}, (1, 2)) == {"x1": (ours, 1), "x2": (ours, 2)}
    assert bench.triton_variants({"new": tmp_path}, (2,)) == {"new": (tmp_path, 2)}
    assert bench.triton_variants({"new": tmp_path}, (1, 4)) == {"new-x1": (tmp_path, 1), "new-x4": (tmp_path, 4)}
    with pytest.raises(ValueError, match="at least 1"):
        bench.triton_variants({}, (1, 0))
    assert bench.parse_args(["--triton-instances", "1,2"]).triton_instances == [1, 2]
    assert bench.group_targets(["triton-grpc", "direct"], ("x1", "x2")) == {
        "triton@x1": ["triton-grpc"], "triton@x2": ["triton-grpc"], "direct": ["direct"],
    }


# ---- plots ----------------------------------------------------------------------------------------------------------
def made_up_summary() -> pd.DataFrame:
    rows = []
    for target, scale in (("triton-grpc", 1.0), ("direct", 1.3)):
        for concurrency in (1, 16, 64):
            rows.append(
                {"target": target, "concurrency": concurrency, "request_rate": float("nan"), "requests_per_s": scale * concurrency,
                 "output_tokens_per_s": 128 * scale * concurrency, "requests_per_s_std": 0.1, "output_tokens_per_s_std": 5.0,
                 **{f"{m}_p{q}_ms": q * concurrency / scale for m in ("ttft", "itl", "e2e") for q in (50, 99)}}
            )  # fmt: skip
    return pd.DataFrame(rows)


def test_plots_draw_one_line_per_target_and_percentile(tmp_path):
    summary = made_up_summary()
    figure = plots.plot_latency(summary, "itl", path=tmp_path / "itl.png")
    assert len(figure.axes[0].lines) == 4  # 2 targets x (p50, p99)
    assert (tmp_path / "itl.png").stat().st_size > 1000
    throughput = plots.plot_throughput(summary)
    assert [a.get_title() for a in throughput.axes] == ["requests per second", "output tokens per second"]
    with pytest.raises(ValueError, match="metric"):
        plots.plot_latency(summary, "tpot")
    with pytest.raises(ValueError, match="request_rate"):
        plots.plot_throughput(summary, x="request_rate")


def test_time_split_stacks_the_parts_of_each_levels_end_to_end(tmp_path):
    summary = made_up_summary()
    parts = {"engine_queue_ms": 5.0, "engine_inference_ms": 300.0, "vllm_frontend_ms": 20.0, "outside_vllm_ms": -2.0}
    with pytest.raises(ValueError, match="engine_queue_ms"):
        plots.plot_time_split(summary)
    figure = plots.plot_time_split(summary.assign(**parts), path=tmp_path / "split.png")
    bars = figure.axes[0].patches
    assert len(bars) == 4 * len(summary)  # a bar per part per level
    widths = [bar.get_width() for bar in bars]
    assert widths[: len(summary)] == [5.0] * len(summary) and widths[-len(summary):] == [0.0] * len(summary)
    ends = [bar.get_x() + bar.get_width() for bar in bars[2 * len(summary) : 3 * len(summary)]]
    assert ends == [325.0] * len(summary)  # stacked: queue, inference, then the front-end's share
    assert (tmp_path / "split.png").stat().st_size > 1000


def test_cdf_goes_from_zero_to_one_per_target(tmp_path):
    records = made_up_records()
    figure = plots.plot_latency_cdf(records, "e2e_ms", path=tmp_path / "cdf.png")
    (line,) = figure.axes[0].lines
    assert line.get_ydata()[0] == 0 and line.get_ydata()[-1] == 1
    assert sorted(line.get_xdata()[1:]) == pytest.approx([400.0, 1000.0, 1500.0])  # the failed request is left out
    assert (tmp_path / "cdf.png").exists()


# ---- real sweeps ---------------------------------------------------------------------------------------------------------
def check_outputs(out, summary, targets, levels, max_tokens, requests, repeats):
    """What every sweep must have written: the agreed columns, every request complete, environment, plots."""
    records = bench.read_records(out / "requests.csv")
    failed = records.loc[records["error"] != "", ["target", "mode", "error"]]
    assert failed.empty, failed.drop_duplicates().to_string()
    assert len(records) == len(targets) * levels * requests * repeats
    written = pd.read_csv(out / "summary.csv")
    assert list(written.columns[: len(bench.SUMMARY_COLUMNS)]) == bench.SUMMARY_COLUMNS
    assert len(written) == len(summary) == len(targets) * levels
    assert list(dict.fromkeys(written["target"])) == targets
    assert (written["requests"] == requests * repeats).all() and (written["errors"] == 0).all()
    assert (records["output_tokens"] == max_tokens).all()  # ignore_eos: exactly max_tokens, every request
    assert (records["chunk_tokens"].map(sum) == records["output_tokens"]).all()
    # each level ran on every target back to back, the targets' order rotated at each repeat, one run at a time
    measured = records.drop_duplicates("run_order").sort_values("run_order")
    assert measured["run_order"].tolist() == list(range(len(targets) * levels * repeats))
    expected = [t for _ in range(levels) for repeat in range(repeats) for t in bench.rotated(targets, repeat)]
    assert measured["target"].tolist() == expected
    blocks = measured[["concurrency", "request_rate", "repeat"]].fillna(-1).groupby(measured["run_order"] // len(targets))
    assert (blocks.nunique() == 1).all().all()  # one level and repeat per block
    assert records.groupby("run_order")["target"].nunique().eq(1).all()
    # every target got the same prompts (same indices, warm-up excluded) in the same order
    indices = {t: sorted(g["index"]) for t, g in records.groupby("target")}
    assert all(v == indices[targets[0]] for v in indices.values()) and min(indices[targets[0]]) > 0
    environment = json.loads((out / "environment.json").read_text())
    assert environment["device"] == ("GPU" if has_gpu() else "CPU") and environment["versions"]["vllm"] and environment["cpu_count"]
    assert environment["engine_args"].get("max_num_seqs") == device_engine_defaults().get("max_num_seqs")  # 8 on CPU
    for name in ("throughput.png", "ttft.png", "itl.png", "cdf_e2e.png", "cdf_ttft.png", "time_split.png"):
        assert (out / name).stat().st_size > 1000, name
    return records, environment


ENGINE_PAGE = """\
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_count{model="vllm_model",version="1"} 10
vllm:e2e_request_latency_seconds_sum{model="vllm_model",version="1"} 7.5
vllm:e2e_request_latency_seconds_count{model="other",version="1"} 99
vllm:e2e_request_latency_seconds_sum{model="other",version="1"} 99
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_count{model="vllm_model",version="1"} 10
vllm:request_queue_time_seconds_sum{model="vllm_model",version="1"} 0.5
"""


def test_histogram_totals_count_and_sum_the_measured_models_series_only():
    totals = bench.histogram_totals(ENGINE_PAGE, "vllm_model")
    assert totals == {"vllm:e2e_request_latency_seconds": (10.0, 7.5), "vllm:request_queue_time_seconds": (10.0, 0.5)}


def step_page(count: int, tokens: int, buckets: dict[str, int]) -> str:
    """A page with the engine steps' histogram of our backend's model and of another one (left out)."""
    lines = ["# TYPE vllm:iteration_tokens_total histogram"]
    for model, scale in (("vllm_model", 1), ("other", 100)):
        labels = f'model="{model}",version="1"'
        lines += [f'vllm:iteration_tokens_total_bucket{{{labels},le="{le}"}} {n * scale}' for le, n in buckets.items()]
        lines += [f"vllm:iteration_tokens_total_count{{{labels}}} {count * scale}", f"vllm:iteration_tokens_total_sum{{{labels}}} {tokens}"]
    return "\n".join(lines) + "\n"


def test_engine_step_columns_count_the_steps_that_carried_a_prefill():
    before = bench.histogram_totals(step_page(10, 40, {"1": 2, "8": 4, "16": 6, "64": 8, "128": 10, "+Inf": 10}), "vllm_model")
    assert before["vllm:iteration_tokens_total"] == (10.0, 40.0) and before[bench.step_bucket_key(16)] == (6.0, 0.0)
    # 4 requests at 16 clients: 40 steps of at most 16 tokens, 3 larger ones (a prefill in each; two requests shared one)
    after = bench.histogram_totals(step_page(53, 1040, {"1": 2, "8": 4, "16": 46, "64": 48, "128": 53, "+Inf": 53}), "vllm_model")
    columns = bench.engine_step_columns(before, after, concurrency=16, finished=4)
    assert columns == {
        "engine_tokens_per_step": pytest.approx(1000 / 43),
        "engine_steps_per_request": pytest.approx(43 / 4),
        "engine_prefill_steps_per_request": pytest.approx(3 / 4),
    }
    assert bench.engine_step_columns(before, after, concurrency=10, finished=4) == columns  # the bucket that holds 10: 16
    open_loop = bench.engine_step_columns(before, after, concurrency=None, finished=4)
    assert "engine_prefill_steps_per_request" not in open_loop and open_loop["engine_steps_per_request"] == pytest.approx(43 / 4)
    assert "engine_prefill_steps_per_request" not in bench.engine_step_columns(before, after, concurrency=300, finished=4)
    assert bench.engine_step_columns({}, after, concurrency=16, finished=4) == {}  # no histogram before: nothing to subtract
    assert bench.engine_step_columns(before, before, concurrency=16, finished=4) == {}  # no step counted


def test_engine_time_columns_wait_for_the_levels_requests_then_average_the_difference():
    e2e, queue = "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"
    before = {e2e: (10.0, 7.5), queue: (10.0, 0.5)}
    pages = iter([{e2e: (12.0, 9.0), queue: (12.0, 0.6)}, {e2e: (14.0, 10.5), queue: (14.0, 0.9)}])  # published late
    columns, last = bench.engine_time_columns(before, lambda: next(pages), finished=4)
    assert columns == {"engine_e2e_ms": pytest.approx(750.0), "engine_queue_ms": pytest.approx(100.0)}
    assert last == {e2e: (14.0, 10.5), queue: (14.0, 0.9)}  # counted exactly the level's: the next level starts there
    assert bench.engine_time_columns(None, lambda: {}, finished=4) == ({}, None)  # no metrics page: no columns
    assert bench.engine_time_columns({}, lambda: {}, finished=4, settle_s=10.0) == ({}, None)  # no histograms: at once
    stuck = bench.engine_time_columns(before, lambda: before, finished=4, settle_s=0.0)
    assert stuck == ({}, None)  # nothing counted: no mean, and the next level settles its own start


def test_a_reading_is_settled_once_the_page_stops_changing():
    e2e = "vllm:e2e_request_latency_seconds"
    pages = iter([{e2e: (1.0, 1.0)}, {e2e: (3.0, 2.0)}, {e2e: (3.0, 2.0)}, {e2e: (9.0, 9.0)}])
    assert bench.settled_histograms(lambda: next(pages), quiet_s=0.0) == {e2e: (3.0, 2.0)}
    assert bench.settled_histograms(lambda: None, quiet_s=0.0) is None
    assert bench.settled_histograms(lambda: {}, quiet_s=10.0) == {}  # metrics off: at once, nothing to wait for


def test_engine_time_split_separates_the_engine_the_event_loop_and_what_lies_outside_vllm():
    times = {"engine_e2e_ms": 900.0, "engine_queue_ms": 10.0, "engine_inference_ms": 840.0, "engine_ttft_ms": 60.0}
    split = bench.engine_time_split(times, client_e2e_mean_ms=1000.0)
    assert split["vllm_frontend_ms"] == pytest.approx(50.0) and split["outside_vllm_ms"] == pytest.approx(100.0)
    assert split["engine_ttft_ms"] == 60.0
    assert "vllm_frontend_ms" not in bench.engine_time_split({"engine_e2e_ms": 900.0}, 1000.0)


def test_cli_sweeps_both_triton_protocols_on_the_session_server(triton, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "GAUGE_SAMPLE_S", 0.02)  # levels this short last well under a second on a GPU
    argv = [
        "--targets", "triton-grpc,triton-http,triton-grpc-per-request", "--concurrency", "1,2", "--request-rate", "4",
        "--max-tokens", "8",
        "--requests", "4", "--repeats", "2", "--warmup", "1", "--out", str(tmp_path),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    summary = pd.read_csv(tmp_path / "summary.csv")
    records, environment = check_outputs(
        tmp_path, summary, ["triton-grpc", "triton-http", "triton-grpc-per-request"], 3, 8, 4, 2
    )
    assert environment["benchmark"]["triton_reused"]  # the session's server, not a second one
    assert environment["benchmark"]["triton_instances"] == [1]
    with pytest.raises(ValueError, match="triton_instances=2 needs a Triton started by the benchmark"):
        bench.main(argv[:-1] + [str(tmp_path / "two"), "--triton-instances", "2"])
    assert not (tmp_path / "two").exists()
    assert summary["request_rate"].notna().sum() == 3 and summary["requests_per_s_std"].notna().all()
    assert (tmp_path / "throughput_rate.png").exists()
    assert (records.loc[records["mode"] == "open", "lag_ms"] >= 0).all()
    # Triton's own statistics per level: every request was queued and taken by execute for a measurable time
    assert (summary["server_queue_ms"] > 0).all() and (summary["server_execute_ms"] > 0).all()
    assert (summary["server_execute_ms"] < summary["ttft_p99_ms"]).all()  # taking a request is not generating it
    # who used the CPU: the session's Triton found by its port, its Python stub (vLLM's front-end), its engine.
    # Light processes can use less than one clock tick (10 ms) in a level this short: found (a number), not > 0
    for column in ("cpu_load_busiest", "cpu_server", "cpu_frontend"):
        assert (summary[column] >= 0).all(), column
    assert (summary["cpu_engine"] > 0).all() and (summary["cpu_machine"] <= os.cpu_count() * 1.05).all()
    assert (summary["cpu_steal"] >= 0).all()
    roles = summary[["cpu_load_busiest", "cpu_server", "cpu_frontend", "cpu_engine"]].sum(axis=1)
    assert (roles <= summary["cpu_machine"] + 0.2).all()  # the processes measured are part of the machine
    # the engine's running requests, as our backend publishes them on Triton's metrics port: once a second, so a
    # level this short may see what an earlier one (or test) left; found, and a count
    assert (summary["engine_running_mean"] >= 0).all() and (summary["engine_step_ms"] >= 0).all()
    check_engine_time_split(summary, outside_vllm=True)


def test_a_time_limit_keeps_the_runs_measured_before_it(triton, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "GAUGE_SAMPLE_S", 0.02)
    summary = bench.run_benchmark(
        ["triton-grpc"], [1, 2], max_tokens=8, requests=4, repeats=2, warmup=1, out_dir=tmp_path, progress=False,
        plots=False, time_limit_s=1e-3,
    )  # fmt: skip
    # the limit passed before the sweep began: the first run still ran, the second would have ended past it
    assert summary.attrs["stopped"].startswith("time limit")
    assert summary[["target", "concurrency", "requests"]].values.tolist() == [["triton-grpc", 1, 4]]
    records = bench.read_records(tmp_path / "requests.csv")
    assert len(records) == 4 and (records["error"] == "").all() and (records["output_tokens"] == 8).all()
    environment = json.loads((tmp_path / "environment.json").read_text())
    assert (environment["runs_measured"], environment["runs_planned"]) == (1, 4)
    assert environment["stopped"] == summary.attrs["stopped"] and environment["benchmark"]["time_limit_s"] == 1e-3
    with pytest.raises(ValueError, match="time_limit_s must be positive"):
        bench.run_benchmark(["triton-grpc"], [1], time_limit_s=0, out_dir=tmp_path / "zero")


def start_cli_and_wait_for_its_first_run(out: Path, to_group: bool) -> tuple[subprocess.Popen, list[str], threading.Thread]:
    """The benchmark's command line on the session server, three levels of 4 s, once its bar counts the first run;
    its stderr gathered into the list returned by the thread returned."""
    command = [
        sys.executable, "-m", "utils.bench", "--targets", "triton-grpc", "--concurrency", "1,2,3", "--duration", "4",
        "--max-tokens", "8", "--warmup", "1", "--no-plots", "--out", str(out),
    ]  # fmt: skip
    out.mkdir(parents=True)
    with open(out.parent / "stdout.txt", "w") as stdout:
        cli = subprocess.Popen(
            command, cwd=paths.PROJECT_ROOT, stdout=stdout, stderr=subprocess.PIPE, text=True, start_new_session=to_group
        )  # fmt: skip
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(lambda: cli.stderr.read(1), "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while "1/3" not in "".join(err[-400:]) and cli.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cli.poll() is None, "".join(err)[-3000:]
    return cli, err, reader


@pytest.mark.parametrize("to_group", [False, True], ids=["SIGTERM to the benchmark", "SIGINT to its process group"])
def test_a_stopped_cli_writes_the_runs_measured_and_leaves_no_process(triton, tmp_path, to_group):
    """What `timeout` (SIGTERM to the benchmark) and Ctrl-C in a terminal (SIGINT to the benchmark and its load
    workers) do: the runs measured are written, the workers end, the exit code is 128 + the signal."""
    cli, err, reader = start_cli_and_wait_for_its_first_run(tmp_path / "out", to_group)
    workers = psutil.Process(cli.pid).children(recursive=True)
    assert workers  # the load generator's processes
    if to_group:
        os.killpg(cli.pid, signal.SIGINT)
    else:
        cli.terminate()
    assert cli.wait(timeout=120) == 128 + (signal.SIGINT if to_group else signal.SIGTERM), "".join(err)[-3000:]
    reader.join(5)
    assert "Traceback" not in "".join(err), "".join(err)[-3000:]  # a stop, not a crash, in the parent and its workers
    assert not [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    out = (tmp_path / "stdout.txt").read_text()
    summary = pd.read_csv(tmp_path / "out" / "summary.csv")
    assert summary["concurrency"].tolist() in ([1], [1, 2]), out  # the run under way when the signal came is dropped
    environment = json.loads((tmp_path / "out" / "environment.json").read_text())
    assert environment["stopped"] == "interrupted" and environment["runs_measured"] == len(summary)
    assert "stopped early (interrupted)" in out
    assert bench.read_records(tmp_path / "out" / "requests.csv")["error"].eq("").all()
    assert not (tmp_path / "out" / "measured").exists()  # requests.csv holds the runs saved one by one
    assert http_ready(triton.http_url)  # the server measured keeps serving


def test_a_killed_cli_leaves_the_runs_it_measured_and_summarize_makes_their_results(triton, tmp_path):
    """SIGKILL to the benchmark's process group (a call's time limit on the GPU machine, 2026-12-07): nothing can
    write the results, but each run was saved as it was measured, and `--summarize` makes the results of them."""
    out = tmp_path / "out"
    cli, _, _ = start_cli_and_wait_for_its_first_run(out, to_group=True)
    os.killpg(cli.pid, signal.SIGKILL)
    assert cli.wait(timeout=30) == -signal.SIGKILL
    assert not (out / "summary.csv").exists() and not (out / "requests.csv").exists()
    assert [path.name for path in (out / "measured").iterdir()] == ["run-0000.csv"]  # no half-written second
    assert bench.main(["--summarize", str(out), "--no-plots"]) == 0
    summary = pd.read_csv(out / "summary.csv")
    assert summary[["target", "concurrency"]].values.tolist() == [["triton-grpc", 1]]
    records = bench.read_records(out / "requests.csv")
    assert len(records) == summary["requests"].iloc[0] > 0 and (records["output_tokens"] == 8).all()
    environment = json.loads((out / "environment.json").read_text())
    assert environment["stopped"] == bench.ENDED_UNFINISHED
    assert (environment["runs_measured"], environment["runs_planned"]) == (1, 3)
    assert list(environment["startup_s"]) == ["triton"]  # written before the first run
    assert not (out / "measured").exists()
    assert http_ready(triton.http_url)  # the server measured keeps serving


def check_engine_time_split(summary: pd.DataFrame, outside_vllm: bool) -> None:
    """vLLM's own account of each level's requests: the engine's share is part of its end-to-end time, and (for
    a server) the client waited longer than vLLM counted, the server being in between."""
    assert (summary["engine_inference_ms"] > 0).all() and (summary["engine_queue_ms"] >= 0).all()
    assert (summary["engine_ttft_ms"] > 0).all() and (summary["engine_ttft_ms"] <= summary["engine_e2e_ms"]).all()
    assert (summary["vllm_frontend_ms"] > 0).all()
    assert summary["outside_vllm_ms"].notna().all()
    # the engine's steps, from vLLM's histogram of tokens per step (our backend publishes it under vLLM's name): every
    # step computed a token, and each request's 100-token prompt was prefilled in one step, alone or with others
    assert (summary["engine_tokens_per_step"] >= 1).all() and (summary["engine_steps_per_request"] > 0).all()
    prefill_steps = summary.loc[summary["mode"] == "closed", "engine_prefill_steps_per_request"]
    assert ((prefill_steps > 0) & (prefill_steps <= 1)).all(), prefill_steps.tolist()
    if outside_vllm:
        assert (summary["outside_vllm_ms"] > 0).all()


def test_vllm_server_and_direct_engine_start_measure_and_stop(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "GAUGE_SAMPLE_S", 0.02)  # levels this short last well under a second on a GPU
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    summary = bench.run_benchmark(
        ["vllm-openai", "direct"], [2], max_tokens=8, requests=4, warmup=1, out_dir=tmp_path, progress=False
    )
    check_outputs(tmp_path, summary, ["vllm-openai", "direct"], 1, 8, 4, 1)
    assert not set(bench.SERVER_COLUMNS) & set(summary.columns)  # Triton's statistics only
    cpu = summary.set_index("target")
    assert (cpu[["cpu_machine", "cpu_engine"]] > 0).all().all()
    assert (cpu["cpu_load_busiest"] >= 0).all()  # a light worker can use less than a clock tick in a short level
    assert cpu.loc["vllm-openai", "cpu_frontend"] >= 0  # vLLM's API server, found
    assert math.isnan(cpu.loc["direct", "cpu_frontend"])  # the front-end is inside the load worker
    assert cpu["cpu_server"].isna().all()  # no Triton
    # vLLM's gauge of running requests, from its server's /metrics and the direct engine's worker: sampled (a
    # number, not NaN) and never more than the 2 clients. On an H200 these levels last about 50 ms and the
    # direct engine's samples read its idle 0 (2026-12-05), so no more than that is asked here
    assert ((cpu["engine_running_mean"] >= 0) & (cpu["engine_running_mean"] <= 2)).all()
    assert (cpu["engine_step_ms"] >= 0).all()
    check_engine_time_split(summary, outside_vllm=False)
    assert cpu.loc["vllm-openai", "outside_vllm_ms"] > 0
    assert summary.attrs["out_dir"] == str(tmp_path.resolve())
    command = (tmp_path / "vllm-openai" / "command.txt").read_text()
    for key in device_engine_defaults():  # CPU: 8 sequences, float32; GPU: bf16, a share of its memory
        assert f"--{key.replace('_', '-')}" in command, key
    assert "Application startup complete" in (tmp_path / "vllm-openai" / "server.log").read_text()
    assert (tmp_path / "direct" / "engine.log").stat().st_size > 0
    # multiprocessing's resource tracker is this process's own helper, started by its first queue, and ends with it
    leftovers = [
        p for p in psutil.Process().children(recursive=True)
        if p.pid not in before and p.is_running() and "multiprocessing.resource_tracker" not in " ".join(p.cmdline())
    ]  # fmt: skip
    assert leftovers == []


def test_two_backends_are_measured_side_by_side_each_on_a_triton_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "GAUGE_SAMPLE_S", 0.02)
    copy = tmp_path / "copy" / "vllm"
    shutil.copytree(paths.backend_source(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    marker = "# the copy measured beside the original\n"
    (copy / "serving.py").write_text((copy / "serving.py").read_text() + marker)
    out = tmp_path / "out"
    summary = bench.run_benchmark(
        ["triton-grpc"], [2], max_tokens=8, requests=4, repeats=2, warmup=1, out_dir=out, progress=False, plots=False,
        triton_backends={"main": paths.backend_source(), "copy": copy},
    )  # fmt: skip
    assert summary["target"].tolist() == ["triton-grpc@main", "triton-grpc@copy"]
    assert (summary["requests"] == 8).all() and (summary["errors"] == 0).all()
    records = bench.read_records(out / "requests.csv")
    assert (records["output_tokens"] == 8).all()
    measured = records.drop_duplicates("run_order").sort_values("run_order")["target"].tolist()
    assert measured == ["triton-grpc@main", "triton-grpc@copy", "triton-grpc@copy", "triton-grpc@main"]
    # each Triton served its own copy of the backend
    assert (out / "triton-copy" / "backends" / "vllm" / "serving.py").read_text().endswith(marker)
    assert not (out / "triton-main" / "backends" / "vllm" / "serving.py").read_text().endswith(marker)
    environment = json.loads((out / "environment.json").read_text())
    assert environment["benchmark"]["triton_backends"] == {"main": str(paths.backend_source()), "copy": str(copy)}
    assert set(environment["startup_s"]) == {"triton@main", "triton@copy"}
    assert not environment["benchmark"]["triton_reused"]  # not the session's server


def test_backends_side_by_side_need_a_triton_target_and_a_folder_with_model_py(tmp_path):
    with pytest.raises(ValueError, match="give one of them"):
        bench.run_benchmark(["direct"], [1], triton_backends={"main": paths.backend_source()}, out_dir=tmp_path / "a")
    with pytest.raises(ValueError, match="has no model.py"):
        bench.run_benchmark(["triton-grpc"], [1], triton_backends={"x": tmp_path}, out_dir=tmp_path / "b")
    with pytest.raises(ValueError, match="use letters, digits"):
        bench.run_benchmark(["triton-grpc"], [1], triton_backends={"a b": paths.backend_source()}, out_dir=tmp_path / "c")
    with pytest.raises(SystemExit):
        bench.parse_args(["--triton-backends", "main"])
    assert bench.parse_args(["--triton-backends", "a=x,b=y"]).triton_backends == {"a": Path("x"), "b": Path("y")}
    assert not any((tmp_path / name).exists() for name in "abc")  # refused before anything started


def test_vllm_server_that_cannot_start_is_explained(tmp_path):
    server = bench.VllmServer({"model": str(tmp_path / "no-such-model")}, tmp_path)
    with server, pytest.raises(bench.BenchmarkError, match="exited with code .* before it was ready"):
        server.wait_ready(progress=False)
    assert server.process is None
