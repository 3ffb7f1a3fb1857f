"""Response bodies in OpenAI's formats (chat, completions, their stream chunks, errors).

kvblend's own data rides in an extension field, ``kvblend``: the reuse
report (per segment: class, tokens, recomputed rows and their offsets), the
first-token logits hash, the hash over every sampled-from logits row, the
seed, TTFT and end-to-end time inside the server (from submission to the
scheduler) and the answer's token ids. In a stream it is in the final chunk
(the one with ``finish_reason``).
"""

from __future__ import annotations

import codecs
import time
import uuid
from dataclasses import dataclass
from enum import Enum

from blend import json_text
from blend.detokenize import REPLACEMENT, IncrementalText
from blend.generation import Completion
from blend.logprobs import TokenLogprob, token_bytes
from blend.prompt import Prompt


class Endpoint(Enum):
    CHAT = "chat"
    COMPLETIONS = "completions"

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self is Endpoint.CHAT else "/v1/completions"


@dataclass(frozen=True)
class ResponseHead:
    """What every body and chunk of one response shares."""

    endpoint: Endpoint
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, endpoint: Endpoint, model: str) -> "ResponseHead":
        prefix = "chatcmpl-" if endpoint is Endpoint.CHAT else "cmpl-"
        return cls(endpoint, model, prefix + uuid.uuid4().hex[:24], int(time.time()))

    def base(self, chunk: bool) -> dict:
        if self.endpoint is Endpoint.CHAT:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def kvblend_extension(c: Completion, prompt: Prompt, tokenizer, return_tokens: bool) -> dict:
    """The ``kvblend`` field of a response.

    Args:
        c: the finished completion.
        prompt: its prompt (the documents' tokens, for ``return_tokens``).
        tokenizer: the engine's tokenizer.
        return_tokens: whether to add each document's tokens as text.

    Returns:
        The reuse report, logits and steps digests, TTFT and end-to-end seconds, seed, answer token ids and
        finish reason (and ``documents`` if asked), as JSON types.
    """
    ext = {
        "report": c.report.to_dict(),
        "logits_sha256": c.logits_sha256(),
        "steps_sha256": c.steps_sha256,
        "ttft_s": c.ttft_s,
        "e2e_s": c.e2e_s,
        "seed": c.seed,
        "answer_token_ids": c.token_ids,
        "finish_reason": c.finish_reason.value,
    }
    if return_tokens:  # each document's tokens as text, for highlighting recomputed rows
        ext["documents"] = [{"tokens": token_texts(tokenizer, d.token_ids)} for d in prompt.documents]
    return ext


def token_texts(tokenizer, token_ids) -> list[str]:
    """Each token's text such that the texts join up to the document: a character spread over
    several tokens is given whole to the token that completes it (the others get ""), instead of
    U+FFFD for every piece.

    Args:
        tokenizer: the model's tokenizer.
        token_ids: one document's token ids.

    Returns:
        One string per token.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    texts = [decoder.decode(token_bytes(tokenizer, t)) for t in token_ids]
    if texts:
        texts[-1] += decoder.decode(b"", final=True)
    return texts


class LogprobFormat:
    """OpenAI's ``logprobs`` object of one response, chunk by chunk (its text offsets run on).

    Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
    "refusal": null}`` (``top_logprobs``: the N most likely); completions: ``{"tokens", "token_logprobs",
    "top_logprobs": [{token: logprob}], "text_offset"}`` (each dict: the N most likely and the sampled
    token). A token's text is its own decoding (a piece of a multi-byte character decodes to U+FFFD),
    ``bytes`` the token's own bytes (:func:`~blend.logprobs.token_bytes`: a character's pieces join up
    to it).

    Args:
        endpoint: which shape.
        tokenizer: decodes token ids.
        enabled: False when the request did not ask for logprobs (every chunk then says null).
    """

    def __init__(self, endpoint: Endpoint, tokenizer, enabled: bool) -> None:
        self.endpoint = endpoint
        self.tokenizer = tokenizer
        self.enabled = enabled
        # completions' text_offset: where each token's text starts in the answer's text, decoded as the
        # answer is (IncrementalText: special tokens skipped, SentencePiece's leading space dropped): the
        # length of what the text before the token and the text with it share. A token that completes a
        # multi-byte character sits where the character starts; one that cuts it short, after its U+FFFD.
        # (Adding each token's own decoding ran the offsets past the text after a split character or a
        # special token.)
        self._answer = IncrementalText(tokenizer)

    def _text(self, token_id: int) -> str:
        # its own bytes as text: a SentencePiece word's leading space kept (decoding it alone drops it), a
        # piece of a multi-byte character U+FFFD
        return token_bytes(self.tokenizer, token_id).decode("utf-8", errors="replace")

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        own = token_bytes(self.tokenizer, token_id)  # once: the text is these bytes decoded
        return {"token": own.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(own)}

    def format(self, entries: tuple[TokenLogprob, ...] | None) -> dict | None:
        """The ``logprobs`` object for these answer tokens (None when logprobs are off)."""
        if not self.enabled or entries is None:
            return None
        if self.endpoint is Endpoint.CHAT:
            return {"content": [{**self._chat_entry(e.token_id, e.logprob),
                                 "top_logprobs": [self._chat_entry(t, lp) for t, lp in e.top]} for e in entries],
                    "refusal": None}
        tokens, offsets = [], []
        for e in entries:
            own = token_bytes(self.tokenizer, e.token_id)  # once: its text is these bytes decoded
            tokens.append(own.decode("utf-8", errors="replace"))
            before = self._answer.text
            after = self._answer.push(e.token_id)
            offset = _shared_length(before, after)
            if after == before and before.endswith(REPLACEMENT) and own and 0x80 <= own[0] <= 0xBF:
                offset -= 1  # a piece inside a character still incomplete: where that character starts
            offsets.append(offset)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                # keyed by text, as OpenAI's format is: pieces of one multi-byte character all read U+FFFD,
                # so the first (most likely) alternative of each text is kept. The sampled token is in it too,
                # as OpenAI's (and vLLM's) are: "up to logprobs+1 elements" (a sampled token outside the top N
                # was missing from it)
                "top_logprobs": [_first_per_text([*((self._text(t), lp) for t, lp in e.top), (token, e.logprob)])
                                 for token, e in zip(tokens, entries)],
                "text_offset": offsets}


def _shared_length(before: str, after: str) -> int:
    """How much of ``before`` ``after`` still starts with (all of it but a trailing incomplete character's
    U+FFFD that the next token completed)."""
    k = len(before)
    while k and not after.startswith(before[:k]):
        k -= 1
    return k


def _first_per_text(pairs) -> dict[str, float]:
    """(text, logprob) pairs, most likely first, as a dict keeping each text's first value."""
    out: dict[str, float] = {}
    for text, lp in pairs:
        out.setdefault(text, lp)
    return out


