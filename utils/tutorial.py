"""`make tutorial`: prepare the model, start Triton, run the notebooks in order, stop, say where results are.

A first `generate` call checks the setup; then the notebooks are executed headless with papermill into
``runs/tutorial-<time>/`` (executed copies, figures, CSVs), all against one server.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

from utils import paths
from utils.model import prepare_default_model
from utils.server import ensure_server, free_port

SMOKE_PROMPT = "The capital of France is"


def smoke(http_url: str) -> str:
    body = json.dumps({"text_input": SMOKE_PROMPT, "max_tokens": 16, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://{http_url}/v2/models/vllm_model/generate", data=body)
    with urllib.request.urlopen(request, timeout=300) as reply:
        return json.loads(reply.read())["text_output"]


def notebooks() -> list[Path]:
    return sorted((paths.PROJECT_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def run_notebooks(out_dir: Path, parameters: dict) -> list[tuple[str, float]]:
    import papermill

    timings = []
    for notebook in notebooks():
        started = time.monotonic()
        papermill.execute_notebook(
            str(notebook), str(out_dir / notebook.name), parameters=parameters, cwd=str(out_dir), kernel_name="python3"
        )
        timings.append((notebook.name, time.monotonic() - started))
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.tutorial", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="run folder (default runs/tutorial-<time>)")
    args = parser.parse_args(argv)
    out_dir = (args.out or paths.runs_dir() / f"tutorial-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"model: {prepare_default_model()}")
    handle = ensure_server(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    handle.export()
    try:
        print(f"Triton ready: http {handle.http_url}, grpc {handle.grpc_url}, metrics {handle.metrics_url}")
        reply = smoke(handle.http_url)  # one request first: a broken setup fails here, in a second
        (out_dir / "smoke.txt").write_text(reply + "\n")
        print(f"generate: {reply!r}")
        for name, seconds in run_notebooks(out_dir, {"results_dir": str(out_dir)}):
            print(f"  {name}: {seconds:.0f} s")
    finally:
        handle.stop()
    print(f"results: {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
