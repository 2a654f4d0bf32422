"""What the notebooks need beyond the other modules: where results go, a look inside a running server (its
command line and log, found by its port), its Prometheus metrics as tables and bars, and model control
with progress.

Each helper is here rather than in a notebook cell so that it is tested (tests/test_notebook_helpers.py)
and so that the notebooks stay prose plus a few calls.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
import psutil
from prometheus_client.parser import text_string_to_metric_families
from tqdm.auto import tqdm

from utils import paths

# lines of a Triton log worth reading first: ports, model states, our backend's own messages, failures
STARTUP_MARKERS = (
    "Started GRPCInferenceService",
    "Started HTTPService",
    "Started Metrics Service",
    "loading: ",
    "successfully loaded",
    "failed to load",
    "[vllm]",
    "Resolved architecture",
    "KV cache size",
    "Loading weights took",
)


def results_path(results_dir: str | Path = "") -> Path:
    """The folder a notebook saves figures and CSVs into: ``results_dir``, or ``runs/notebooks`` when empty.

    `make tutorial` passes its run folder through papermill; run by hand, results land under the gitignored
    ``runs/`` so that executing a notebook never writes into the repository.
    """
    folder = Path(results_dir) if str(results_dir) else paths.runs_dir() / "notebooks"
    folder.mkdir(parents=True, exist_ok=True)
    return folder.resolve()


def tree(folder: str | Path) -> str:
    """A folder as an indented listing (what `tree` prints), to show a model repository's layout."""
    root = Path(folder)
    lines = [f"{root.name}/"]
    for path in sorted(root.rglob("*")):
        if "__pycache__" in path.parts:
            continue
        depth = len(path.relative_to(root).parts)
        lines.append("    " * depth + path.name + ("/" if path.is_dir() else ""))
    return "\n".join(lines)


def engine_args_table(names: list[str]) -> pd.DataFrame:
    """vLLM's defaults for a few AsyncEngineArgs (the keys of model.json), to read beside our choices."""
    from utils.repository import engine_arg_fields

    fields = engine_arg_fields()
    unknown = [name for name in names if name not in fields]
    if unknown:
        raise KeyError(f"not AsyncEngineArgs fields: {unknown}")
    rows = []
    for name in names:
        field = fields[name]
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        rows.append({"key": name, "vLLM default": None if default is dataclasses.MISSING else default})
    return pd.DataFrame(rows).set_index("key")


# ---- a running server, found by its HTTP port -----------------------------------------------------------
@dataclass
class RunningServer:
    """A ``tritonserver`` process: its pid, its exact command line, its run folder and log (ours keep both)."""

    pid: int
    command: list[str]

    def option(self, name: str) -> str | None:
        """The value of ``--name=value`` on the command line (the last one, as Triton reads it)."""
        values = [arg.split("=", 1)[1] for arg in self.command if arg.startswith(f"--{name}=")]
        return values[-1] if values else None

    @property
    def run_dir(self) -> Path | None:
        backends = self.option("backend-directory")
        return Path(backends).parent if backends else None

    @property
    def log_path(self) -> Path | None:
        """``server.log`` in the run folder that `utils.server.TritonServer` made, if this server has one."""
        log = self.run_dir / "server.log" if self.run_dir else None
        return log if log and log.exists() else None

    @property
    def shm_prefix(self) -> str | None:
        """The Python backend's shared-memory prefix: unique per server, so that several run side by side."""
        found = re.search(r"shm-region-prefix-name=([^,\s]+)", self.option("backend-config") or "")
        return found.group(1) if found else None


def find_server(http_port: int) -> RunningServer:
    """The ``tritonserver`` serving HTTP on ``http_port`` (whoever started it: a test session, `make serve`...).

    The command line is read from the process table, so this works for a shared server that this notebook
    did not start and has no Python object for.
    """
    for proc in psutil.process_iter(["pid", "cmdline"]):
        command = proc.info["cmdline"] or []
        if command and Path(command[0]).name == "tritonserver" and f"--http-port={http_port}" in command:
            return RunningServer(proc.info["pid"], list(command))
    raise LookupError(f"no tritonserver process serves HTTP on port {http_port} (is it started? `make status`)")


def log_highlights(log_text: str, markers: tuple[str, ...] = STARTUP_MARKERS, width: int = 160) -> list[str]:
    """The lines of a Triton log that say what happened (ports, loading, failures), shortened to ``width``."""
    lines = [line.strip() for line in log_text.splitlines() if any(marker in line for marker in markers)]
    return [line if len(line) <= width else line[: width - 3] + "..." for line in lines]