def full_body(head: ResponseHead, c: Completion, ext: dict, logprobs: LogprobFormat) -> dict:
    """A non-streamed response (non-finite floats written as null).

    Args:
        head: the response's id, model, endpoint and creation time.
        c: the finished completion.
        ext: its ``kvblend`` field (:func:`kvblend_extension`).
        logprobs: the response's logprobs formatter.

    Returns:
        The chat or completions response object, JSON-ready.
    """
    lp = logprobs.format(c.logprobs)
    if head.endpoint is Endpoint.CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": c.text},
                  "finish_reason": c.finish_reason.value, "logprobs": lp}
    else:
        choice = {"index": 0, "text": c.text, "finish_reason": c.finish_reason.value, "logprobs": lp}
    body = {**head.base(chunk=False), "choices": [choice], "usage": c.usage.to_dict(), "kvblend": ext}
    return json_text.finite(body)  # a NaN figure or logprob is null (JSONResponse refuses NaN: a 500)


def _choice(head: ResponseHead, text: str | None, finish: str | None, first: bool = False,
            logprobs: dict | None = None) -> dict:
    if head.endpoint is Endpoint.CHAT:
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": logprobs}


def sse(data: dict | str) -> str:
    """One server-sent event.

    Args:
        data: the event's payload: an object (written as compact JSON) or text as it is (``[DONE]``).

    Returns:
        ``data: <payload>`` and a blank line.
    """
    payload = data if isinstance(data, str) else json_text.dumps(data, separators=(",", ":"))  # NaN: null
    return f"data: {payload}\n\n"


def _null_usage(include_usage: bool) -> dict:
    """``"usage": null`` for a chunk before the usage chunk, when the stream ends with one (OpenAI's)."""
    return {"usage": None} if include_usage else {}


def text_chunk(head: ResponseHead, text: str, first: bool = False, logprobs: dict | None = None,
               include_usage: bool = False) -> str:
    """A chunk of answer text (with its tokens' ``logprobs`` object when asked for).

    Args:
        head: the response's shared fields.
        text: the chunk's text.
        first: the stream's first chunk (a chat delta then carries the role).
        logprobs: the chunk's tokens' ``logprobs`` object, or None.
        include_usage: the stream ends with a usage chunk, so this one says ``"usage": null``.

    Returns:
        The chunk as a server-sent event.
    """
    return sse({**head.base(chunk=True), "choices": [_choice(head, text, None, first, logprobs)],
                **_null_usage(include_usage)})


def final_chunk(head: ResponseHead, c: Completion, ext: dict, logprobs: dict | None = None,
                include_usage: bool = False) -> str:
    """The chunk with ``finish_reason`` and the kvblend extension (and the last tokens' logprobs).

    Args:
        head: the response's shared fields.
        c: the finished completion.
        ext: the ``kvblend`` extension.
        logprobs: the last tokens' ``logprobs`` object, or None.
        include_usage: the stream ends with a usage chunk, so this one says ``"usage": null``.

    Returns:
        The chunk as a server-sent event.
    """
    return sse({**head.base(chunk=True), "choices": [_choice(head, None if head.endpoint is Endpoint.CHAT else "",
                                                             c.finish_reason.value, logprobs=logprobs)],
                **_null_usage(include_usage), "kvblend": ext})


def usage_chunk(head: ResponseHead, c: Completion) -> str:
    """``stream_options.include_usage``: a last chunk with no choices and the usage.

    Args:
        head: the response's id, model, endpoint and creation time.
        c: the finished completion.

    Returns:
        The chunk as one server-sent event.
    """
    return sse({**head.base(chunk=True), "choices": [], "usage": c.usage.to_dict()})


DONE = "data: [DONE]\n\n"


class ErrorType(Enum):
    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    NOT_FOUND = "not_found_error"
    TOO_LARGE = "request_too_large"
    RATE_LIMIT = "rate_limit_exceeded"
    SERVER = "server_error"


def error_body(message: str, kind: ErrorType, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object.

    Args:
        message: what went wrong, for people.
        kind: the error's type.
        param: the offending field, or None.
        code: a machine-readable code (``context_length_exceeded``, ...), or None.

    Returns:
        ``{"error": {"message", "type", "param", "code"}}``.
    """
    return {"error": {"message": message, "type": kind.value, "param": param, "code": code}}
