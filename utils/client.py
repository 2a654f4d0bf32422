"""Talk to the Triton server: the HTTP ``generate`` endpoints, an asyncio gRPC streaming client, a CLI.

- HTTP: `generate` (one JSON reply), `generate_stream` (server-sent events, one per response) and
  `curl_command` (the same call as a ``curl`` line, for a notebook's ``!``).
- gRPC: `stream_one` sends one request on its own ``stream_infer`` call and records every response's
  arrival time (``time.perf_counter``) and token count; `stream_many` runs many of them concurrently;
  `run_many` does the same from synchronous code, Jupyter included. One gRPC stream per request, so a
  request can be cancelled (or time out) without touching the others. `StreamPool` keeps streams open
  for one request after another instead (a client's requests on one stream, as HTTP keeps a connection
  alive): cheaper on both sides, and what ``utils.bench`` loads the server through, with `check_model`.
- ``python -m utils.client``: NVIDIA's sample client (vllm_backend ``samples/client.py``), same flags.

Errors a learner will meet (no server, wrong port, unknown model, model still loading, a request the
backend refuses) are raised as a `ClientError` subclass whose message says what to do.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
import re
import shlex
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np
import requests
import tritonclient.grpc.aio as grpcclient
from tqdm.auto import tqdm
from tritonclient.utils import InferenceServerException

from utils import server

if TYPE_CHECKING:
    import pandas as pd

DEFAULT_MODEL = "vllm_model"
DEFAULT_HTTP_URL = f"127.0.0.1:{server.DEFAULT_PORTS['http']}"
DEFAULT_GRPC_URL = f"127.0.0.1:{server.DEFAULT_PORTS['grpc']}"
# what NVIDIA's sample client sends; max_tokens is ours (vLLM's default of 16 cuts answers short)
SAMPLE_SAMPLING = {"temperature": 0.1, "top_p": 0.95}
RESULT_SEPARATOR = "\n=========\n\n"
T = TypeVar("T")


# ---- errors ---------------------------------------------------------------------------------------
class ClientError(RuntimeError):
    """A request that could not be served; the message says why in words a learner can act on."""


class ServerNotRunning(ClientError):
    """Nothing accepts connections at the address: no server, one still starting, or the wrong port."""


class WrongPort(ClientError):
    """Something answers at the address, but not in the protocol asked for (HTTP on the gRPC port...)."""


class UnknownModel(ClientError):
    """The server has no model (or no version) by that name."""

    def __init__(self, message: str, available: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.available = list(available)


class ModelNotReady(ClientError):
    """The server knows the model, but no version of it is ready: loading, unloaded or failed to load."""


class GenerationError(ClientError):
    """The backend refused or failed a request (a bad parameter, a prompt too long, a dead engine)."""


class RequestTimeout(ClientError):
    """No complete reply in the time allowed."""


# ---- explaining what went wrong ------------------------------------------------------------------------
_UNKNOWN_MODEL = re.compile(r"unknown model: '[^']*'(?: version \S+)? is not found")
_MODEL_NOT_READY = re.compile(r"has no available versions|is not at ready state")
# how requests (HTTP) and grpc report a peer that answered in another protocol
_WRONG_PROTOCOL_SIGNS = ("badstatusline", "remotedisconnected", "connection aborted", "connection reset", "socket closed")
_CPU_SPEED_HINT = "generation on CPU runs at roughly 20-40 tokens/s: lower max_tokens or allow more time"


def _host_port(url: str) -> tuple[str, str]:
    address = url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = address.rpartition(":")
    return host or address, port


def _answering_server(protocol: str, url: str) -> str | None:
    """The address of a Triton server that does answer (the session's, or one on the default ports)."""
    found = []
    shared = server.shared_server()
    if shared is not None:
        found.append(shared.http_url if protocol == "http" else shared.grpc_url)
    if server.http_ready(DEFAULT_HTTP_URL, timeout=1.0):
        found.append(DEFAULT_HTTP_URL if protocol == "http" else DEFAULT_GRPC_URL)
    asked = ":".join(_host_port(url))
    return next((address for address in found if address != asked), None)


def connection_problem(url: str, protocol: str, detail: str) -> ClientError:
    """Explain a failed connection: refused (`ServerNotRunning`), answered in another protocol (`WrongPort`).

    ``protocol`` is "http" or "grpc"; ``detail`` is the library's own description of the failure.
    """
    host, port = _host_port(url)
    name = "HTTP" if protocol == "http" else "gRPC"
    other = _answering_server(protocol, url)
    suggestion = f" A Triton server answers {name} on {other}: pass url={other!r}." if other else ""
    defaults = "Triton's default ports are 8000 (HTTP), 8001 (gRPC) and 8002 (metrics)."
    if "refused" in detail.lower():
        return ServerNotRunning(
            f"Nothing accepts connections on {host}:{port} ({name}).{suggestion} {defaults} "
            "If no server is running, start one: `make serve` in a terminal, or `utils.server.ensure_server()` "
            "in Python. Triton opens its ports only once its model has loaded (about a minute on CPU)."
        )
    if not any(sign in detail.lower() for sign in _WRONG_PROTOCOL_SIGNS):
        return ClientError(f"Cannot reach {host}:{port} ({name}): {detail}. Check the address. {defaults}")
    if protocol == "http":
        guess = "This looks like a gRPC port (Triton's gRPC default is 8001); the HTTP client needs the HTTP port."
    else:
        guess = "This looks like an HTTP port (Triton's HTTP default is 8000); the gRPC client needs the gRPC port."
    return WrongPort(f"{host}:{port} answered, but not in {name}. {guess}{suggestion} {defaults}")


def is_model_problem(message: str) -> bool:
    """Whether Triton's error message is one of its "unknown model" replies (missing, or no version ready)."""
    return bool(_UNKNOWN_MODEL.search(message) or _MODEL_NOT_READY.search(message))


def model_problem(model: str, message: str, index: Iterable[Mapping[str, Any]]) -> UnknownModel | ModelNotReady:
    """Turn one of Triton's "unknown model" replies (see `is_model_problem`) into an explained error.

    ``index`` is the repository index (``POST /v2/repository/index``): it tells a model that is not in
    the repository from one that is but is not loaded, and lists what the server does serve.
    """
    unknown = _UNKNOWN_MODEL.search(message)
    entries = list(index)
    ready = sorted({entry["name"] for entry in entries if entry.get("state") == "READY"})
    serving = ", ".join(ready) or "no model"
    mine = [entry for entry in entries if entry.get("name") == model]
    if unknown and not mine:
        return UnknownModel(
            f"The server has no model named '{model}'. It serves: {serving} (its repository index, "
            "POST /v2/repository/index, lists them). Check the spelling, or add the model to the repository "
            "and load it.",
            ready,
        )
    return ModelNotReady(_not_ready_message(model, mine))


def _not_ready_message(model: str, entries: list[Mapping[str, Any]]) -> str:
    states = {entry.get("state", "") for entry in entries}
    load = f"POST /v2/repository/models/{model}/load"
    if "LOADING" in states:
        return (
            f"Model '{model}' is still loading (vLLM's engine takes about a minute to start on CPU): wait and "
            f"retry; GET /v2/models/{model}/ready answers 200 once it is ready."
        )
    reasons = "; ".join(entry["reason"] for entry in entries if entry.get("reason"))
    if entries:
        return (
            f"Model '{model}' is in the repository but not loaded ({reasons or 'never loaded'}). Load it with "
            f"{load} (or the client's load_model), then retry; the server log says why a load failed."
        )
    return (
        f"The server knows model '{model}' but none of its versions is ready: it is still loading (wait and "
        f"retry; GET /v2/models/{model}/ready answers 200 once it is), or it was unloaded or failed to load "
        f"(the server log says which; load it again with {load})."
    )


def _backend_error(message: str) -> GenerationError:
    return GenerationError(f"The server refused the request: {message}")


# ---- HTTP ---------------------------------------------------------------------------------------------
def _http_url(url: str, path: str) -> str:
    base = url if url.startswith(("http://", "https://")) else f"http://{url}"
    return base.rstrip("/") + path


def request_body(
    prompt: str, sampling: Mapping[str, Any], exclude_input_in_output: bool | None = None, stream: bool = False
) -> dict[str, Any]:
    """The JSON of a generate call: Triton maps keys named like an input to that input, the rest to parameters.

    So ``stream`` and ``exclude_input_in_output`` (and ``return_*``) become the backend's BOOL inputs,
    while ``max_tokens``, ``temperature``... arrive as request parameters, which the backend reads as
    sampling parameters.
    """
    body: dict[str, Any] = {"text_input": prompt, **sampling}
    if exclude_input_in_output is not None:
        body["exclude_input_in_output"] = exclude_input_in_output
    if stream:
        body["stream"] = True
    return body


def _index_over_http(url: str) -> list[dict]:
    try:
        reply = requests.post(_http_url(url, "/v2/repository/index"), json={}, timeout=10)
        return reply.json() if reply.ok else []
    except (requests.RequestException, ValueError):
        return []


def _error_text(reply: requests.Response) -> str:
    """Triton's error message, whether the body is JSON or (generate_stream) one server-sent event."""
    text = reply.text.strip()
    payload = text[len("data:"):] if text.startswith("data:") else text
    try:
        return str(json.loads(payload.splitlines()[0] if payload else "{}").get("error") or text)
    except (ValueError, AttributeError):
        return text[:300] or f"HTTP {reply.status_code}"


def _post(url: str, model: str, endpoint: str, body: dict, timeout: float, stream: bool) -> requests.Response:
    """POST a generate call; every failure comes back as an explained `ClientError`."""
    try:
        reply = requests.post(_http_url(url, f"/v2/models/{model}/{endpoint}"), json=body, timeout=timeout, stream=stream)
    except requests.ConnectionError as err:
        raise connection_problem(url, "http", str(err)) from None
    except requests.Timeout:
        raise RequestTimeout(f"No reply from {url} within {timeout:g} s: {_CPU_SPEED_HINT}.") from None
    if reply.status_code != 200:
        message = _error_text(reply)
        reply.close()
        if is_model_problem(message):
            raise model_problem(model, message, _index_over_http(url))
        raise _backend_error(message)
    return reply


def generate(
    prompt: str,
    *,
    url: str = DEFAULT_HTTP_URL,
    model: str = DEFAULT_MODEL,
    exclude_input_in_output: bool | None = None,
    timeout: float = 300,
    **sampling: Any,
) -> dict:
    """``POST /v2/models/{model}/generate``: the reply's JSON, the text in ``"text_output"``.

    ``sampling`` holds vLLM's sampling parameters (``max_tokens`` defaults to 16 in vLLM) and, if wanted,
    the backend's ``return_finish_reason=True``-style flags. The reply holds the prompt followed by the
    completion unless ``exclude_input_in_output=True``. ``timeout``: seconds to wait for the reply.
    """
    body = request_body(prompt, sampling, exclude_input_in_output)
    with _post(url, model, "generate", body, timeout, stream=False) as reply:
        return reply.json()


def sse_events(lines: Iterable[str]) -> Iterator[dict]:
    """Decode server-sent events (``data: {...}`` lines); an ``{"error": ...}`` event raises `GenerationError`.

    Triton reports a failure that happens after the first response inside the stream, under HTTP 200,
    so an error event must be raised here rather than yielded as if it were text.
    """
    for line in lines:
        if not line.startswith("data:"):
            continue
        event = json.loads(line[len("data:"):])
        if "error" in event:
            raise _backend_error(event["error"])
        yield event


def generate_stream(
    prompt: str,
    *,
    url: str = DEFAULT_HTTP_URL,
    model: str = DEFAULT_MODEL,
    exclude_input_in_output: bool | None = None,
    timeout: float = 300,
    **sampling: Any,
) -> Iterator[dict]:
    """``POST /v2/models/{model}/generate_stream``: one event (a dict) per response, as it arrives.

    Responses carry deltas: the first is prefixed with the prompt unless ``exclude_input_in_output``,
    so the deltas joined equal `generate`'s text. ``timeout`` bounds the wait for each next event.
    """
    body = request_body(prompt, sampling, exclude_input_in_output, stream=True)
    with _post(url, model, "generate_stream", body, timeout, stream=True) as reply:
        try:
            yield from sse_events(reply.iter_lines(decode_unicode=True))
        except requests.ConnectionError as err:  # requests reports a read timeout mid-stream as this, too
            if "timed out" in str(err).lower():
                raise RequestTimeout(f"The stream from {url} sent nothing for {timeout:g} s: {_CPU_SPEED_HINT}.") from None
            raise ClientError(f"The connection to {url} broke mid-stream ({err}): did the server stop?") from None


def curl_command(
    prompt: str,
    *,
    url: str = DEFAULT_HTTP_URL,
    model: str = DEFAULT_MODEL,
    stream: bool = False,
    exclude_input_in_output: bool | None = None,
    **sampling: Any,
) -> str:
    """The `generate` (or, with ``stream``, `generate_stream`) call as one shell-quoted ``curl`` line."""
    endpoint = "generate_stream" if stream else "generate"
    body = json.dumps(request_body(prompt, sampling, exclude_input_in_output, stream=stream))
    options = "-sS -N" if stream else "-sS"
    return f"curl {options} -X POST {_http_url(url, f'/v2/models/{model}/{endpoint}')} -d {shlex.quote(body)}"


# ---- gRPC: one request, one stream ----------------------------------------------------------------------
def _input(name: str, value: Any, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], datatype)
    if datatype == "BYTES":
        tensor.set_data_from_numpy(np.array([str(value).encode("utf-8")], dtype=np.object_))
    else:
        tensor.set_data_from_numpy(np.array([value], dtype=bool))
    return tensor


