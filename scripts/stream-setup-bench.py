"""What a gRPC stream per request costs: Triton and a Python model that only answers, no engine.

The same requests three ways, alternated over rounds in one run: `utils.client.stream_one` (a
``stream_infer`` call per request), `utils.client.StreamPool` (a client's requests on one stream kept
open) and HTTP ``generate_stream`` on kept-alive connections. Prints requests/s, TTFT p50, and the CPU
time per request of this client and of Triton (its stub included).

    .venv/bin/python scripts/stream-setup-bench.py --seconds 4 --rounds 2 --clients 1,16
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import aiohttp
import pandas as pd
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from utils import client  # noqa: E402
from utils.server import TritonServer  # noqa: E402

CONFIG = """
name: "echo"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "text_input" data_type: TYPE_STRING dims: [1] },
  { name: "stream" data_type: TYPE_BOOL dims: [1] optional: true },
  { name: "exclude_input_in_output" data_type: TYPE_BOOL dims: [1] optional: true },
  { name: "return_finish_reason" data_type: TYPE_BOOL dims: [1] optional: true },
  { name: "return_num_output_tokens" data_type: TYPE_BOOL dims: [1] optional: true }
]
output [
  { name: "text_output" data_type: TYPE_STRING dims: [-1] },
  { name: "finish_reason" data_type: TYPE_STRING dims: [-1] },
  { name: "num_output_tokens" data_type: TYPE_UINT32 dims: [-1] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils

RESPONSES = 4


class TritonPythonModel:
    """Answers every request with RESPONSES responses of one token each, the last one final."""

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            for i in range(RESPONSES):
                last = i == RESPONSES - 1
                outputs = [
                    pb_utils.Tensor("text_output", np.array([b" tok"], dtype=np.object_)),
                    pb_utils.Tensor("finish_reason", np.array([b"length" if last else b""], dtype=np.object_)),
                    pb_utils.Tensor("num_output_tokens", np.array([1], dtype=np.uint32)),
                ]
                sender.send(pb_utils.InferenceResponse(outputs), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0)
        return None
'''


def write_repository(root: Path) -> Path:
    version = root / "echo" / "1"
    version.mkdir(parents=True)
    (root / "echo" / "config.pbtxt").write_text(CONFIG)
    (version / "model.py").write_text(textwrap.dedent(MODEL))
    return root


async def grpc_per_request(grpc_client, deadline: float, ttfts: list[float]) -> None:
    while time.perf_counter() < deadline:
        result = await client.stream_one(grpc_client, "hi", model="echo")
        ttfts.append(result.ttft)


async def grpc_kept_open(pool: client.StreamPool, deadline: float, ttfts: list[float]) -> None:
    while time.perf_counter() < deadline:
        result = await pool.stream_one("hi", model="echo")
        ttfts.append(result.ttft)


async def http_kept_alive(session: aiohttp.ClientSession, url: str, deadline: float, ttfts: list[float]) -> None:
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        first = None
        async with session.post(url, json={"text_input": "hi", "stream": True}) as response:
            async for line in response.content:
                if first is None and line.startswith(b"data:"):
                    first = time.perf_counter() - start
        ttfts.append(first)


def cpu_seconds(process: psutil.Process) -> float:
    """User and system time of a process and its children (Triton's Python stub)."""
    return sum(sum(p.cpu_times()[:2]) for p in [process, *process.children(recursive=True)])


async def measure(server: TritonServer, clients: list[int], seconds: float, rounds: int) -> pd.DataFrame:
    triton = psutil.Process(server.process.pid)
    url = f"http://{server.http_url}/v2/models/echo/generate_stream"
    rows = []
    async with (
        client.grpcclient.InferenceServerClient(server.grpc_url) as grpc_client,
        client.StreamPool(grpc_client, server.grpc_url) as pool,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session,
    ):
        methods = {
            "gRPC, a stream per request": lambda deadline, ttfts: grpc_per_request(grpc_client, deadline, ttfts),
            "gRPC, streams kept open": lambda deadline, ttfts: grpc_kept_open(pool, deadline, ttfts),
            "HTTP generate_stream": lambda deadline, ttfts: http_kept_alive(session, url, deadline, ttfts),
        }
        for count in clients:
            for round_ in range(rounds):
                for name, method in methods.items():
                    ttfts: list[float] = []
                    server_before, client_before = cpu_seconds(triton), time.process_time()
                    deadline = time.perf_counter() + seconds
                    await asyncio.gather(*(method(deadline, ttfts) for _ in range(count)))
                    n = len(ttfts)
                    rows.append({
                        "clients": count, "round": round_ + 1, "method": name, "requests_per_s": n / seconds,
                        "ttft_p50_ms": 1e3 * statistics.median(ttfts),
                        "client_cpu_ms_per_request": 1e3 * (time.process_time() - client_before) / n,
                        "server_cpu_ms_per_request": 1e3 * (cpu_seconds(triton) - server_before) / n,
                    })  # fmt: skip
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="per method, round and client count")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", default="1,16", help="closed-loop client counts, comma-separated")
    parser.add_argument("--csv", type=Path, help="also write every round's figures to this CSV")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="echo-") as tmp:
        with TritonServer(write_repository(Path(tmp) / "repository"), run_dir=Path(tmp) / "run", free_ports=True) as server:
            server.wait_ready()
            table = asyncio.run(measure(server, [int(c) for c in args.clients.split(",")], args.seconds, args.rounds))
    if args.csv:
        table.to_csv(args.csv, index=False)
    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", None)
    print(table.round(3).to_string(index=False))
    print(table.groupby(["clients", "method"], sort=False).mean(numeric_only=True).drop(columns="round").round(3))


if __name__ == "__main__":
    main()
