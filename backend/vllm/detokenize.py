"""A request's text decoded when the sender takes its tokens, not token by token on vLLM's output path.

vLLM detokenizes each new token of each request as the engine's outputs reach the event loop (its fast
incremental detokenizer: one ``tokenizers`` DecodeStream step and Python bookkeeping per token), though under
load the sender takes a request's tokens 10-30 at a time. Where vLLM would use that detokenizer and nothing else
on its output path needs the text (no stop strings, no logprobs), the backend asks vLLM for token ids only
(``detokenize=False``) and decodes each response's tokens with a DecodeStream of its own, primed with the prompt
as vLLM primes its own: the same steps on the same ids, so the same text, done by the sender as it sends.
``scripts/frontend-bench.py`` measures the loop's time per engine step both ways.
"""

from __future__ import annotations

import tokenizers
from tokenizers.decoders import DecodeStream

# What the tokenizers library raises when a DecodeStream's prefix no longer decodes monotonically (vLLM resets the
# stream then, without the prompt, and steps again: vllm-project/vllm#17448).
INVALID_PREFIX = "Invalid prefix encountered"


def rust_tokenizer(tokenizer: object) -> tokenizers.Tokenizer | None:
    """The ``tokenizers`` Tokenizer behind a fast Hugging Face tokenizer (what vLLM's fast detokenizer decodes
    with), or None for any other kind, or where DecodeStream cannot be primed with a prompt: vLLM keeps
    detokenizing those requests itself."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        return None
    try:
        DecodeStream(ids=[], skip_special_tokens=True)
    except TypeError:  # a tokenizers release without prompt prefill: vLLM itself would not decode this way
        return None
    return backend


def decodable_at_send(params: object) -> bool:
    """Whether vLLM can leave this request's text to the sender: it asked for text, and nothing on vLLM's output
    path reads the text (stop strings are searched in it, logprobs carry decoded tokens), and special tokens
    need no spacing rule of vLLM's own (it drops the space between two of them only when both
    ``skip_special_tokens`` and ``spaces_between_special_tokens`` are off)."""
    return bool(
        params.detokenize
        and not params.stop
        and params.logprobs is None
        and params.prompt_logprobs is None
        and (params.skip_special_tokens or params.spaces_between_special_tokens)
    )


class SenderText:
    """One request's text, decoded response by response from the token ids vLLM hands over.

    As vLLM does: the stream is primed with the prompt's ids (so the first token decodes in context), text held
    back by DecodeStream (a character split across tokens) comes with a later token, and a request that stops on
    a stop token (EOS or ``stop_token_ids``) leaves that token out of its text unless ``include_stop_str_in_output``.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, skip_special_tokens: bool, include_stop_token: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._include_stop_token = include_stop_token
        self._stream: DecodeStream | None = None

    def next_text(self, prompt_token_ids: list[int] | None, token_ids: list[int], stopped: bool) -> str:
        """The text of ``token_ids``, the tokens since the previous call (all of them for a non-streaming
        request); ``stopped``: the request finished on a stop token, which is the last of ``token_ids``."""
        if self._stream is None:
            self._stream = DecodeStream(ids=list(prompt_token_ids or ()), skip_special_tokens=self._skip_special_tokens)
        if stopped and not self._include_stop_token:
            token_ids = token_ids[:-1]
        pieces, stream, tokenizer = [], self._stream, self._tokenizer
        for token_id in token_ids:  # one loop, no call of ours per token: this runs for every token served
            try:
                piece = stream.step(tokenizer, token_id)
            except (OverflowError, TypeError):  # an id the tokenizer cannot hold: no text, as in vLLM
                piece = None
            except Exception as err:
                if not str(err).startswith(INVALID_PREFIX):
                    raise
                stream = self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
                piece = stream.step(tokenizer, token_id)
            if piece:
                pieces.append(piece)
        return "".join(pieces)