def build_inputs(
    prompt: str, stream: bool, sampling: Mapping[str, Any] | None = None, exclude_input: bool = False
) -> list[grpcclient.InferInput]:
    """The inputs of one request, finish reason and token counts requested.

    ``return_finish_reason`` is what tells the client a request is over: the aio client cannot ask for
    Triton's empty final response, and only the last response carries a non-empty finish reason.
    """
    inputs = [
        _input("text_input", prompt, "BYTES"),
        _input("stream", stream, "BOOL"),
        _input("exclude_input_in_output", exclude_input, "BOOL"),
        _input("return_finish_reason", True, "BOOL"),
        _input("return_num_output_tokens", True, "BOOL"),
    ]
    if sampling:
        inputs.append(_input("sampling_parameters", json.dumps(dict(sampling)), "BYTES"))
    return inputs


@dataclass
class StreamResult:
    """One request's responses as they arrived; times are ``time.perf_counter()`` seconds.

    ``finish_reason`` is the server's ("stop", "length", "abort") or the client's ("cancelled",
    "timeout", "error"); ``error`` holds the explained failure, if any.
    """

    prompt: str
    request_id: str = ""
    chunks: list[str] = field(default_factory=list)
    arrival_times: list[float] = field(default_factory=list)
    tokens_per_chunk: list[int] = field(default_factory=list)
    start: float | None = None
    finish_reason: str = ""
    error: ClientError | None = None

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    @property
    def output_tokens(self) -> int:
        return sum(self.tokens_per_chunk)

    @property
    def ttft(self) -> float:
        """Time to first response (to the whole reply when not streaming); NaN if nothing arrived."""
        return self.arrival_times[0] - self.start if self.arrival_times and self.start is not None else math.nan

    @property
    def e2e(self) -> float:
        """Time from sending to the last response; NaN if nothing arrived."""
        return self.arrival_times[-1] - self.start if self.arrival_times and self.start is not None else math.nan

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason not in ("", "cancelled", "timeout", "error")


