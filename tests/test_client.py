"""utils.client against the real server: HTTP generate and generate_stream, curl, the asyncio gRPC client
(streaming and not, concurrency, cancellation, timeouts), the sample client's command line, and the
errors a learner meets (no server, wrong port, unknown model, model still loading, refused request)."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import requests

from utils import client
from utils.server import SHARED_SERVER_ENV, TritonServer, free_port

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"
GREEDY = {"max_tokens": 8, "temperature": 0}
SAMPLE_PROMPTS = (ROOT / "prompts.txt").read_text().splitlines()


# ---- HTTP ------------------------------------------------------------------------------------------------
def test_generate_returns_prompt_then_completion_unless_excluded(triton):
    full = client.generate(PROMPT, url=triton.http_url, return_num_output_tokens=True, **GREEDY)
    completion = client.generate(PROMPT, url=triton.http_url, exclude_input_in_output=True, **GREEDY)
    assert full["model_name"] == "vllm_model" and full["num_output_tokens"] == 8
    assert len(full["text_output"]) > len(PROMPT)
    assert full["text_output"] == PROMPT + completion["text_output"]


def test_generate_stream_deltas_join_to_the_generate_text(triton):
    whole = client.generate(PROMPT, url=triton.http_url, **GREEDY)["text_output"]
    events = list(client.generate_stream(PROMPT, url=triton.http_url, return_finish_reason=True, **GREEDY))
    assert len(events) > 1
    assert "".join(event["text_output"] for event in events) == whole
    assert [event["finish_reason"] for event in events] == [""] * (len(events) - 1) + ["length"]


def test_sse_error_event_after_good_events_is_raised():
    lines = ['data: {"text_output": "Paris"}', "", 'data: {"error": "vLLM engine died: out of memory"}', ""]
    events = client.sse_events(lines)
    assert next(events) == {"text_output": "Paris"}
    with pytest.raises(client.GenerationError, match="engine died: out of memory"):
        next(events)


def test_generate_stream_raises_the_backend_error(triton):
    with pytest.raises(client.GenerationError, match="max_tokenz"):
        list(client.generate_stream(PROMPT, url=triton.http_url, max_tokenz=4))


@pytest.mark.parametrize("stream", [False, True])
def test_curl_command_runs_and_answers(triton, stream):
    prompt = "France's capital is"  # an apostrophe: the line must survive the shell's quoting
    command = client.curl_command(prompt, url=triton.http_url, stream=stream, **GREEDY)
    assert command.startswith("curl ") and f"{triton.http_url}/v2/models/vllm_model/" in command
    output = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120, check=True).stdout
    if stream:
        text = "".join(event["text_output"] for event in client.sse_events(output.splitlines()))
    else:
        text = json.loads(output)["text_output"]
    assert text == client.generate(prompt, url=triton.http_url, **GREEDY)["text_output"]


# ---- errors, HTTP and gRPC ----------------------------------------------------------------------------------
def test_no_server_says_how_to_start_one(monkeypatch):
    monkeypatch.delenv(SHARED_SERVER_ENV, raising=False)
    port = free_port()
    with pytest.raises(client.ServerNotRunning, match=f"127.0.0.1:{port}") as http_error:
        client.generate(PROMPT, url=f"127.0.0.1:{port}")
    with pytest.raises(client.ServerNotRunning, match=f"127.0.0.1:{port}") as grpc_error:
        client.run_many([PROMPT], url=f"127.0.0.1:{port}")
    for error in (http_error, grpc_error):
        assert "make serve" in str(error.value) and "ensure_server()" in str(error.value)
        assert "8000 (HTTP), 8001 (gRPC)" in str(error.value)


def test_wrong_port_names_the_server_that_answers(triton):
    port = free_port()
    with pytest.raises(client.ServerNotRunning, match=f"127.0.0.1:{port}.*answers HTTP on {triton.http_url}"):
        client.generate(PROMPT, url=f"127.0.0.1:{port}")
    with pytest.raises(client.ServerNotRunning, match=f"answers gRPC on {triton.grpc_url}"):
        client.run_many([PROMPT], url=f"127.0.0.1:{port}")


def test_http_client_on_the_grpc_port_and_back(triton):
    with pytest.raises(client.WrongPort, match=f"looks like a gRPC port.*answers HTTP on {triton.http_url}"):
        client.generate(PROMPT, url=triton.grpc_url)
    with pytest.raises(client.WrongPort, match=f"looks like an HTTP port.*answers gRPC on {triton.grpc_url}"):
        client.run_many([PROMPT], url=triton.http_url)


def test_unknown_model_lists_the_served_ones(triton):
    with pytest.raises(client.UnknownModel, match="no model named 'vlm_model'.*It serves: .*vllm_model") as http_error:
        client.generate(PROMPT, url=triton.http_url, model="vlm_model")
    with pytest.raises(client.UnknownModel, match="no model named 'vlm_model'") as grpc_error:
        client.run_many([PROMPT], url=triton.grpc_url, model="vlm_model")
    assert "vllm_model" in http_error.value.available and "vllm_model" in grpc_error.value.available


def test_stream_one_records_errors_instead_of_raising(triton):
    async def send_both():
        async with client.grpcclient.InferenceServerClient(triton.grpc_url) as grpc_client:
            unknown = await client.stream_one(grpc_client, PROMPT, model="vlm_model", sampling=GREEDY)
            refused = await client.stream_one(grpc_client, PROMPT, sampling={"max_tokenz": 4})
            return unknown, refused

    unknown, refused = asyncio.run(send_both())
    assert isinstance(unknown.error, client.UnknownModel) and unknown.finish_reason == "error"
    assert isinstance(refused.error, client.GenerationError) and "max_tokenz" in str(refused.error)
    assert not unknown.ok and not refused.ok and refused.chunks == []


# a Python model that stays in `initialize` until the test lets it finish: a model honestly "loading"
LOADING_MODEL = '''
import json, os, time

class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"])["parameters"]
        open(parameters["started"]["string_value"], "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(parameters["release"]["string_value"]) and time.monotonic() < deadline:
            time.sleep(0.05)

    def execute(self, requests):
        raise NotImplementedError("this model exists to be loading")
'''


def test_model_still_loading_says_wait(triton, tmp_path):
    name, started, release = "client_test_loading", tmp_path / "started", tmp_path / "release"
    config = {
        "name": name,
        "backend": "python",
        "input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]}],
        "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [1]}],
        "parameters": {"started": {"string_value": str(started)}, "release": {"string_value": str(release)}},
    }
    files = {"config": json.dumps(config), "file:1/model.py": base64.b64encode(LOADING_MODEL.encode()).decode()}
    load_url = f"http://{triton.http_url}/v2/repository/models/{name}"
    loaded: dict = {}
    loader = threading.Thread(
        target=lambda: loaded.update(reply=requests.post(f"{load_url}/load", json={"parameters": files}, timeout=180))
    )
    loader.start()
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), "the test model never started loading"
        with pytest.raises(client.ModelNotReady, match=f"'{name}'.*still loading.*wait"):
            client.generate(PROMPT, url=triton.http_url, model=name)
        with pytest.raises(client.ModelNotReady, match=f"'{name}'.*still loading.*wait"):
            client.run_many([PROMPT], url=triton.grpc_url, model=name)
    finally:
        release.touch()
        loader.join(timeout=180)
        requests.post(f"{load_url}/unload", json={}, timeout=60)
    assert loaded["reply"].status_code == 200  # it was loading indeed, and then loaded


# ---- gRPC ---------------------------------------------------------------------------------------------------
def test_stream_many_records_every_response(triton):
    results = client.run_many(SAMPLE_PROMPTS[:3], url=triton.grpc_url, sampling=GREEDY)
    assert [r.request_id for r in results] == ["0", "1", "2"]
    for prompt, result in zip(SAMPLE_PROMPTS, results):
        assert result.ok and result.finish_reason == "length" and result.output_tokens == 8
        assert result.text.startswith(prompt) and len(result.text) > len(prompt)
        assert len(result.chunks) == len(result.arrival_times) == len(result.tokens_per_chunk) > 1
        assert result.start < result.arrival_times[0]
        assert result.arrival_times == sorted(result.arrival_times)
        assert 0 < result.ttft < result.e2e
    table = client.results_table(results)
    assert list(table["output_tokens"]) == [8, 8, 8] and list(table["finish_reason"]) == ["length"] * 3
    assert (table["ttft_s"] < table["e2e_s"]).all() and list(table["error"]) == [""] * 3


def test_non_streaming_request_gets_one_response(triton):
    results = client.run_many([PROMPT, PROMPT], url=triton.grpc_url, stream=False, exclude_input=True, sampling=GREEDY)
    whole = client.generate(PROMPT, url=triton.http_url, **GREEDY)["text_output"]
    for result in results:
        assert result.ok and len(result.chunks) == 1 and result.tokens_per_chunk == [8]
        assert PROMPT + result.text == whole
        assert result.ttft == result.e2e


def test_concurrency_limit_queues_requests_in_the_client(triton):
    first, second = client.run_many([PROMPT, PROMPT], url=triton.grpc_url, concurrency=1, sampling=GREEDY)
    assert first.ok and second.ok
    assert second.start >= first.arrival_times[-1]


def test_run_many_works_where_an_event_loop_already_runs(triton):
    async def like_jupyter():
        return client.run_many([PROMPT], url=triton.grpc_url, sampling=GREEDY)

    (result,) = asyncio.run(like_jupyter())
    assert result.ok and result.output_tokens == 8


def _running_requests(triton) -> float:
    with urllib.request.urlopen(triton.metrics_url, timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:num_requests_running{"))


def _wait_for_running(triton, predicate, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate(_running_requests(triton)):
            return True
        time.sleep(0.2)
    return False


def test_cancelling_one_request_aborts_it_on_the_server_and_spares_the_others(triton):
    endless = {"max_tokens": 1000, "ignore_eos": True}  # about half a minute of work if nobody stops it

    async def scenario():
        async with client.grpcclient.InferenceServerClient(triton.grpc_url) as grpc_client:
            long = client.StreamResult("Tell me a long story.")
            long_task = asyncio.create_task(client.stream_one(grpc_client, long.prompt, sampling=endless, into=long))
            short = await client.stream_one(grpc_client, PROMPT, sampling=GREEDY)
            running = await asyncio.to_thread(_wait_for_running, triton, lambda n: n >= 1)
            still_streaming = not long_task.done() and len(long.chunks) > 0
            long_task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await long_task
            return long, short, running, still_streaming

    long, short, running, still_streaming = asyncio.run(scenario())
    assert short.ok and short.output_tokens == 8
    assert running and still_streaming
    assert long.finish_reason == "cancelled" and 0 < long.output_tokens < 1000
    assert _wait_for_running(triton, lambda n: n == 0), "the server kept generating for the cancelled request"


def test_cancel_after_cancels_only_that_request(triton):
    from utils.repository import has_gpu

    tokens = 2000 if has_gpu() else 16  # both far longer than 0.2 s (about 2 ms a token on a GPU)
    cancelled, finished = client.run_many(
        [PROMPT, PROMPT], url=triton.grpc_url, sampling={"max_tokens": tokens, "ignore_eos": True}, cancel_after={0: 0.2}
    )
    assert cancelled.finish_reason == "cancelled" and cancelled.output_tokens < tokens and not cancelled.ok
    assert finished.ok and finished.output_tokens == tokens


def test_timeout_ends_the_request_on_both_sides(triton):
    (result,) = client.run_many([PROMPT], url=triton.grpc_url, sampling={"max_tokens": 1000, "ignore_eos": True}, timeout=1.0)
    assert result.finish_reason == "timeout" and isinstance(result.error, client.RequestTimeout)
    assert "1 s" in str(result.error) and 0 < result.output_tokens < 1000
    assert _wait_for_running(triton, lambda n: n == 0), "the server kept generating after the deadline"


# ---- streams kept open (StreamPool: utils.bench's gRPC load) ------------------------------------------------------
def _with_pool(triton, scenario):
    """Run ``scenario(pool)`` on a fresh StreamPool; returns its result and how many streams the pool opened."""

    async def run():
        async with client.grpcclient.InferenceServerClient(triton.grpc_url) as grpc_client:
            async with client.StreamPool(grpc_client, triton.grpc_url) as pool:
                outcome = await scenario(pool)
            return outcome, pool.opened

    return asyncio.run(run())


def test_a_stream_pool_reuses_open_streams_and_survives_a_refused_request(triton):
    async def scenario(pool):
        one_by_one = [await pool.stream_one(PROMPT, sampling=GREEDY, request_id=str(i)) for i in range(3)]
        refused = await pool.stream_one(PROMPT, sampling={"max_tokenz": 4})
        after = await pool.stream_one(PROMPT, sampling=GREEDY)
        together = await asyncio.gather(*(pool.stream_one(PROMPT, sampling=GREEDY) for _ in range(3)))
        again = await asyncio.gather(*(pool.stream_one(PROMPT, sampling=GREEDY) for _ in range(3)))
        return one_by_one + [after] + together + again, refused

    (good, refused), opened = _with_pool(triton, scenario)
    assert opened == 3  # one stream for the sequential requests, then as many as ran at once
    alone = client.run_many([PROMPT], url=triton.grpc_url, sampling=GREEDY)[0]  # a stream of its own
    assert all(r.ok and r.output_tokens == 8 and r.finish_reason == "length" for r in good)
    assert {r.text for r in good} == {alone.text}
    assert all(len(r.arrival_times) == len(r.chunks) > 1 and r.ttft > 0 for r in good)
    assert refused.finish_reason == "error" and "max_tokenz" in str(refused.error) and not refused.chunks


def test_a_cancelled_request_on_an_open_stream_is_aborted_and_the_pool_goes_on(triton):
    endless = {"max_tokens": 1000, "ignore_eos": True}

    async def scenario(pool):
        long_task = asyncio.create_task(pool.stream_one("Tell me a long story.", sampling=endless))
        running = await asyncio.to_thread(_wait_for_running, triton, lambda n: n >= 1)
        long_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long_task
        aborted = await asyncio.to_thread(_wait_for_running, triton, lambda n: n == 0)
        timed_out = await pool.stream_one(PROMPT, sampling=endless, timeout=1.0)
        stopped = await asyncio.to_thread(_wait_for_running, triton, lambda n: n == 0)
        after = await pool.stream_one(PROMPT, sampling=GREEDY)
        return running, aborted, timed_out, stopped, after

    (running, aborted, timed_out, stopped, after), opened = _with_pool(triton, scenario)
    assert running and aborted, "the server kept generating for the cancelled request"
    assert timed_out.finish_reason == "timeout" and isinstance(timed_out.error, client.RequestTimeout)
    assert 0 < timed_out.output_tokens < 1000 and stopped, "the server kept generating after the timeout"
    assert after.ok and after.output_tokens == 8
    assert opened == 3  # each cancelled call closed its stream


def _stream_setup_bench():
    """scripts/stream-setup-bench.py as a module: its model that only answers makes a Triton that starts in seconds."""
    spec = importlib.util.spec_from_file_location("stream_setup_bench", ROOT / "scripts" / "stream-setup-bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model_state(server: TritonServer, model: str) -> str:
    index = json.loads(requests.post(f"http://{server.http_url}/v2/repository/index", timeout=10).text)
    return next(entry.get("state", "") for entry in index if entry["name"] == model)


def test_a_closed_stream_pool_lets_the_model_unload_and_a_stopped_server_is_explained(tmp_path):
    repository = _stream_setup_bench().write_repository(tmp_path / "repository")
    with TritonServer(repository, run_dir=tmp_path / "run", free_ports=True) as server:
        server.wait_ready(progress=False)

        async def scenario():
            async with client.grpcclient.InferenceServerClient(server.grpc_url) as grpc_client:
                async with client.StreamPool(grpc_client, server.grpc_url) as pool:
                    served = await asyncio.gather(*(pool.stream_one("hi", model="echo") for _ in range(2)))
                unloaded = await asyncio.to_thread(_unloads, server)
                requests.post(f"http://{server.http_url}/v2/repository/models/echo/load", timeout=60)
                pool = client.StreamPool(grpc_client, server.grpc_url)
                await asyncio.gather(*(pool.stream_one("hi", model="echo") for _ in range(2)))
                server.process.kill()  # the server dies with two idle streams open
                await asyncio.to_thread(server.process.wait)
                after = await pool.stream_one("hi", model="echo", timeout=30)
                await asyncio.wait_for(pool.__aexit__(None, None, None), 30)  # the other stream broke too
                return served, unloaded, after

        served, unloaded, after = asyncio.run(scenario())
    assert all(result.ok and result.output_tokens == 4 for result in served)
    assert unloaded, "the model stayed UNLOADING after the pool closed its streams"
    assert after.finish_reason == "error" and isinstance(after.error, client.ClientError), after.error
    assert server.grpc_url in str(after.error) and not after.chunks


def _unloads(server: TritonServer, timeout: float = 15) -> bool:
    requests.post(f"http://{server.http_url}/v2/repository/models/echo/unload", timeout=10)
    deadline = time.monotonic() + timeout
    while _model_state(server, "echo") == "UNLOADING":
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_the_stream_setup_benchmark_measures_each_way_on_its_own_triton(tmp_path):
    """scripts/stream-setup-bench.py (the figures behind StreamPool) runs its three clients against a real Triton."""
    import pandas as pd

    run = subprocess.run(
        [sys.executable, "scripts/stream-setup-bench.py", "--seconds", "0.5", "--rounds", "1", "--clients", "1,2",
         "--csv", str(tmp_path / "rounds.csv")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    table = pd.read_csv(tmp_path / "rounds.csv")
    assert table.groupby("clients")["method"].apply(set).to_dict() == dict.fromkeys(
        (1, 2), {"gRPC, a stream per request", "gRPC, streams kept open", "HTTP generate_stream"}
    )
    assert (table.drop(columns=["method"]) > 0).all().all()
    assert "streams kept open" in run.stdout


# ---- the sample client's command line --------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "utils.client", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def _results(path: Path) -> list[str]:
    entries = path.read_text().split(client.RESULT_SEPARATOR)
    assert entries[-1] == ""  # every result is followed by a separator
    return [entry.removesuffix("\n") for entry in entries[:-1]]


def test_cli_iterations_and_offset(triton, tmp_path):
    results_file = tmp_path / "results.txt"
    run = _cli(
        "--url", triton.grpc_url, "--iterations", "2", "--offset", "10", "--max-tokens", "8",
        "--results-file", str(results_file), "--verbose",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Loading inputs from `prompts.txt`..." in run.stdout
    assert f"Storing results into `{results_file}`..." in run.stdout
    assert run.stdout.rstrip().endswith("PASS: vLLM example")
    replies = _results(results_file)
    assert len(replies) == 2 * len(SAMPLE_PROMPTS)
    for reply, prompt in zip(replies, SAMPLE_PROMPTS * 2):
        assert reply.startswith(prompt) and len(reply) > len(prompt)
    ids = {f'id: "{n}"' for n in range(10, 18)}
    assert all(request_id in run.stdout for request_id in ids)  # --verbose prints every gRPC response
    assert 'id: "9"' not in run.stdout and 'id: "18"' not in run.stdout


def test_cli_streaming_without_inputs(triton, tmp_path):
    results_file = tmp_path / "results.txt"
    run = _cli(
        "--url", triton.grpc_url, "--streaming-mode", "--exclude-inputs-in-outputs", "--max-tokens", "8",
        "--stream-timeout", "120", "--results-file", str(results_file),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    replies = _results(results_file)
    assert len(replies) == len(SAMPLE_PROMPTS)
    for reply, prompt in zip(replies, SAMPLE_PROMPTS):
        assert reply.strip() and not reply.startswith(prompt)


def test_cli_fails_with_the_reason(triton, tmp_path):
    unknown_lora = _cli("--url", triton.grpc_url, "--lora-name", "pirate", "--results-file", str(tmp_path / "r.txt"))
    assert unknown_lora.returncode == 1
    assert "FAIL:" in unknown_lora.stdout and "unknown lora_name 'pirate'" in unknown_lora.stdout
    port = free_port()
    no_server = _cli("--url", f"127.0.0.1:{port}", "--results-file", str(tmp_path / "r.txt"))
    assert no_server.returncode == 1
    assert f"FAIL: Nothing accepts connections on 127.0.0.1:{port}" in no_server.stdout


def test_cli_help_mentions_vllm_default_max_tokens():
    run = _cli("--help")
    assert run.returncode == 0 and "vLLM's own default is 16" in " ".join(run.stdout.split())
