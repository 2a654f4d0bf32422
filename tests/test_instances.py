"""Two instances of the model in one Triton: two front-ends, each a Python process of its own, of one vLLM engine
(``sharing``). Triton hands requests to them in turn, each labels its metrics with its instance, one engine (one
KV cache) serves both, a stop leaves no error behind, and an engine that dies fails both instances' requests fast."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from tests.backend_helpers import burst, engine_processes, metrics, model_state, post
from utils import paths
from utils.repository import prepare_run_repository
from utils.server import TritonServer

INSTANCES = ("vllm_model_0_0", "vllm_model_0_1")
ERROR_MARKS = ("Traceback", " ERROR ", "Exception ignored")  # Python's and vLLM's; Triton's lines start with E<date>


def start_two_instances(name: str, config_parameters: dict | None = None) -> TritonServer:
    run_dir = paths.runs_dir() / f"pytest-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    repository = prepare_run_repository(
        run_dir / "model_repository", instance_count=2, config_parameters=config_parameters, log=lambda _: None
    )
    server = TritonServer(repository, run_dir=run_dir, free_ports=True)
    return server.start().wait_ready(timeout=900, progress=False)


@pytest.fixture(scope="module")
def two_instances() -> TritonServer:
    server = start_two_instances("instances")
    yield server
    server.stop()


def finished_per_instance(server: TritonServer) -> dict[str, float]:
    values = metrics(server.metrics_url)
    return {name: values.get(f'vllm:request_success_total{{instance="{name}",model="vllm_model",version="1"}}', -1) for name in INSTANCES}


def test_both_instances_serve_a_burst_with_exact_token_counts(two_instances):
    prompts = [f"Request {i}: tell me about the sea." for i in range(8)]
    sampling = {"temperature": 0, "ignore_eos": True, "max_tokens": 12}
    results = asyncio.run(burst(two_instances.grpc_url, prompts, sampling))
    assert [r.error for r in results] == [None] * 8
    assert [sum(r.tokens) for r in results] == [12] * 8
    deadline = time.monotonic() + 10  # the metrics are published once a second
    while sum(finished_per_instance(two_instances).values()) < 8 and time.monotonic() < deadline:
        time.sleep(0.5)
    finished = finished_per_instance(two_instances)
    # Triton hands each request to whichever instance is free, with no promise of balance: 4/4 and 7/1 seen in CI
    assert sum(finished.values()) == 8 and min(finished.values()) >= 1, finished


def test_the_instances_share_one_engine(two_instances):
    """One engine core for both (one KV cache, all of it), instance 0 its starter, instance 1 attached to it."""
    log = two_instances.log_path.read_text(errors="replace")
    assert len(re.findall(r"KV cache size: ([\d,]+) tokens", log)) == 1, log[-3000:]
    assert "front-end 0 of 2 sharing one engine" in log and "front-end 1 of 2 sharing one engine" in log
    assert len(engine_processes(two_instances)) == 1


def test_an_unload_stops_both_instances_streams_and_a_load_starts_one_engine_again(two_instances):
    """Streams on both instances when the model is unloaded: each instance ends its own (the starter stops the
    engine only at its finalize), nothing of the engine stays, no error is logged, and a load shares one again."""
    base = f"http://{two_instances.http_url}/v2/repository/models/vllm_model"
    log_start = two_instances.log_path.stat().st_size
    prompts = [f"Request {i}: tell me about the sea." for i in range(6)]

    async def unload_mid_stream():
        pending = asyncio.ensure_future(burst(two_instances.grpc_url, prompts, {"temperature": 0, "ignore_eos": True, "max_tokens": 1500}))
        await asyncio.sleep(3)  # the streams are running on both instances
        status = await asyncio.to_thread(post, f"{base}/unload")
        return status, await asyncio.wait_for(pending, 60)

    started = time.monotonic()
    status, results = asyncio.run(unload_mid_stream())
    assert status == 200
    assert all(r.error is not None and "being unloaded" in r.error for r in results), [r.error for r in results]
    while model_state(two_instances) != "UNAVAILABLE" and time.monotonic() - started < 60:  # Triton unloads after answering
        time.sleep(0.5)
    assert time.monotonic() - started < 30, f"unload took {time.monotonic() - started:.0f} s"
    assert model_state(two_instances) == "UNAVAILABLE" and engine_processes(two_instances) == []
    log = two_instances.log_path.read_bytes()[log_start:].decode(errors="replace")
    problems = [line for line in log.splitlines() if re.match(r"E\d{4} ", line) or any(mark in line for mark in ERROR_MARKS)]
    assert problems == []

    assert post(f"{base}/load", timeout=900) == 200
    again = asyncio.run(burst(two_instances.grpc_url, prompts[:4], {"temperature": 0, "ignore_eos": True, "max_tokens": 6}))
    assert [sum(r.tokens) for r in again] == [6] * 4 and len(engine_processes(two_instances)) == 1


def test_a_stop_logs_no_error(two_instances):
    serving_log_end = two_instances.log_path.stat().st_size
    two_instances.stop()
    log = two_instances.log_path.read_bytes()[serving_log_end:].decode(errors="replace")  # what the stop wrote
    problems = [line for line in log.splitlines() if re.match(r"E\d{4} ", line) or any(mark in line for mark in ERROR_MARKS)]
    assert "successfully unloaded 'vllm_model'" in log
    assert problems == []


def test_a_dead_shared_engine_fails_both_instances_fast():
    """The engine core killed under two instances: vLLM's clients given addresses do not watch it, the backend
    does (by pid), so the requests in flight on both end with an error naming the dead engine, and new ones too."""
    server = start_two_instances("instances-dead")
    try:
        sampling = {"temperature": 0, "ignore_eos": True, "max_tokens": 2000}
        prompts = [f"Request {i}: tell me about the sea." for i in range(6)]

        async def kill_mid_stream():
            pending = asyncio.ensure_future(burst(server.grpc_url, prompts, sampling))
            await asyncio.sleep(3)  # the streams are running
            [core] = engine_processes(server)
            core.kill()
            started = time.monotonic()
            results = await asyncio.wait_for(pending, 30)
            return results, time.monotonic() - started

        results, waited_s = asyncio.run(kill_mid_stream())
        assert waited_s < 5, waited_s  # the health watch polls every 0.5 s
        assert all(r.error is not None and "died" in r.error for r in results), [r.error for r in results]
        after = asyncio.run(burst(server.grpc_url, ["one more"], {"max_tokens": 4}))
        assert after[0].error is not None
        log = server.log_path.read_text(errors="replace")
        assert "the shared engine died" in log
    finally:
        server.stop()


def test_engine_per_instance_gives_each_instance_an_engine_and_a_whole_kv_cache():
    """config.pbtxt's ``engine_per_instance: yes``: an engine each, as instance groups mean for other backends. On a
    GPU they start one at a time: of two engines started together on an H200 the second measured the first's memory
    as its own and got 47,296 KV-cache tokens against the first's 902,384."""
    server = start_two_instances("instances-apart", {"engine_per_instance": "yes"})
    try:
        results = asyncio.run(burst(server.grpc_url, [f"Request {i}" for i in range(8)], {"temperature": 0, "ignore_eos": True, "max_tokens": 12}))
        assert [sum(r.tokens) for r in results] == [12] * 8
        sizes = [int(size.replace(",", "")) for size in re.findall(r"KV cache size: ([\d,]+) tokens", server.log_path.read_text(errors="replace"))]
        assert len(sizes) == 2 and min(sizes) >= 0.9 * max(sizes), sizes
        assert len(engine_processes(server)) == 2
    finally:
        server.stop()