def request_message(
    prompt: str, model: str = DEFAULT_MODEL, stream: bool = True, sampling: Mapping[str, Any] | None = None,
    exclude_input: bool = False, request_id: str = "",
) -> dict:  # fmt: skip
    """What ``stream_infer``'s request iterator yields for one request."""
    return {"model_name": model, "inputs": build_inputs(prompt, stream, sampling, exclude_input), "request_id": request_id}


async def _record(
    result: StreamResult, response, error: InferenceServerException | None, client: grpcclient.InferenceServerClient, model: str
) -> bool:
    """Record one response (its arrival, delta, token count and finish reason) or the server's error;
    True once the request is over: an error, or the response that carries the finish reason."""
    arrived = time.perf_counter()
    if error is not None:
        result.finish_reason = "error"
        result.error = await _explain_server_error(client, model, error.message() or str(error))
        return True
    result.arrival_times.append(arrived)
    result.chunks.append(response.as_numpy("text_output")[0].decode("utf-8"))
    result.tokens_per_chunk.append(int(response.as_numpy("num_output_tokens")[0]))
    result.finish_reason = response.as_numpy("finish_reason")[0].decode("utf-8")
    return bool(result.finish_reason)


async def _single(request: dict) -> AsyncIterator[dict]:
    """The request stream of one call: one request, then the client half-closes its side."""
    yield request


