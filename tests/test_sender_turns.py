"""The rule by which the backend's sender shares the event loop with vLLM's output processing, on made-up
timings (the sender itself runs inside Triton's stub; tests/test_backend.py streams through it)."""

from __future__ import annotations

import importlib.util

import pytest

from utils.paths import backend_source

_spec = importlib.util.spec_from_file_location("backend_turns", backend_source() / "turns.py")
turns = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(turns)

SEND_S = 0.00025  # one response: an IPC round trip to the Triton process (0.17-0.29 ms measured on an H200)


class FakeClock:
    """A clock that moves only when a response is sent, so a turn's length is counted in sends."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def queue_of(waiting: list[str], firsts: set[str] = frozenset()) -> "turns.SendQueue":
    queue = turns.SendQueue()
    for name in waiting:
        assert queue.add(name, name, urgent=name in firsts)
    return queue


def drain(queue: "turns.SendQueue") -> list[str]:
    return [queue.pop() for _ in range(len(queue))]


def run_turn(waiting: list[str], allowance_s: float, firsts: set[str] = frozenset()) -> tuple[list[str], list[str]]:
    clock = FakeClock()
    ready = queue_of(waiting, firsts)
    sent: list[str] = []

    def deliver(stream: str) -> None:
        sent.append(stream)
        clock.now += SEND_S

    assert turns.send_one_turn(ready, deliver, allowance_s, clock) == len(sent)
    return sent, drain(ready)


def test_later_responses_get_their_share_of_the_allowance_longest_waiting_first():
    allowance_s = 16 * SEND_S  # 4 ms of processing since the previous turn
    sent, left = run_turn([f"r{i}" for i in range(256)], allowance_s)
    assert turns.LATER_SHARE * allowance_s == 4 * SEND_S  # the rule under test: a quarter of it for sending
    assert sent == ["r0", "r1", "r2", "r3"]
    assert left[0] == "r4" and len(left) == 252  # the rest wait, in order, for the next turn


def test_every_first_response_goes_whatever_the_allowance():
    waiting = [f"later{i}" for i in range(8)] + [f"new{i}" for i in range(100)]
    sent, left = run_turn(waiting, allowance_s=0.0, firsts={f"new{i}" for i in range(100)})
    assert sent == [f"new{i}" for i in range(100)] + ["later0"]  # then one later response, the least a turn sends
    assert left == [f"later{i}" for i in range(1, 8)]


def test_a_turn_sends_at_least_one_response_even_with_no_allowance():
    sent, left = run_turn(["a", "b"], allowance_s=0.0)
    assert sent == ["a"] and left == ["b"]


def test_after_an_idle_loop_a_turn_sends_everything_waiting():
    sent, left = run_turn([f"r{i}" for i in range(64)], allowance_s=1.0)
    assert len(sent) == 64 and left == []


def test_first_responses_are_served_before_the_others_each_line_in_order_of_arrival():
    queue = queue_of(["a", "b", "new1", "c", "new2"], firsts={"new1", "new2"})
    assert drain(queue) == ["new1", "new2", "a", "b", "c"]


def test_a_finished_request_moves_to_the_urgent_line_and_goes_in_the_next_turn():
    queue = queue_of(["a", "b", "c", "d"])
    queue.hurry("c")  # c's request finished while c waited among the later responses
    queue.hurry("missing")  # an ended stream's collector can still be put into until the engine has its abort
    assert queue.has_urgent() and len(queue) == 4
    sent, left = [], []
    assert turns.send_one_turn(queue, sent.append, allowance_s=0.0) == 2  # the urgent one, then one later
    assert sent == ["c", "a"] and drain(queue) == ["b", "d"]


def test_a_stream_already_waiting_keeps_its_place_and_a_discarded_one_is_gone():
    queue = queue_of(["a", "b", "c"])
    assert not queue.add("a", "a", urgent=False) and not queue.add("b", "b", urgent=True)
    queue.discard("b")
    queue.discard("missing")
    assert len(queue) == 2 and drain(queue) == ["a", "c"] and not queue


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
    queue = turns.SendQueue()
    collector.ready = turns.Doorbell(lambda: queue.add("r", collector, urgent=True))
    for token, text in enumerate([" Paris", ",", " France"]):
        collector.put(_delta(text, token))
    assert len(queue) == 1
    merged = queue.pop().get_nowait()
    assert (merged.outputs[0].text, list(merged.outputs[0].token_ids), merged.finished) == (" Paris, France", [0, 1, 2], False)
    assert collector.get_nowait() is None
    collector.put(_delta(".", 3, finished=True))
    assert len(queue) == 1 and queue.pop().get_nowait().finished


def test_the_load_time_check_passes_vllms_collector_and_refuses_one_that_signals_otherwise():
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.output_processor import RequestOutputCollector

    class SignalsOtherwise:  # a collector that keeps its outputs without touching ``ready``
        def put(self, output) -> None:
            self.output = output

    class TakesNoErrors:
        def put(self, output) -> None:
            raise TypeError("only RequestOutputs")

    assert turns.rings_the_doorbell(RequestOutputCollector(RequestOutputKind.DELTA, "probe"))
    assert not turns.rings_the_doorbell(SignalsOtherwise())
    assert not turns.rings_the_doorbell(TakesNoErrors())


def test_output_pace_is_half_the_tokens_per_response_and_one_when_idle():
    pace = turns.OutputPace()
    assert pace.interval() == 1  # before any response: every token, as vLLM does by default
    for _ in range(200):
        pace.observe(20)  # under load the sender's responses carry 20 tokens
    assert pace.interval() == 10
    for _ in range(200):
        pace.observe(100)
    assert pace.interval() == turns.OutputPace.LIMIT
    for _ in range(200):
        pace.observe(1)  # the load is gone: responses carry a token each
    assert pace.interval() == 1


def test_output_pace_falls_back_to_one_when_responses_carry_what_it_gathered():
    """When the sender takes each output as soon as vLLM builds it, a response carries the interval's tokens:
    the next interval is half of it, so an idle server's streams go back to a token per response."""
    pace, interval = turns.OutputPace(), 8
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
    adding it (``turns.OutputPace``) and relies on vLLM reading it at every step, sending the first token at
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


