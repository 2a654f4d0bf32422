"""How the backend's responses reach Triton: the doorbell of vLLM's output collector, the outbox between the event
loop and the sending thread, the pace of vLLM's response objects; on made-up outputs (the sender itself runs
inside Triton's stub; tests/test_backend.py streams through it)."""

from __future__ import annotations

import importlib.util
import threading

import pytest

from utils.paths import backend_source

_spec = importlib.util.spec_from_file_location("backend_sending", backend_source() / "sending.py")
sending = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sending)


def test_the_outbox_serves_first_and_final_responses_ahead_of_the_others_each_line_in_order():
    outbox = sending.Outbox()
    for item, urgent in [("a1", False), ("b-first", True), ("a2", False), ("c-final", True)]:
        outbox.put(item, urgent)
    assert len(outbox) == 4
    assert [outbox.get() for _ in range(4)] == ["b-first", "c-final", "a1", "a2"]
    assert len(outbox) == 0


def test_the_sending_thread_gets_everything_put_before_the_stop_then_the_stop():
    outbox, got = sending.Outbox(), []

    def consume() -> None:
        while (item := outbox.get()) is not sending.Outbox.STOP:
            got.append(item)

    thread = threading.Thread(target=consume)
    thread.start()  # it waits in get, without the GIL, until the loop puts something
    for index in range(1000):
        outbox.put(index, urgent=index % 100 == 0)
    outbox.stop()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert sorted(got) == list(range(1000))  # nothing lost, nothing twice
    others = [item for item in got if item % 100]
    assert others == sorted(others)  # each line in order


def _delta(text: str, token: int, finished: bool = False):
    from vllm.outputs import CompletionOutput, RequestOutput

    completion = CompletionOutput(index=0, text=text, token_ids=[token], cumulative_logprob=None, logprobs=None)
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2], prompt_logprobs=None, outputs=[completion], finished=finished)


def test_vllms_collector_rings_the_doorbell_once_per_response_and_merges_the_outputs_between():
    """Against the installed vLLM's own output collector: the backend relies on it calling ``ready.set`` on the
    first output after a take and merging the rest (a vLLM release that changes this breaks the backend here)."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.output_processor import RequestOutputCollector

    collector = RequestOutputCollector(RequestOutputKind.DELTA, "r")
    rings: list[str] = []
    collector.ready = sending.Doorbell(lambda: rings.append("r"))
    for token, text in enumerate([" Paris", ",", " France"]):
        collector.put(_delta(text, token))
    assert rings == ["r"]
    merged = collector.get_nowait()
    assert (merged.outputs[0].text, list(merged.outputs[0].token_ids), merged.finished) == (" Paris, France", [0, 1, 2], False)
    assert collector.get_nowait() is None
    collector.put(_delta(".", 3, finished=True))
    assert rings == ["r", "r"] and collector.get_nowait().finished


def test_the_load_time_check_passes_vllms_collector_and_refuses_one_that_signals_otherwise():
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.output_processor import RequestOutputCollector

    class SignalsOtherwise:  # a collector that keeps its outputs without touching ``ready``
        def put(self, output) -> None:
            self.output = output

    class TakesNoErrors:
        def put(self, output) -> None:
            raise TypeError("only RequestOutputs")

    assert sending.rings_the_doorbell(RequestOutputCollector(RequestOutputKind.DELTA, "probe"))
    assert not sending.rings_the_doorbell(SignalsOtherwise())
    assert not sending.rings_the_doorbell(TakesNoErrors())


def test_output_pace_is_half_the_tokens_per_response_and_one_when_idle():
    pace = sending.OutputPace()
    assert pace.interval() == 1  # before any response: every token, as vLLM does by default
    for _ in range(200):
        pace.observe(20)  # under load the sender's responses carry 20 tokens
    assert pace.interval() == 10
    for _ in range(200):
        pace.observe(100)
    assert pace.interval() == sending.OutputPace.LIMIT
    for _ in range(200):
        pace.observe(1)  # the load is gone: responses carry a token each
    assert pace.interval() == 1


def test_output_pace_falls_back_to_one_when_responses_carry_what_it_gathered():
    """When the sender takes each output as soon as vLLM builds it, a response carries the interval's tokens:
    the next interval is half of it, so an idle server's streams go back to a token per response."""
    pace, interval = sending.OutputPace(), 8
    for _ in range(20):
        pace.observe(8)
    for _ in range(400):
        interval = pace.interval()
        pace.observe(interval)
    assert interval == 1


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from utils.model import prepare_default_model

    return AutoTokenizer.from_pretrained(prepare_default_model(progress=False))


def test_vllm_builds_a_streaming_requests_outputs_every_stream_interval_tokens_first_and_last_at_once(tokenizer):
    """Against the installed vLLM's own output processor: the backend sets a request's ``stream_interval`` after
    adding it (``sending.OutputPace``) and relies on vLLM reading it at every step, sending the first token at
    once, every ``stream_interval`` tokens after, and the rest with the last, nothing lost."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector

    processor = OutputProcessor(tokenizer, log_stats=True)
    params = SamplingParams(max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    prompt = tokenizer.encode("The capital of France is")
    request = EngineCoreRequest("r", prompt, None, params, None, 0.0, None, None, None, external_req_id="r")
    collector = RequestOutputCollector(RequestOutputKind.DELTA, "r")
    processor.add_request(request, None, queue=collector)
    processor.request_states["r"].stream_interval = 4
    tokens = tokenizer.encode(" Paris, the city of light, is also the", add_special_tokens=False)[:10]
    built, texts, token_ids = [], [], []
    for step, token in enumerate(tokens, 1):
        finished = step == len(tokens)
        processor.process_outputs([EngineCoreOutput(request_id="r", new_token_ids=[token], finish_reason=1 if finished else None)])
        output = collector.get_nowait()
        if output is not None:
            built.append(step)
            texts.append(output.outputs[0].text)
            token_ids += output.outputs[0].token_ids
    assert built == [1, 5, 9, 10]  # the first token, every 4 after, the last
    assert token_ids == tokens and "".join(texts) == tokenizer.decode(tokens)