async def _explain_server_error(client: grpcclient.InferenceServerClient, model: str, message: str) -> ClientError:
    if not is_model_problem(message):
        return _backend_error(message)
    try:
        index = (await client.get_model_repository_index(as_json=True)).get("models", [])
    except InferenceServerException:
        index = []
    return model_problem(model, message, index)


def _rpc_problem(err: grpc.aio.AioRpcError, url: str, timeout: float | None, midway: bool) -> tuple[str, ClientError]:
    """(finish_reason, explained error) for a gRPC call that ended abnormally (``midway``: after responses)."""
    if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timeout", RequestTimeout(f"The request did not finish within {timeout:g} s: {_CPU_SPEED_HINT}.")
    if err.code() == grpc.StatusCode.UNAVAILABLE and midway:
        return "error", ClientError(f"The connection to {url} broke mid-request ({err.details()}): did the server stop?")
    if err.code() == grpc.StatusCode.UNAVAILABLE:
        return "error", connection_problem(url, "grpc", err.details() or "")
    return "error", ClientError(f"gRPC call to {url} failed with {err.code().name}: {err.details()}")


async def stream_one(
    client: grpcclient.InferenceServerClient,
    prompt: str,
    *,
    model: str = DEFAULT_MODEL,
    stream: bool = True,
    sampling: Mapping[str, Any] | None = None,
    exclude_input: bool = False,
    request_id: str = "",
    timeout: float | None = None,
    url: str = "",
    into: StreamResult | None = None,
) -> StreamResult:
    """Send one request on its own ``stream_infer`` call and record each response as it arrives.

    Failures are recorded in the result (``error``), not raised, so one bad request does not end a
    benchmark. ``timeout`` is the gRPC deadline of the call (the server aborts the request when it
    passes). Cancelling the task that runs this cancels the call: the server aborts the request, and
    ``into`` (filled in place) keeps what had arrived, marked "cancelled". ``url`` only improves messages.
    """
    result = into if into is not None else StreamResult(prompt, request_id)
    request = request_message(prompt, model, stream, sampling, exclude_input, request_id)
    result.start = time.perf_counter()
    responses = client.stream_infer(_single(request), stream_timeout=timeout)
    ended = False
    try:
        async for response, error in responses:
            await _record(result, response, error, client, model)
        ended = True  # Triton ends the call once the request is complete (we half-closed after sending it)
        if not result.finish_reason:  # the server ended the call without a last response
            result.finish_reason = "error"
            result.error = ClientError("The server closed the stream before the request finished.")
    except grpc.aio.AioRpcError as err:
        result.finish_reason, result.error = _rpc_problem(err, url or "the server", timeout, bool(result.chunks))
    except asyncio.CancelledError:
        result.finish_reason = "cancelled"
        raise
    finally:
        if not ended:  # abort a running request; never cancel a completed call: Triton 2.51 would keep the model from unloading
            responses.cancel()
    return result


