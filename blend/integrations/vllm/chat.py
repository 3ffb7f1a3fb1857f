"""The chat API's ``documents`` for kvblend inside vLLM, as pure functions over JSON bodies (no vLLM import).

vLLM hands a chat request's ``documents`` to the chat template (SmolLM2's and
many others ignore them) and tokenizes the rendered text as a whole, so the
connector never learns where a document starts. A chat request that carries
``documents`` *and* a ``kvblend`` entry in ``kv_transfer_params`` is therefore
laid out by kvblend instead, exactly as ``kvblend serve`` and the Python API
lay it out (:func:`blend.prompt.build_prompt`: [preamble with the system
prompt | one segment per document | question]), and sent on to vLLM's
completions endpoint as token ids with the documents' token spans filled in
(and, for a blend, the ``cache_salt`` that :func:`~blend.integrations.vllm.plan.blend_salt`
gives). Spans come from kvblend's own segmentation, never from a separator
found in text; the document tokens are the ones kvblend keys its chunk KV by,
so vLLM, ``kvblend serve`` and the Python API share those chunks. The
completion is turned back into a chat completion (or chunk, when streaming).

    {"messages": [{"role": "system", ...}?, earlier user/assistant turns?, {"role": "user", "content": QUESTION}],
     "documents": [{"text": ..., "title"?: ...} | "text", ...],
     "kv_transfer_params": {"kvblend": {"mode": "blend", "ratio": 0.15, "selector": "probe",
                                        "guard_margin"?: 0.7 | null,
                                        "attention_precision"?: "compute" | "bf16" | "auto",
                                        "linear_precision"?: "compute" | "bf16" | "auto"}},
     "cache_salt"?: TENANT, ...sampling fields as in any chat request}
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from blend.defaults import DEFAULT_RATIO, DEFAULT_SELECTOR, DEFAULT_VLLM_GUARD_MARGIN
from blend.errors import InvalidRequestError
from blend.integrations.vllm.plan import PARAMS_KEY, blend_request, blend_salt, parse_blend_params, prompt_spans
from blend.logprobs import token_bytes
from blend.policy import RECOMPUTE_PRECISION_FIELDS
from blend.prompt import build_prompt
from blend.sampling import MAX_TOP_LOGPROBS
from blend.serve.schemas import ChatMessage, Document, conversation, document_text_of, logprob_alternatives

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# chat-only options with no completions equivalent: refused unless left at their defaults
REFUSED_UNLESS_DEFAULT: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "echo": (None, False),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "chat_template": (None,), "chat_template_kwargs": (None, {}), "mm_processor_kwargs": (None, {}),
    "reasoning_effort": (None,),
}
# chat fields the rewrite consumes (they do not go on to the completions request)
CONSUMED = frozenset({"messages", "documents", "max_completion_tokens", "kv_transfer_params", "cache_salt",
                      "max_tokens", "parallel_tool_calls", "include_reasoning", "logprobs", "top_logprobs",
                      *REFUSED_UNLESS_DEFAULT})
ENTRY_KEYS = frozenset({"mode", "ratio", "selector", "guard_margin",  # a chat request's kvblend entry
                        *(name for name, _ in RECOMPUTE_PRECISION_FIELDS)})
_MESSAGES = TypeAdapter(list[ChatMessage])
_DOCUMENTS = TypeAdapter(list[Document | str])


def is_kvblend_chat(body: Any) -> bool:
    """Whether a chat body asks kvblend to lay out its documents (``documents`` plus a ``kvblend`` entry).

    Args:
        body: the request's parsed JSON body (any value: untrusted).

    Returns:
        True for an object with non-empty ``documents`` and a ``kv_transfer_params`` object holding
        :data:`~blend.integrations.vllm.plan.PARAMS_KEY`.
    """
    if not isinstance(body, dict) or not body.get("documents"):
        return False
    params = body.get("kv_transfer_params")
    return isinstance(params, dict) and PARAMS_KEY in params


def _document_texts(raw: Any) -> list[str]:
    try:
        docs = _DOCUMENTS.validate_python(raw)
    except ValidationError as e:
        raise InvalidRequestError(f"documents: a list of strings or {{'text', 'title'?}} objects "
                                  f"({e.errors()[0]['msg']})") from None
    out = []
    for i, d in enumerate(docs):
        text = document_text_of(d)
        if not text.strip():
            raise InvalidRequestError(f"document {i + 1} is empty")
        out.append(text)
    return out


def chat_to_completion(body: dict[str, Any], tokenizer) -> dict[str, Any]:
    """Lay out a kvblend chat request (see :func:`is_kvblend_chat`) as a completions request.

    Args:
        body: the chat request's JSON body (untrusted).
        tokenizer: the served model's tokenizer (the one kvblend's engine loads from the same directory).

    Returns:
        The completions body: ``prompt`` as kvblend's token ids, the ``kvblend`` entry with the
        documents' spans, the blend's ``cache_salt``, the chat's sampling fields.

    Raises:
        InvalidRequestError: malformed messages or documents, a chat-only option that completions cannot
            honour, spans given by the client, or a malformed ``kvblend`` entry.
    """
    try:
        messages = _MESSAGES.validate_python(body.get("messages"))
    except ValidationError:
        raise InvalidRequestError("messages: a list of {role, content} with text content") from None
    for key, defaults in REFUSED_UNLESS_DEFAULT.items():
        if key in body and body[key] not in defaults:
            raise InvalidRequestError(f"{key!r} is not supported on a chat request with kvblend documents")
    entry = body["kv_transfer_params"][PARAMS_KEY]
    if not isinstance(entry, dict):
        raise InvalidRequestError(f"kv_transfer_params[{PARAMS_KEY!r}] must be an object")
    if "documents" in entry:
        raise InvalidRequestError("a chat request names its documents in 'documents'; kvblend finds their "
                                  "token spans itself (spans in kv_transfer_params are for token-id prompts)")
    unknown = set(entry) - ENTRY_KEYS
    if unknown:
        raise InvalidRequestError(f"unknown kvblend option(s) {sorted(unknown)}; known: {sorted(ENTRY_KEYS)}")
    mode = entry.get("mode", "blend")
    if mode not in ("blend", "exact"):
        raise InvalidRequestError(f"kvblend mode must be 'blend' or 'exact', got {mode!r}")
    tenant = body.get("cache_salt")
    if tenant is not None and not isinstance(tenant, str):
        raise InvalidRequestError("cache_salt must be a string")
    top_n = _top_logprobs(body)
    try:
        system, history, question = conversation(messages)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None
    prompt = build_prompt(tokenizer, question, _document_texts(body["documents"]), system, history)
    ids = prompt.token_ids
    params, salt = dict(body["kv_transfer_params"]), tenant
    if mode == "blend":
        params[PARAMS_KEY] = blend_request(ids, prompt_spans([len(s) for s in prompt.segments]),
                                           ratio=entry.get("ratio", DEFAULT_RATIO),
                                           selector=entry.get("selector", DEFAULT_SELECTOR),
                                           guard_margin=entry.get("guard_margin", DEFAULT_VLLM_GUARD_MARGIN),
                                           **{name: entry.get(name, default)
                                              for name, default in RECOMPUTE_PRECISION_FIELDS})[PARAMS_KEY]
        salt = blend_salt(params, ids, tenant or "")
    else:
        parse_blend_params(params, len(ids))  # an exact entry's values are checked too (a blend option refused)
    out = {k: v for k, v in body.items() if k not in CONSUMED}
    # max_completion_tokens where set (not null), else max_tokens (OpenAI's precedence)
    budget = body.get("max_completion_tokens")
    out.update(prompt=ids, max_tokens=budget if budget is not None else body.get("max_tokens"),
               kv_transfer_params=params)
    if top_n is not None:
        out["logprobs"] = top_n  # completions' form: alternatives per token
        out["return_tokens_as_token_ids"] = True  # exact bytes per token (TokenNamer), alternatives kept apart
    if salt is not None:
        out["cache_salt"] = salt
    return out


def _top_logprobs(body: dict[str, Any]) -> int | None:
    """A chat request's ``logprobs``/``top_logprobs`` as completions' ``logprobs`` (None: not asked for).

    Raises:
        InvalidRequestError: not a boolean / not an integer in [0, MAX_TOP_LOGPROBS], or
            ``top_logprobs`` without ``logprobs: true``.
    """
    want, top = body.get("logprobs"), body.get("top_logprobs")
    if want is not None and not isinstance(want, bool):
        raise InvalidRequestError("logprobs must be true or false")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise InvalidRequestError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]")
    try:
        return logprob_alternatives(want, top)  # the rule kvblend serve applies to the same pair
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None


_TOKEN_ID = re.compile(r"token_id:(\d{1,12})")  # vLLM's placeholder for a token under return_tokens_as_token_ids


@dataclass(frozen=True)
class TokenNamer:
    """Turns vLLM's ``token_id:N`` placeholders (the forwarded completions request asks for them) back
    into each token's text and its own bytes (:func:`blend.logprobs.token_bytes`): vLLM's token text
    of a piece of a multi-byte character is U+FFFD, so its UTF-8 is not the token's bytes, and
    alternatives keyed by that text collapse into one.

    Attributes:
        tokenizer: the served model's tokenizer.
        as_ids: the client asked for ``return_tokens_as_token_ids`` itself: tokens stay placeholders.
    """

    tokenizer: Any
    as_ids: bool = False

    def __call__(self, tok: Any) -> tuple[Any, list[int]]:
        """A token as vLLM named it -> (the chat ``token``, its ``bytes``); a string that is no placeholder
        (a server that ignored the request) keeps its text and that text's UTF-8."""
        m = _TOKEN_ID.fullmatch(tok) if isinstance(tok, str) else None
        tid = int(m.group(1)) if m else -1
        if not 0 <= tid < len(self.tokenizer):
            return _plain_name(tok)
        text = tok if self.as_ids else self.tokenizer.decode([tid])
        return text, list(token_bytes(self.tokenizer, tid))


