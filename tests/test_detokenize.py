"""The sender's text (backend/vllm/detokenize.py) against vLLM's own incremental detokenizer, on the default
model's tokenizer: the same text for any split of the same tokens (tests/test_backend.py compares the two
through the real server)."""

from __future__ import annotations

import importlib.util
import time

import pytest
from transformers import AutoTokenizer
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.detokenizer import IncrementalDetokenizer

from utils.model import default_model_dir
from utils.paths import backend_source

_spec = importlib.util.spec_from_file_location("backend_detokenize", backend_source() / "detokenize.py")
detokenize = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(detokenize)

PROMPT = "Say hello in three languages:"
# accents, CJK and an emoji: characters whose UTF-8 bytes span several byte-level tokens
COMPLETION = " Bonjour, café crème! こんにちは、日本語 🎉🙂 naïve façade — Ünïcödé…"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_dir())


def vllm_text(tokenizer, prompt_ids: list[int], chunks: list[list[int]], params: SamplingParams, stopped: bool) -> str:
    """What vLLM's output path makes of the same tokens, arriving in ``chunks``, the last one finishing."""
    request = EngineCoreRequest(
        request_id="r", prompt_token_ids=prompt_ids, mm_features=None, sampling_params=params, pooling_params=None,
        arrival_time=time.time(), lora_request=None, cache_salt=None, data_parallel_rank=None,
    )
    detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
    text = ""
    for index, chunk in enumerate(chunks):
        last = index == len(chunks) - 1
        detokenizer.update(chunk, stop_terminated=last and stopped)
        text += detokenizer.get_next_output_text(finished=last, delta=True)
    return text


def sender_text(tokenizer, prompt_ids: list[int], chunks: list[list[int]], params: SamplingParams, stopped: bool) -> str:
    text = detokenize.SenderText(detokenize.rust_tokenizer(tokenizer), params.skip_special_tokens, params.include_stop_str_in_output)
    return "".join(
        text.next_text(prompt_ids, chunk, stopped=stopped and index == len(chunks) - 1) for index, chunk in enumerate(chunks)
    )


def split(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_same_text_as_vllm_for_any_split(tokenizer, size, skip_special_tokens):
    prompt_ids = tokenizer.encode(PROMPT)
    ids = tokenizer.encode(COMPLETION) + [tokenizer.eos_token_id] + tokenizer.encode(" after the end")
    params = SamplingParams(skip_special_tokens=skip_special_tokens, output_kind=RequestOutputKind.DELTA)
    expected = vllm_text(tokenizer, prompt_ids, split(ids, size), params, stopped=False)
    assert sender_text(tokenizer, prompt_ids, split(ids, size), params, stopped=False) == expected
    assert "こんにちは" in expected and "🎉🙂" in expected  # the split characters came out whole
    assert ("<|im_end|>" in expected) is not skip_special_tokens


@pytest.mark.parametrize("include_stop", [False, True])
def test_a_stop_token_is_left_out_as_vllm_leaves_it(tokenizer, include_stop):
    prompt_ids = tokenizer.encode(PROMPT)
    ids = tokenizer.encode(" Hello. Bye.")  # stopped on its last token, '.', as with stop_token_ids
    params = SamplingParams(include_stop_str_in_output=include_stop, output_kind=RequestOutputKind.DELTA)
    expected = vllm_text(tokenizer, prompt_ids, split(ids, 2), params, stopped=True)
    assert sender_text(tokenizer, prompt_ids, split(ids, 2), params, stopped=True) == expected
    assert expected.endswith("Bye.") is include_stop


def test_the_prompt_gives_the_first_token_its_context(tokenizer):
    """Primed with the prompt as vLLM primes its stream: here the prompt ends inside a character."""
    prompt_ids = tokenizer.encode("An emoji: 🎉")[:-1]  # the emoji's last byte token is the completion's first
    ids = tokenizer.encode("An emoji: 🎉")[-1:] + tokenizer.encode(" and more")
    params = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)
    assert sender_text(tokenizer, prompt_ids, [ids], params, False) == vllm_text(tokenizer, prompt_ids, [ids], params, False)


def test_what_vllm_must_still_decode():
    assert detokenize.decodable_at_send(SamplingParams())
    assert detokenize.decodable_at_send(SamplingParams(skip_special_tokens=False))
    assert not detokenize.decodable_at_send(SamplingParams(stop=["\n"]))  # searched in vLLM's text
    assert not detokenize.decodable_at_send(SamplingParams(logprobs=1))  # logprobs carry decoded tokens
    assert not detokenize.decodable_at_send(SamplingParams(prompt_logprobs=1))
    assert not detokenize.decodable_at_send(SamplingParams(detokenize=False))  # the client asked for ids only
    assert not detokenize.decodable_at_send(SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False))


def test_only_a_fast_tokenizer_is_decoded_by_the_sender(tokenizer):
    assert detokenize.rust_tokenizer(tokenizer) is tokenizer._tokenizer
    assert detokenize.rust_tokenizer(object()) is None
    assert detokenize.rust_tokenizer(None) is None