CLOSE_TIMEOUT_S = 10.0  # how long closing an idle stream may take before its call is cancelled


class OpenStream:
    """One ``stream_infer`` call kept open for one request after another, one request in flight at a time.

    Triton sets a gRPC stream up for every call. Measured with ``scripts/stream-setup-bench.py`` (a Python
    model that only answers, 1 and 16 clients, 2026-12-07; 2 cores and an H100's host), a call per request
    cost 0.1-0.35 ms more of Triton's CPU and 0.3-0.6 ms more of the client's than the same request on a
    stream kept open, and at 1 client TTFT p50 0.86-0.97 ms against 0.44-0.61 (HTTP's ``generate_stream`` on
    a kept-alive connection 0.42-0.62). A request that is cancelled or times out cancels the call, which
    aborts it in the server, and leaves the stream ``closed``.
    """

    def __init__(self, client: grpcclient.InferenceServerClient, url: str = "") -> None:
        self._client = client
        self._url = url or "the server"
        self._requests: asyncio.Queue[dict | None] = asyncio.Queue()
        self._responses = client.stream_infer(self._feed())
        self.closed = False

    async def _feed(self) -> AsyncIterator[dict]:
        while (request := await self._requests.get()) is not None:
            yield request

    async def send(self, request: dict, result: StreamResult, timeout: float | None = None) -> StreamResult:
        """Send ``request`` and record its responses in ``result``, up to its last (see `stream_one`)."""
        result.start = time.perf_counter()
        self._requests.put_nowait(request)
        over = ended = False
        try:
            async with asyncio.timeout(timeout):
                while not over:
                    response, error = await anext(self._responses)
                    over = await _record(result, response, error, self._client, request["model_name"])
        except StopAsyncIteration:
            ended = True
            result.finish_reason = "error"
            result.error = ClientError("The server closed the stream before the request finished.")
        except TimeoutError:
            result.finish_reason = "timeout"
            result.error = RequestTimeout(f"The request did not finish within {timeout:g} s: {_CPU_SPEED_HINT}.")
        except grpc.aio.AioRpcError as err:
            ended = True
            result.finish_reason, result.error = _rpc_problem(err, self._url, None, bool(result.chunks))
        except asyncio.CancelledError:
            result.finish_reason = "cancelled"
            raise
        finally:
            if not over:
                self.closed = True
                if not ended:  # a request still running: cancelling the call aborts it in the server
                    self._responses.cancel()
        return result

    async def aclose(self) -> None:
        """Half-close the stream and let Triton end the call (no request is in flight: it ends at once); a
        call the server already broke (it stopped) has nothing left to close, one that hangs is cancelled."""
        if self.closed:
            return
        self.closed = True
        self._requests.put_nowait(None)
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                async for _ in self._responses:
                    pass
        except grpc.aio.AioRpcError:
            pass
        except TimeoutError:
            self._responses.cancel()