def _plain_name(tok: Any) -> tuple[Any, list[int]]:
    """A token named by its text: (the text, its UTF-8)."""
    return tok, list(str(tok).encode("utf-8"))


def chat_logprobs(lp: Any, top_n: int | None, namer: TokenNamer | None = None) -> dict[str, Any] | None:
    """A completions choice's ``logprobs`` in the chat form (``{"content": [...], "refusal": null}``).

    Args:
        lp: the completions choice's ``{"tokens", "token_logprobs", "top_logprobs", ...}`` (or None).
        top_n: the alternatives the chat request asked for (None: it asked for no logprobs).
        namer: resolves ``token_id:N`` placeholders (None: tokens are text, their bytes its UTF-8).

    Returns:
        The chat ``logprobs`` object, or None (not asked for, or nothing came back).
    """
    if top_n is None or not isinstance(lp, dict) or not isinstance(lp.get("tokens"), list):
        return None
    name = namer or _plain_name
    tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
    content = []
    for tok, logprob, top in zip(lp["tokens"], lp.get("token_logprobs") or [], tops):
        alts = sorted((top or {}).items(), key=lambda kv: -(kv[1] if kv[1] is not None else float("inf")))[:top_n]
        text, raw = name(tok)
        named = [(*name(t), v) for t, v in alts]  # (token, bytes, logprob)
        content.append({"token": text, "logprob": logprob, "bytes": raw,
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": b} for t, b, v in named]})
    return {"content": content, "refusal": None}


def _chat_id(completion_id: Any) -> str:
    s = str(completion_id or "")
    return "chatcmpl-" + (s[len("cmpl-"):] if s.startswith("cmpl-") else s)


def completion_to_chat(resp: dict[str, Any], top_logprobs: int | None = None,
                       namer: TokenNamer | None = None) -> dict[str, Any]:
    """A completions response as the chat completion it answers.

    Args:
        resp: vLLM's ``text_completion`` response body.
        top_logprobs: alternatives per token the chat request asked for (None: no logprobs).
        namer: resolves the logprobs' ``token_id:N`` placeholders (None: tokens are text).

    Returns:
        An OpenAI ``chat.completion`` body (vLLM's ``kv_transfer_params``, with kvblend's report, kept).
    """
    choices = []
    for c in resp.get("choices") or []:
        choice = {"index": c.get("index", 0), "message": {"role": "assistant", "content": c.get("text", "")},
                  "logprobs": chat_logprobs(c.get("logprobs"), top_logprobs, namer),
                  "finish_reason": c.get("finish_reason"), "stop_reason": c.get("stop_reason")}
        if c.get("token_ids") is not None:
            choice["token_ids"] = c["token_ids"]
        choices.append(choice)
    out = {"id": _chat_id(resp.get("id")), "object": "chat.completion", "created": resp.get("created"),
           "model": resp.get("model"), "choices": choices, "usage": resp.get("usage")}
    for key in ("system_fingerprint", "service_tier", "kv_transfer_params", "metrics"):
        if resp.get(key) is not None:
            out[key] = resp[key]
    return out


class ChunkConverter:
    """Streamed completion chunks as chat completion chunks (the first delta of each choice names the role).

    Args:
        top_logprobs: alternatives per token the chat request asked for (None: no logprobs).
        namer: resolves the logprobs' ``token_id:N`` placeholders (None: tokens are text).
    """

    def __init__(self, top_logprobs: int | None = None, namer: TokenNamer | None = None) -> None:
        self._started: set[int] = set()
        self.top_logprobs = top_logprobs
        self.namer = namer

    def __call__(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """One ``text_completion`` chunk as a ``chat.completion.chunk``."""
        choices = []
        for c in chunk.get("choices") or []:
            idx = c.get("index", 0)
            delta: dict[str, Any] = {"content": c.get("text", "")}
            if idx not in self._started:
                self._started.add(idx)
                delta = {"role": "assistant", **delta}
            choices.append({"index": idx, "delta": delta,
                            "logprobs": chat_logprobs(c.get("logprobs"), self.top_logprobs, self.namer),
                            "finish_reason": c.get("finish_reason"), "stop_reason": c.get("stop_reason")})
        out = {"id": _chat_id(chunk.get("id")), "object": "chat.completion.chunk", "created": chunk.get("created"),
               "model": chunk.get("model"), "choices": choices}
        for key in ("usage", "system_fingerprint", "metrics"):
            if chunk.get(key) is not None:
                out[key] = chunk[key]
        return out