def model_table(log_text: str) -> str:
    """The last model-status table Triton printed (``| Model | Version | Status |``), or '' if none yet."""
    lines = log_text.splitlines()
    headers = [i for i, line in enumerate(lines) if re.match(r"\| Model +\| Version +\| Status", line)]
    if not headers or headers[-1] == 0:
        return ""
    start = end = headers[-1] - 1  # the border above the header
    borders = 0
    while end + 1 < len(lines) and borders < 2:
        end += 1
        borders += lines[end].startswith("+")
    return "\n".join(lines[start : end + 1])


# ---- metrics (Prometheus text format on the metrics port) -------------------------------------------------
def parse_metrics(text: str) -> pd.DataFrame:
    """One row per sample: family, type, help, sample name, labels (a dict, plus model/version/le columns), value.

    ``prometheus_client`` names counter samples ``<family>_total``; the family column keeps the name Triton
    printed, so look metrics up by either.
    """
    rows = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            rows.append(
                {
                    "family": family.name,
                    "type": family.type,
                    "help": family.documentation,
                    "sample": sample.name,
                    "model": labels.get("model"),
                    "version": labels.get("version"),
                    "le": labels.get("le"),
                    "labels": labels,
                    "value": float(sample.value),
                }
            )
    return pd.DataFrame(rows, columns=["family", "type", "help", "sample", "model", "version", "le", "labels", "value"])


def scrape_metrics(metrics_url: str, timeout: float = 10) -> pd.DataFrame:
    """GET the metrics endpoint (``http://host:8002/metrics``) and parse it with `parse_metrics`."""
    with urllib.request.urlopen(metrics_url, timeout=timeout) as reply:
        return parse_metrics(reply.read().decode("utf-8"))