class StreamPool:
    """Open streams shared by the requests of one client: a request takes an idle stream (or opens one)
    and gives it back when it ends, so a closed-loop client's requests all travel on one stream, as an
    HTTP client's travel on one kept-alive connection. ``utils.bench`` sends its gRPC load through one.

    Close it (``async with``) before unloading the model or stopping the server: Triton 2.51 keeps a model
    UNLOADING while a stream that carried a request to it stays open, even idle (measured: still UNLOADING
    after 30 s with two idle streams open; unloaded 1.2 s after they closed).
    """

    def __init__(self, client: grpcclient.InferenceServerClient, url: str = "") -> None:
        self._client = client
        self._url = url
        self._idle: list[OpenStream] = []
        self.opened = 0

    async def stream_one(
        self, prompt: str, *, request_id: str = "", timeout: float | None = None, **options: Any
    ) -> StreamResult:
        """`stream_one`'s request (``options``: its ``model``, ``stream``, ``sampling``, ``exclude_input``) and
        result, on an open stream; ``timeout`` bounds the whole request."""
        if self._idle:
            open_stream = self._idle.pop()
        else:
            open_stream = OpenStream(self._client, self._url)
            self.opened += 1
        request = request_message(prompt, request_id=request_id, **options)
        try:
            return await open_stream.send(request, StreamResult(prompt, request_id), timeout)
        finally:
            if not open_stream.closed:
                self._idle.append(open_stream)

    async def __aenter__(self) -> StreamPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        idle, self._idle = self._idle, []
        await asyncio.gather(*(open_stream.aclose() for open_stream in idle))


