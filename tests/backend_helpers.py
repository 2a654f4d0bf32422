"""Small tritonclient wrappers the backend tests share: one request, one stream, a burst of streams."""

from __future__ import annotations

import asyncio
import json
import queue
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import psutil
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient

MODEL = "vllm_model"


def generate(http_url: str, payload: dict, timeout: float = 300) -> tuple[int, dict]:
    """POST /generate; returns (HTTP status, JSON body) for successes and errors alike."""
    request = urllib.request.Request(f"http://{http_url}/v2/models/{MODEL}/generate", data=json.dumps(payload).encode())
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def inputs_for(prompt, *, stream=False, sampling=None, **flags) -> list:
    raw = prompt if isinstance(prompt, bytes) else str(prompt).encode()
    tensors = [("text_input", np.array([raw], dtype=np.object_), "BYTES")]
    tensors.append(("stream", np.array([stream]), "BOOL"))
    if sampling is not None:
        text = sampling if isinstance(sampling, str) else json.dumps(sampling)
        tensors.append(("sampling_parameters", np.array([text.encode()], dtype=np.object_), "BYTES"))
    for name, value in flags.items():
        tensors.append((name, np.array([value]), "BOOL"))
    inputs = []
    for name, array, dtype in tensors:
        item = grpcclient.InferInput(name, list(array.shape), dtype)
        item.set_data_from_numpy(array)
        inputs.append(item)
    return inputs


@dataclass
class Streamed:
    texts: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)


def _record(streamed: Streamed, result) -> None:
    streamed.texts.append(result.as_numpy("text_output")[0].decode())
    if result.as_numpy("num_output_tokens") is not None:
        streamed.tokens.append(int(result.as_numpy("num_output_tokens")[0]))
    if result.as_numpy("finish_reason") is not None:
        streamed.finish_reasons.append(result.as_numpy("finish_reason")[0].decode())


def stream(
    grpc_url: str, prompt, *, sampling=None, stream_mode=True, timeout=300, answered: threading.Event | None = None, **flags
) -> Streamed:
    """One request on a sync gRPC stream, read until Triton's final flag (an empty final response); ``answered``
    is set at its first response, text or error (the request has reached the engine, or will never)."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    flags.setdefault("return_num_output_tokens", True)
    flags.setdefault("return_finish_reason", True)
    client.async_stream_infer(
        MODEL, inputs_for(prompt, stream=stream_mode, sampling=sampling, **flags), enable_empty_final_response=True
    )
    out = Streamed()
    deadline = time.monotonic() + timeout
    finished = False
    try:
        while True:
            result, error = responses.get(timeout=max(0.1, deadline - time.monotonic()))
            if answered is not None:
                answered.set()
            if error is not None:  # an error response is the request's last: the server has completed it
                out.error = str(error)
                finished = True
                break
            final = result.get_response().parameters["triton_final_response"].bool_param
            if result.as_numpy("text_output") is not None:
                _record(out, result)
            if final:
                finished = True
                break
    finally:
        # cancelling a call whose request is complete keeps Triton 2.51 from unloading the model later
        client.stop_stream(cancel_requests=not finished)
        client.close()
    return out


async def aio_stream(client, prompt: str, sampling: dict, **flags) -> Streamed:
    """One request on its own aio stream, read until Triton closes it (never cancelled once complete)."""
    out = Streamed()

    async def requests():
        yield {"model_name": MODEL, "inputs": inputs_for(prompt, stream=True, sampling=sampling, **flags)}

    async for result, error in client.stream_infer(requests()):
        if error is not None:
            out.error = str(error)
            continue
        _record(out, result)
    return out  # read to the end of the call: Triton closes it after the last response


async def burst(grpc_url: str, prompts: list[str], sampling: dict) -> list[Streamed]:
    client = aioclient.InferenceServerClient(grpc_url)
    try:
        flags = {"return_num_output_tokens": True, "return_finish_reason": True}
        return await asyncio.gather(*(aio_stream(client, p, sampling, **flags) for p in prompts))
    finally:
        await client.close()


def is_continuation(text: str, prompt: str) -> bool:
    """The reply is the prompt followed by new text (what greedy decoding yields in any dtype)."""
    return text.startswith(prompt) and len(text.strip()) > len(prompt)


def context_length(http_url: str) -> int:
    """The engine's max_model_len, as the server states it when asked for more than it can hold.

    Asking the server works for any server, the session's own or one shared through TUTORIAL_TRITON.
    """
    _, body = generate(http_url, {"text_input": "Hi", "max_tokens": 10**9})
    match = re.search(r"model's context of (\d+) tokens", body.get("error", ""))
    assert match, body
    return int(match.group(1))


def metrics(metrics_url: str) -> dict[str, float]:
    """Prometheus text parsed into {'name{labels}': value}."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        match = re.match(r"^([^#\s][^\s]*)\s+([-+0-9.eEnaNinf]+)$", line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


def metric(values: dict[str, float], name: str) -> float:
    """Sum of a metric over its label sets."""
    return sum(v for k, v in values.items() if k == name or k.startswith(name + "{"))


def engine_processes(server) -> list[psutil.Process]:
    """The vLLM engine core processes under ``server`` (a TritonServer): vLLM names them VLLM::EngineCore."""
    children = psutil.Process(server.process.pid).children(recursive=True)
    return [p for p in children if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name()]


def post(url: str, body: dict | None = None, timeout: float = 300) -> int:
    """POST ``body`` as JSON (Triton's repository API); the HTTP status."""
    request = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code


def model_state(server) -> str:
    """vllm_model's state in ``server``'s repository index (READY, UNAVAILABLE, ...; '' when not listed)."""
    request = urllib.request.Request(f"http://{server.http_url}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=30) as reply:
        entries = json.loads(reply.read())
    return next((e.get("state", "") for e in entries if e["name"] == "vllm_model"), "")