def test_vllms_output_processor_hurries_a_request_whose_final_output_merges_into_a_waiting_one(tokenizer):
    """Against the installed vLLM's own output processor: it must put outputs through the collector's ``put``
    attribute, so the backend sees a request finish (``turns.hurry_when_finished``) even when the final output
    merges into one already waiting and rings no doorbell."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector

    processor = OutputProcessor(tokenizer, log_stats=False)
    params = SamplingParams(max_tokens=3, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    request = EngineCoreRequest("r", tokenizer.encode("Hello"), None, params, None, 0.0, None, None, None, external_req_id="r")
    collector = RequestOutputCollector(RequestOutputKind.DELTA, "r")
    queue, hurried = turns.SendQueue(), []
    collector.ready = turns.Doorbell(lambda: queue.add("r", collector, urgent=False))
    turns.hurry_when_finished(collector, lambda: (hurried.append(True), queue.hurry("r")))
    processor.add_request(request, None, queue=collector)
    tokens = tokenizer.encode(" world and more", add_special_tokens=False)[:3]
    for step, token in enumerate(tokens, 1):
        finished = step == len(tokens)
        processor.process_outputs([EngineCoreOutput(request_id="r", new_token_ids=[token], finish_reason=1 if finished else None)])
        assert hurried == ([True] if finished else [])  # the sender took nothing: the outputs merged
    assert queue.has_urgent() and len(queue) == 1
    merged = queue.pop().get_nowait()
    assert merged.finished and list(merged.outputs[0].token_ids) == tokens
    turns.stop_hurrying(collector)
    assert "put" not in vars(collector)  # the collector's own put again, and no cycle through the replacement