async def check_model(client: grpcclient.InferenceServerClient, model: str, url: str = "") -> None:
    """Raise an explained `ClientError` unless the server answers and ``model`` is ready."""
    try:
        await client.get_model_metadata(model)
    except InferenceServerException as err:
        if err.status() == str(grpc.StatusCode.UNAVAILABLE):
            raise connection_problem(url or "the server", "grpc", err.message() or "") from None
        raise await _explain_server_error(client, model, err.message() or str(err)) from None


async def stream_many(
    prompts: Sequence[str],
    *,
    url: str = DEFAULT_GRPC_URL,
    model: str = DEFAULT_MODEL,
    stream: bool = True,
    concurrency: int | None = None,
    sampling: Mapping[str, Any] | None = None,
    exclude_input: bool = False,
    timeout: float | None = None,
    request_ids: Sequence[str] | None = None,
    cancel_after: Mapping[int, float] | None = None,
    progress: bool = False,
    verbose: bool = False,
) -> list[StreamResult]:
    """Send ``prompts`` over gRPC, at most ``concurrency`` in flight (all at once by default).

    The server and model are checked first (an explained `ClientError` if either is missing); after
    that each request's failure lands in its result. ``cancel_after`` maps a prompt's index to the
    seconds after which the client cancels it (a demonstration of cancellation: the others go on).
    ``progress`` shows a progress bar; ``verbose`` prints every gRPC message, as NVIDIA's sample does.
    """
    ids = list(request_ids) if request_ids is not None else [str(i) for i in range(len(prompts))]
    results = [StreamResult(prompt, request_id) for prompt, request_id in zip(prompts, ids, strict=True)]
    async with grpcclient.InferenceServerClient(url, verbose=verbose) as client:
        await check_model(client, model, url)
        slots = asyncio.Semaphore(concurrency or max(len(prompts), 1))

        async def limited(result: StreamResult) -> StreamResult:
            async with slots:
                return await stream_one(
                    client, result.prompt, model=model, stream=stream, sampling=sampling, exclude_input=exclude_input,
                    request_id=result.request_id, timeout=timeout, url=url, into=result,
                )

        tasks = [asyncio.create_task(limited(result)) for result in results]
        loop = asyncio.get_running_loop()
        timers = [loop.call_later(delay, tasks[index].cancel) for index, delay in (cancel_after or {}).items()]
        with tqdm(total=len(tasks), desc="requests", unit="req", disable=not progress) as bar:
            for task in tasks:
                task.add_done_callback(lambda _task: bar.update())
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        for timer in timers:
            timer.cancel()
    for result, outcome in zip(results, outcomes):
        if isinstance(outcome, asyncio.CancelledError):
            result.finish_reason = "cancelled"  # also those cancelled before they were sent
        elif isinstance(outcome, BaseException):
            raise outcome
    return results