def quiet_metrics(metrics_url: str, timeout: float = 30, every: float = 1.1, **labels: str) -> pd.DataFrame:
    """A scrape taken once the engine is idle and its statistics are all published.

    Idle: nothing running or waiting, and ``vllm:generation_tokens_total`` unchanged between two scrapes
    more than a second apart (our backend publishes vLLM's statistics once a second). Counters compared
    between two quiet scrapes then count exactly the traffic sent in between, not the tail of earlier traffic.
    """
    deadline = time.monotonic() + timeout
    previous = None
    while True:
        samples = scrape_metrics(metrics_url)
        busy = sum(metric_value(samples, name, **labels) for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"))
        tokens = metric_value(samples, "vllm:generation_tokens_total", **labels)
        if busy == 0 and tokens == previous:
            return samples
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine is still busy after {timeout:.0f} s ({busy:.0f} requests running or waiting)")
        previous = tokens
        time.sleep(every)


def _select(samples: pd.DataFrame, name: str, labels: dict[str, str]) -> pd.DataFrame:
    named = samples[(samples["sample"] == name) | ((samples["family"] == name) & (samples["type"] != "histogram"))]
    for key, value in labels.items():
        named = named[named["labels"].map(lambda found, k=key, v=value: found.get(k) == str(v))]
    return named


def metric_value(samples: pd.DataFrame, name: str, **labels: str) -> float:
    """A counter's or gauge's value (summed over the samples whose labels match); KeyError if absent."""
    selected = _select(samples, name, labels)
    if selected.empty:
        raise KeyError(f"no metric {name} with labels {labels} (is the model loaded? has it served a request?)")
    return float(selected["value"].sum())


def counters_table(before: pd.DataFrame, after: pd.DataFrame, names: list[str], **labels: str) -> pd.DataFrame:
    """Each counter before and after some traffic, and by how much it grew: what that traffic did."""
    rows = []
    for name in names:
        start, end = metric_value(before, name, **labels), metric_value(after, name, **labels)
        rows.append({"metric": name, "before": start, "after": end, "increase": end - start})
    return pd.DataFrame(rows).set_index("metric")


def watch_metrics(
    metrics_url: str,
    names: list[str],
    until: Callable[[], bool],
    every: float = 0.5,
    linger: float = 0.0,
    **labels: str,
) -> pd.DataFrame:
    """Scrape ``names`` (gauges, say) every ``every`` seconds until ``until()`` is true, then ``linger`` more.

    Gauges such as ``vllm:num_requests_running`` only mean something while traffic flows; sampling them
    during a burst shows the batch filling and draining. Metrics are published with a delay (our backend
    flushes vLLM's statistics once a second), hence ``linger``. One row per scrape, ``t`` in seconds.
    """
    rows = []
    started = time.monotonic()
    done_at = None
    while True:
        samples = scrape_metrics(metrics_url)
        now = time.monotonic()
        rows.append({"t": now - started, **{name: metric_value(samples, name, **labels) for name in names}})
        if done_at is None and until():
            done_at = now
        if done_at is not None and now - done_at >= linger:
            return pd.DataFrame(rows).set_index("t")
        time.sleep(every)


def histogram_buckets(samples: pd.DataFrame, family: str, baseline: pd.DataFrame | None = None, **labels: str) -> pd.DataFrame:
    """A histogram's buckets as a table: upper bound ``le``, cumulative count, and the count in each bucket.

    Prometheus buckets are cumulative (``le="0.5"`` counts every observation <= 0.5 s); the per-bucket
    column is their difference, which is what a bar chart shows. With ``baseline`` (an earlier scrape) only
    the observations made since then are counted. ``.attrs`` holds ``count`` and ``sum`` (so the mean).
    """

    def cumulative(source: pd.DataFrame) -> pd.Series:
        buckets = _select(source, f"{family}_bucket", labels)
        if buckets.empty:
            raise KeyError(f"no histogram {family} with labels {labels}")
        return buckets.groupby("le")["value"].sum()

    counts = cumulative(samples)
    count, total = metric_value(samples, f"{family}_count", **labels), metric_value(samples, f"{family}_sum", **labels)
    if baseline is not None:
        counts = counts - cumulative(baseline).reindex(counts.index, fill_value=0)
        count -= metric_value(baseline, f"{family}_count", **labels)
        total -= metric_value(baseline, f"{family}_sum", **labels)
    table = pd.DataFrame({"le": counts.index, "cumulative": counts.values})
    table["upper"] = table["le"].astype(float)
    table = table.sort_values("upper").reset_index(drop=True)
    table["count"] = table["cumulative"].diff().fillna(table["cumulative"]).astype(int)
    table["cumulative"] = table["cumulative"].astype(int)
    table.attrs.update(family=family, count=int(count), sum=float(total))
    return table[["le", "upper", "cumulative", "count"]]


def plot_histogram(buckets: pd.DataFrame, ax=None, title: str | None = None, unit: str = "s"):
    """Bars, one per bucket, labelled by upper bound; empty buckets far from any observation are left out."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    used = buckets.index[buckets["count"] > 0]
    first, last = (used.min(), used.max()) if len(used) else (0, 0)
    shown = buckets.loc[max(first - 1, 0) : min(last + 1, len(buckets) - 1)]  # one empty bucket each side
    labels = [f"≤{le}" if le != "+Inf" else "+Inf" for le in shown["le"]]
    ax.bar(range(len(shown)), shown["count"], color="tab:blue", width=0.8)
    ax.set_xticks(range(len(shown)), labels, rotation=45, ha="right")
    ax.set_xlabel(f"bucket (upper bound, {unit})")
    ax.set_ylabel("requests")
    count, total = buckets.attrs.get("count", 0), buckets.attrs.get("sum", 0.0)
    mean = f", mean {total / count:.3f} {unit}" if count else ""
    ax.set_title(title or f"{buckets.attrs.get('family', '')} ({count} observations{mean})")
    return ax


# ---- requests over time -----------------------------------------------------------------------------------
def plot_request_timeline(results, ax=None, title: str | None = None):
    """One row per request: waiting for the first response (grey), then streaming (a bar, a dot per response).

    ``results`` are `utils.client.StreamResult` objects (``start`` and ``arrival_times`` in
    ``time.perf_counter`` seconds); time 0 is the earliest start. Requests that did not finish normally
    (cancelled, timed out, failed) are drawn in red, so concurrency, queueing and cancellation show at a glance.
    """
    import matplotlib.pyplot as plt

    results = [r for r in results if r.start is not None]
    if not results:
        raise ValueError("no request was sent")
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.35 * len(results) + 1.2))
    origin = min(r.start for r in results)
    for row, result in enumerate(results):
        start = result.start - origin
        arrivals = [t - origin for t in result.arrival_times]
        color = "tab:blue" if result.ok else "tab:red"
        first = arrivals[0] if arrivals else start
        ax.barh(row, first - start, left=start, color="lightgrey", height=0.6)
        if arrivals:
            ax.barh(row, arrivals[-1] - first, left=first, color=color, alpha=0.35, height=0.6)
            ax.plot(arrivals, [row] * len(arrivals), "|", color=color, markersize=7)
    ax.set_yticks(range(len(results)), [r.request_id or str(i) for i, r in enumerate(results)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first request was sent")
    ax.set_ylabel("request")
    ax.set_title(title or "grey: waiting for the first response; bar: streaming (| = one response)")
    return ax


# ---- model control (the server runs with --model-control-mode=explicit) ----------------------------------
def model_state(http_url: str, model: str) -> dict:
    """The repository index entry of ``model``: ``state`` READY, LOADING, UNLOADING or UNAVAILABLE (+ reason)."""
    import tritonclient.http as httpclient

    with httpclient.InferenceServerClient(http_url) as client:
        for entry in client.get_model_repository_index():
            if entry["name"] == model:
                return entry
    raise LookupError(f"model '{model}' is not in the server's repository")


def wait_model_state(http_url: str, model: str, states: tuple[str, ...], timeout: float = 120, progress: bool = True) -> dict:
    """Poll the repository index until ``model`` is in one of ``states``; a bar shows the time and state."""
    deadline = time.monotonic() + timeout
    with tqdm(total=None, desc=f"waiting for {'/'.join(states)}", unit="s", disable=not progress, leave=False) as bar:
        started = time.monotonic()
        while True:
            entry = model_state(http_url, model)
            if entry.get("state") in states:
                return entry
            if time.monotonic() > deadline:
                raise TimeoutError(f"'{model}' is still {entry.get('state')} after {timeout:.0f} s (wanted {states})")
            bar.set_postfix_str(str(entry.get("state")), refresh=False)
            bar.update(round(time.monotonic() - started) - bar.n)
            time.sleep(0.5)


def unload_model(http_url: str, model: str = "vllm_model", timeout: float = 300, progress: bool = True) -> float:
    """Unload ``model`` and wait until Triton reports it UNAVAILABLE; returns the seconds it took.

    ``unload_model`` returns at once: Triton lets in-flight requests finish, then calls the backend's
    ``finalize`` (which stops the vLLM engine and frees its memory). An unknown name raises LookupError
    before anything is unloaded.
    """
    import tritonclient.http as httpclient

    model_state(http_url, model)
    started = time.monotonic()
    with httpclient.InferenceServerClient(http_url) as client:
        client.unload_model(model)
    wait_model_state(http_url, model, ("UNAVAILABLE",), timeout=timeout, progress=progress)
    return time.monotonic() - started


def load_model(http_url: str, model: str = "vllm_model", timeout: float = 900, progress: bool = True) -> float:
    """Load ``model`` and return once it is ready (about 40 s on CPU); returns the seconds it took.

    ``load_model`` blocks until the engine is up, so it runs on a thread (with a client of its own: the
    HTTP client is gevent-based and cannot be shared between threads) while a bar shows the time. A model
    that cannot load raises RuntimeError with Triton's reason (the server log has the details).
    """
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    def load() -> None:
        with httpclient.InferenceServerClient(http_url, connection_timeout=timeout, network_timeout=timeout) as client:
            client.load_model(model)

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        loading = pool.submit(load)
        with tqdm(total=None, desc=f"loading {model}", unit="s", disable=not progress, leave=False) as bar:
            while not loading.done():
                time.sleep(0.5)
                bar.update(round(time.monotonic() - started) - bar.n)
        try:
            loading.result()
        except InferenceServerException as err:
            raise RuntimeError(f"Triton could not load '{model}': {err.message()}") from None
    state = model_state(http_url, model)
    if state.get("state") != "READY":
        raise RuntimeError(f"'{model}' loaded but is not ready: {state}")
    return time.monotonic() - started


def reload_model(http_url: str, model: str = "vllm_model", timeout: float = 900, progress: bool = True) -> dict[str, float]:
    """`unload_model` then `load_model`: a fresh engine (new model.json settings, say); returns both timings."""
    unload_s = unload_model(http_url, model, timeout=timeout, progress=progress)
    return {"unload_s": unload_s, "load_s": load_model(http_url, model, timeout=timeout, progress=progress)}
