"""utils.notebook: results folders, a running server seen from outside, metrics as tables and bars, model control."""

import concurrent.futures
import json
import urllib.request

import matplotlib
import pytest

from utils import notebook as nb
from utils import repository as repo
from utils.server import free_port

matplotlib.use("Agg")

SAMPLE_METRICS = """\
# HELP nv_inference_request_success Number of successful inference requests
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="vllm_model",version="1"} 7
nv_inference_request_success{model="other",version="1"} 100
# HELP vllm:num_requests_running Requests running on the engine
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model="vllm_model",version="1"} 2
# HELP vllm:e2e_request_latency_seconds End-to-end request latency
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_count{model="vllm_model",version="1"} 5
vllm:e2e_request_latency_seconds_sum{model="vllm_model",version="1"} 4.5
vllm:e2e_request_latency_seconds_bucket{model="vllm_model",version="1",le="0.5"} 1
vllm:e2e_request_latency_seconds_bucket{model="vllm_model",version="1",le="1"} 4
vllm:e2e_request_latency_seconds_bucket{model="vllm_model",version="1",le="2.5"} 5
vllm:e2e_request_latency_seconds_bucket{model="vllm_model",version="1",le="+Inf"} 5
"""
EARLIER_METRICS = SAMPLE_METRICS.replace("_count{model=\"vllm_model\",version=\"1\"} 5", "_count{model=\"vllm_model\",version=\"1\"} 2").replace(
    "_sum{model=\"vllm_model\",version=\"1\"} 4.5", "_sum{model=\"vllm_model\",version=\"1\"} 1.5"
).replace('le="1"} 4', 'le="1"} 2').replace('le="2.5"} 5', 'le="2.5"} 2').replace('le="+Inf"} 5', 'le="+Inf"} 2')