def run_sync(coroutine: Awaitable[T]) -> T:
    """Run a coroutine to completion from synchronous code, even where an event loop already runs.

    Jupyter runs one, and ``asyncio.run`` refuses to start a second in the same thread: the coroutine
    then runs in a fresh thread with its own loop.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def run_many(prompts: Sequence[str], **options: Any) -> list[StreamResult]:
    """`stream_many` for synchronous code and notebooks; same options."""
    return run_sync(stream_many(prompts, **options))


def results_table(results: Iterable[StreamResult]) -> pd.DataFrame:
    """One row per request (times in seconds), for a notebook to show or plot."""
    import pandas as pd  # here, not at the top: the load generator has no use for it

    rows = [
        {
            "request_id": r.request_id,
            "prompt": r.prompt,
            "finish_reason": r.finish_reason,
            "responses": len(r.chunks),
            "output_tokens": r.output_tokens,
            "ttft_s": r.ttft,
            "e2e_s": r.e2e,
            "text": r.text,
            "error": str(r.error) if r.error else "",
        }
        for r in results
    ]
    return pd.DataFrame(rows)


# ---- the command line of NVIDIA's sample client ------------------------------------------------------------
def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line; line endings and blank lines are dropped (the sample kept the newline)."""
    return [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def write_results(path: str | Path, results: Sequence[StreamResult]) -> None:
    """The sample's format: each reply, a newline, then a ``=========`` separator line."""
    with open(path, "w", encoding="utf-8") as out:
        for result in results:
            out.write(result.text + "\n" + RESULT_SEPARATOR)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m utils.client",
        description="Send prompts to a vLLM model over gRPC and store the replies (NVIDIA's sample client).",
    )
    parser.add_argument("-m", "--model", default=DEFAULT_MODEL, help="model name (default: %(default)s)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every gRPC message and the results")
    parser.add_argument("-u", "--url", default=DEFAULT_GRPC_URL, help="server's gRPC address (default: %(default)s)")
    parser.add_argument(
        "-t", "--stream-timeout", type=float, default=None,
        help="seconds each request's gRPC stream may stay open (default: no limit)",
    )
    parser.add_argument("--offset", type=int, default=0, help="add this offset to the request ids")
    parser.add_argument("--input-prompts", default="prompts.txt", help="text file, one prompt per line")
    parser.add_argument("--results-file", default="results.txt", help="where the replies are written")
    parser.add_argument("--iterations", type=int, default=1, help="how many times the prompts are sent")
    parser.add_argument("-s", "--streaming-mode", action="store_true", help="stream the replies token by token")
    parser.add_argument("--exclude-inputs-in-outputs", action="store_true", help="leave the prompt out of the replies")
    parser.add_argument("-l", "--lora-name", default=None, help="the LoRA adapter to query")
    parser.add_argument(
        "--max-tokens", type=int, default=64,
        help="tokens to generate per reply (default: %(default)s; vLLM's own default is 16)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    flags = parse_args(argv)
    sampling: dict[str, Any] = {**SAMPLE_SAMPLING, "max_tokens": flags.max_tokens}
    if flags.lora_name is not None:
        sampling["lora_name"] = flags.lora_name
    print(f"Loading inputs from `{flags.input_prompts}`...")
    try:
        prompts = read_prompts(flags.input_prompts)
    except OSError as err:
        print(f"FAIL: cannot read the prompts: {err}")
        return 1
    if not prompts:
        print(f"FAIL: `{flags.input_prompts}` holds no prompt (one per line)")
        return 1
    ids = [str(flags.offset + len(prompts) * iteration + i) for iteration in range(flags.iterations) for i in range(len(prompts))]
    try:
        results = run_many(
            prompts * flags.iterations, url=flags.url, model=flags.model, stream=flags.streaming_mode,
            sampling=sampling, exclude_input=flags.exclude_inputs_in_outputs, timeout=flags.stream_timeout,
            request_ids=ids, verbose=flags.verbose,
        )
    except ClientError as err:
        print(f"FAIL: {err}")
        return 1
    write_results(flags.results_file, results)
    print(f"Storing results into `{flags.results_file}`...")
    if flags.verbose:
        print(f"\nContents of `{flags.results_file}` ===>")
        print(Path(flags.results_file).read_text(encoding="utf-8"))
    failed = [result for result in results if not result.ok]
    for result in failed:
        print(f"Encountered error while processing request {result.request_id}: {result.error or result.finish_reason}")
    if failed:
        print(f"FAIL: {len(failed)} of {len(results)} requests failed; first: {failed[0].error or failed[0].finish_reason}")
        return 1
    print("PASS: vLLM example")
    return 0


if __name__ == "__main__":
    sys.exit(main())