def _generate(http_url: str, prompt: str, max_tokens: int) -> str:
    body = json.dumps({"text_input": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://{http_url}/v2/models/vllm_model/generate", data=body)
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())["text_output"]


# ---- folders ----------------------------------------------------------------------------------------------
def test_empty_results_dir_means_runs_notebooks(tmp_path, monkeypatch):
    monkeypatch.setenv("TUTORIAL_HOME", str(tmp_path))
    folder = nb.results_path("")
    assert folder == (tmp_path / "runs" / "notebooks").resolve() and folder.is_dir()


def test_given_results_dir_is_created(tmp_path):
    assert nb.results_path(tmp_path / "a" / "b") == (tmp_path / "a" / "b").resolve()
    assert (tmp_path / "a" / "b").is_dir()


def test_tree_shows_the_repository_layout(tmp_path):
    repo.write_model(tmp_path / "model_repository", repo.make_config(), {"model": "default"})
    assert nb.tree(tmp_path / "model_repository").splitlines() == [
        "model_repository/",
        "    vllm_model/",
        "        1/",
        "            model.json",
        "        config.pbtxt",
    ]


def test_engine_args_table_gives_vllm_defaults_and_names_unknown_keys():
    table = nb.engine_args_table(["tensor_parallel_size", "enforce_eager"])
    assert table.loc["tensor_parallel_size", "vLLM default"] == 1
    assert table.loc["enforce_eager", "vLLM default"] is False
    with pytest.raises(KeyError, match="gpu_memory_utilisation"):
        nb.engine_args_table(["gpu_memory_utilisation"])


# ---- a running server ----------------------------------------------------------------------------------------
def test_running_server_reads_its_options():
    server = nb.RunningServer(
        1, ["tritonserver", "--backend-directory=/r/run1/backends", "--backend-config=python,shm-region-prefix-name=tvt9x0_"]
    )
    assert str(server.run_dir) == "/r/run1" and server.shm_prefix == "tvt9x0_"
    assert server.option("http-port") is None and server.log_path is None


def test_find_server_reads_the_session_servers_command_and_log(triton):
    found = nb.find_server(triton.http)
    assert found.option("grpc-port") == str(triton.grpc) and found.option("model-control-mode") == "explicit"
    assert found.shm_prefix and found.shm_prefix in found.option("backend-config")
    log = found.log_path.read_text()
    assert f"Started HTTPService at 127.0.0.1:{triton.http}" in "\n".join(nb.log_highlights(log))
    table = nb.model_table(log)
    assert "| vllm_model" in table and "READY" in table and table.count("\n") == 4


def test_find_server_on_an_unused_port_is_a_clear_error():
    port = free_port()
    with pytest.raises(LookupError, match=f"port {port}"):
        nb.find_server(port)


def test_log_highlights_shortens_long_lines():
    text = "noise\n" + 'I1 model_lifecycle.cc:1] "successfully loaded \'m\'" ' + "x" * 300 + "\nmore noise"
    (line,) = nb.log_highlights(text, width=60)
    assert len(line) == 60 and line.endswith("...") and "successfully loaded" in line


# ---- metrics ----------------------------------------------------------------------------------------------------
def test_metric_value_matches_family_or_sample_name_and_labels():
    samples = nb.parse_metrics(SAMPLE_METRICS)
    assert samples.loc[samples["family"] == "vllm:num_requests_running", "help"].item() == "Requests running on the engine"
    assert nb.metric_value(samples, "nv_inference_request_success", model="vllm_model") == 7
    assert nb.metric_value(samples, "nv_inference_request_success_total") == 107
    assert nb.metric_value(samples, "vllm:num_requests_running", model="vllm_model", version=1) == 2
    with pytest.raises(KeyError, match="vllm:kv_cache_usage_perc"):
        nb.metric_value(samples, "vllm:kv_cache_usage_perc")


def test_histogram_buckets_are_per_bucket_and_can_subtract_a_baseline():
    samples = nb.parse_metrics(SAMPLE_METRICS)
    table = nb.histogram_buckets(samples, "vllm:e2e_request_latency_seconds", model="vllm_model")
    assert list(table["le"]) == ["0.5", "1", "2.5", "+Inf"]
    assert list(table["count"]) == [1, 3, 1, 0] and table.attrs["count"] == 5 and table.attrs["sum"] == 4.5
    since = nb.histogram_buckets(samples, "vllm:e2e_request_latency_seconds", baseline=nb.parse_metrics(EARLIER_METRICS))
    assert list(since["count"]) == [0, 2, 1, 0] and since.attrs["count"] == 3 and since.attrs["sum"] == 3.0


def test_plot_histogram_draws_one_bar_per_bucket_around_the_used_ones():
    table = nb.histogram_buckets(nb.parse_metrics(SAMPLE_METRICS), "vllm:e2e_request_latency_seconds")
    ax = nb.plot_histogram(table)
    assert [bar.get_height() for bar in ax.patches] == [1, 3, 1, 0]
    assert "5 observations, mean 0.900 s" in ax.get_title()
    since = nb.histogram_buckets(
        nb.parse_metrics(SAMPLE_METRICS), "vllm:e2e_request_latency_seconds", baseline=nb.parse_metrics(EARLIER_METRICS)
    )
    ax = nb.plot_histogram(since)  # nothing in the first bucket: it stays, as the one empty bar before
    assert [bar.get_height() for bar in ax.patches] == [0, 2, 1, 0]
    assert [label.get_text() for label in ax.get_xticklabels()] == ["≤0.5", "≤1", "≤2.5", "+Inf"]


def test_counters_table_reports_what_a_request_did(triton):
    names = ["vllm:request_success_total", "vllm:generation_tokens_total", "nv_inference_request_success"]
    before = nb.quiet_metrics(triton.metrics_url, model="vllm_model")
    _generate(triton.http_url, "The capital of France is", max_tokens=8)
    after = nb.quiet_metrics(triton.metrics_url, model="vllm_model")
    table = nb.counters_table(before, after, names, model="vllm_model")
    assert table["increase"].to_dict() == {
        "vllm:request_success_total": 1,
        "vllm:generation_tokens_total": 8,  # greedy, and the reply is longer than 8 tokens: it stops at max_tokens
        "nv_inference_request_success": 1,
    }
    latency = nb.histogram_buckets(after, "vllm:e2e_request_latency_seconds", baseline=before, model="vllm_model")
    assert latency.attrs["count"] == 1 and latency["count"].sum() == 1 and latency.attrs["sum"] > 0


# ---- model control -----------------------------------------------------------------------------------------------
def test_model_state_of_the_served_model_is_ready(triton):
    assert nb.model_state(triton.http_url, "vllm_model")["state"] == "READY"
    assert nb.wait_model_state(triton.http_url, "vllm_model", ("READY",), timeout=5, progress=False)["state"] == "READY"


def test_reloading_an_unknown_model_fails_before_unloading_anything(triton):
    with pytest.raises(LookupError, match="'no_such_model' is not in the server's repository"):
        nb.reload_model(triton.http_url, "no_such_model", progress=False)
    assert nb.model_state(triton.http_url, "vllm_model")["state"] == "READY"


def test_loading_a_model_missing_from_the_repository_gives_tritons_reason(triton):
    with pytest.raises(RuntimeError, match="could not load 'no_such_model'.*failed to"):
        nb.load_model(triton.http_url, "no_such_model", timeout=30, progress=False)


def test_watch_metrics_samples_gauges_while_traffic_flows(triton):
    names = ["vllm:num_requests_running", "vllm:kv_cache_usage_perc"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        request = pool.submit(_generate, triton.http_url, "Once upon a time", 16)
        series = nb.watch_metrics(triton.metrics_url, names, until=request.done, every=0.2, linger=1.5, model="vllm_model")
    assert list(series.columns) == names and series.index.is_monotonic_increasing
    assert series.index[-1] - series.index[-2] < 1.5 <= series.index[-1]  # kept sampling after the request finished
    assert series["vllm:num_requests_running"].isin([0, 1]).all()
    assert series["vllm:num_requests_running"].iloc[-1] == 0  # drained, and published within the linger


# ---- requests over time ----------------------------------------------------------------------------------------
def test_plot_request_timeline_draws_waiting_and_streaming_per_request():
    from utils.client import StreamResult

    done = StreamResult("a", "0", chunks=["x", "y"], arrival_times=[10.5, 11.0], tokens_per_chunk=[1, 1], start=10.0, finish_reason="length")
    cancelled = StreamResult("b", "1", chunks=["x"], arrival_times=[10.75], tokens_per_chunk=[1], start=10.25, finish_reason="cancelled")
    ax = nb.plot_request_timeline([done, cancelled])
    bars = [(round(p.get_x(), 2), round(p.get_width(), 2)) for p in ax.patches]
    assert bars == [(0.0, 0.5), (0.5, 0.5), (0.25, 0.5), (0.75, 0.0)]
    assert [line.get_color() for line in ax.lines] == ["tab:blue", "tab:red"]
    assert [label.get_text() for label in ax.get_yticklabels()] == ["0", "1"]
    with pytest.raises(ValueError, match="no request"):
        nb.plot_request_timeline([StreamResult("never sent")])
