"""Request schemas (pydantic): OpenAI's chat and completions requests plus kvblend's fields.

    {"model": ..., "messages": [...] | "prompt": ...,
     "documents": [{"text": ..., "title"?: ...} | "text", ...],   each document is one prompt segment
     "cache_salt": "tenant-secret",                                 mixed into every cache key
     "kvblend": {"reuse": "exact"|"blend"|"none", "ratio": 0.15, "selector": "probe", "semantic": false,
                 "stop_at_newline": false, "return_tokens": false},
     "temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stream", "stream_options", "n": 1,
     "logprobs": true, "top_logprobs": N   (chat)  |  "logprobs": N   (completions),
     "presence_penalty", "frequency_penalty", "logit_bias": {"token id": bias},
     "ignore_eos": false}                                           (vLLM's; fixed-length answers)

Unknown top-level fields (OpenAI's ``user``, ``metadata`` ...) are ignored,
as OpenAI-compatible servers do; fields that would change the answer and that
kvblend cannot honour (``tools``, ``functions``, a JSON ``response_format``,
vLLM's ``guided_*`` and the others of :data:`UNDECLARED_NEUTRAL`) are refused
rather than ignored; unknown fields inside ``kvblend`` or a
document are errors, since a misspelt reuse option must not silently fall
back to a default.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import (
    AllowInfNan, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator,
)

from blend.defaults import (
    DEFAULT_CANDIDATES, DEFAULT_GUARD_MARGIN, DEFAULT_GUARD_MODE, DEFAULT_GUARD_RATIO, DEFAULT_PROBE_PRECISION,
    DEFAULT_RATIO, DEFAULT_REUSED_TEMPERATURE, DEFAULT_SELECTOR, MAX_SAMPLING_TEMPERATURE, MAX_SEED, MIN_SAMPLING_SEED,
    REUSED_TEMPERATURE_RANGE,
)
from blend.policy import GUARD_MODE_NAMES, PROBE_PRECISION_NAMES, RECOMPUTE_PRECISION_NAMES, SELECTOR_NAMES, ReuseMode
from blend.prompt import Role, Turn, is_unicode
from blend.sampling import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, MAX_PENALTY, MAX_TOP_LOGPROBS

ReuseModeName = Literal[tuple(m.value for m in ReuseMode)]  # type: ignore[valid-type]
Selector = Literal[SELECTOR_NAMES]  # type: ignore[valid-type]
ProbePrecisionName = Literal[PROBE_PRECISION_NAMES]  # type: ignore[valid-type]
RecomputePrecisionName = Literal[RECOMPUTE_PRECISION_NAMES]  # type: ignore[valid-type]
GuardModeName = Literal[GUARD_MODE_NAMES]  # type: ignore[valid-type]
# every number a request may carry: JSON as Python reads it takes NaN, Infinity and -Infinity, which failed a
# range check instead ("temperature: NaN" was told "less than or equal to 2"); they are "not a finite number" now
FiniteNumber = Annotated[StrictFloat, AllowInfNan(False)]


class FieldError(ValueError):
    """A request-level check's failure that names its field (a model validator's error has no field of its
    own: pydantic locates it at the body), so the 400's ``param`` can name it as a field check's does."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param  # the field's path, dotted as pydantic writes locations ("messages.1.content")


class Document(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1)
    title: str | None = None


class KvblendOptions(BaseModel):
    """The ``kvblend`` extension object: reuse options and extras."""

    model_config = ConfigDict(extra="forbid")

    reuse: ReuseModeName = ReuseMode.EXACT.value
    ratio: FiniteNumber = Field(DEFAULT_RATIO, ge=0.0, le=1.0)
    selector: Selector = DEFAULT_SELECTOR
    semantic: StrictBool = False
    guard_margin: FiniteNumber | None = Field(DEFAULT_GUARD_MARGIN, ge=0.0)  # near-tie guard (nats); None: off
    guard_ratio: FiniteNumber = Field(DEFAULT_GUARD_RATIO, ge=0.0, le=1.0)
    guard_mode: GuardModeName = DEFAULT_GUARD_MODE  # how the guard's recompute runs (blend.policy.GuardMode)
    candidates: FiniteNumber | None = Field(DEFAULT_CANDIDATES, ge=1.0)  # probe selectors: candidate factor
    probe_precision: ProbePrecisionName = DEFAULT_PROBE_PRECISION  # the probe's GEMM dtype
    # blend: dtype of the recomputed rows' attention and linear layers above the last check layer
    # (blend.policy.RecomputePrecision); None: the server's default (`kvblend serve --attention-precision`)
    attention_precision: RecomputePrecisionName | None = None
    linear_precision: RecomputePrecisionName | None = None
    reused_temperature: FiniteNumber = Field(DEFAULT_REUSED_TEMPERATURE, ge=REUSED_TEMPERATURE_RANGE[0],
                                            le=REUSED_TEMPERATURE_RANGE[1])  # reused rows' attention
    # blend: load documents this order's exact path stored (None: the server's default, on with --refine-after)
    take_exact: StrictBool | None = None
    stop_at_newline: StrictBool = False
    return_tokens: StrictBool = False  # each document's token texts in the report (the playground's highlights)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool | None = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)  # as vLLM's chat code joins a message's text parts


def document_text_of(doc: Union[Document, str]) -> str:
    """A document's text as it goes into the prompt; a title becomes its first line.

    Args:
        doc: a document object or a plain string.

    Returns:
        The string as it is, or the document's text (after its title's line where it has one).
    """
    if isinstance(doc, str):
        return doc
    return f"{doc.title}\n{doc.text}" if doc.title else doc.text


def conversation(messages: list[ChatMessage]) -> tuple[str | None, tuple[Turn, ...], str]:
    """A chat's system prompt, earlier turns and question.

    System and developer messages are joined into the system prompt; the last message must be
    the user's (the question); the user and assistant messages before it are the conversation's
    history, in order.

    Args:
        messages: the chat's messages, in order.

    Returns:
        (system prompt, or None without a system message; history turns oldest first; question).

    Raises:
        ValueError: no user message, or the last message is not the user's.
    """
    turns = [m for m in messages if m.role in ("user", "assistant")]
    if not messages or messages[-1].role != "user":
        raise ValueError("the last message must be the user's question (earlier user and assistant "
                         "turns are its history; system messages set the system prompt)")
    # no system message: the engine's default instructions; an empty one: an empty system prompt (as asked)
    system_parts = [m.text() for m in messages if m.role in ("system", "developer")]
    system = "\n\n".join(system_parts) if system_parts else None
    history = tuple(Turn(Role(m.role), m.text()) for m in turns[:-1])
    return system, history, turns[-1].text()


def logprob_alternatives(logprobs: bool | None, top_logprobs: int | None) -> int | None:
    """A chat request's alternatives per answer token (None: no logprobs), as OpenAI reads the pair.

    Args:
        logprobs: the request's ``logprobs``.
        top_logprobs: the request's ``top_logprobs`` (None: not given).

    Returns:
        The number of alternatives per token (0: the sampled token's logprob only), or None.

    Raises:
        ValueError: ``top_logprobs`` without ``logprobs: true`` (OpenAI refuses it).
    """
    if not logprobs:
        if top_logprobs is not None:
            raise ValueError("top_logprobs needs logprobs: true")
        return None
    return top_logprobs or 0


# vLLM sampling fields kvblend does not implement, and the values that ask for nothing (null included)
VLLM_NEUTRAL: dict[str, tuple] = {
    "best_of": (None, 1), "min_tokens": (None, 0), "min_p": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "stop_token_ids": (None, []), "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "use_beam_search": (None, False),
}
# fields this schema does not declare that would change the answer (or ask for output kvblend does not make),
# and the values that ask for nothing: vLLM's constrained decoding, token filters and prompt options, OpenAI's
# audio output, web search and forced function call. Any other value is refused (they were dropped unread:
# guided_choice ["yes", "no"] answered free text)
UNDECLARED_NEUTRAL: dict[str, tuple] = {
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "allowed_token_ids": (None,), "bad_words": (None, []), "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,), "return_tokens_as_token_ids": (None, False), "logits_processors": (None, []),
}
CHAT_UNDECLARED_NEUTRAL: dict[str, tuple] = {  # chat's own (completions declares its echo)
    "echo": (None, False), "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "chat_template": (None,), "chat_template_kwargs": (None, {}), "mm_processor_kwargs": (None, {}),
    "reasoning_effort": (None,), "function_call": (None, "none"), "audio": (None,), "modalities": (None, ["text"]),
    "web_search_options": (None,),
    # OpenAI's answer length and detail (its reasoning models write shorter or longer answers); "medium" is its
    # default, so it asks for nothing
    "verbosity": (None, "medium"),
}


class _Common(BaseModel):
    """Fields shared by both endpoints (undeclared ones are kept, unvalidated, for :meth:`refused_field`)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    documents: list[Union[Document, str]] | None = None
    cache_salt: str | None = Field(None, max_length=256)
    kvblend: KvblendOptions | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: FiniteNumber | None = Field(None, ge=0.0, le=MAX_SAMPLING_TEMPERATURE)
    top_p: FiniteNumber | None = Field(None, ge=0.0, le=1.0)  # 0: the most likely token only
    top_k: StrictInt | None = Field(None, ge=-1)  # -1 or 0: off (vLLM's convention)
    seed: StrictInt | None = Field(None, ge=MIN_SAMPLING_SEED, lt=MAX_SEED)  # any signed 64-bit integer (OpenAI)
    stop: Union[str, list[str], None] = None
    stream: StrictBool | None = None  # null or absent: one JSON body
    stream_options: StreamOptions | None = None
    n: StrictInt | None = Field(None, ge=1, le=1)  # one answer per request
    presence_penalty: FiniteNumber | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)  # null: 0
    frequency_penalty: FiniteNumber | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)  # null: 0
    logit_bias: dict[str, FiniteNumber] | None = Field(None, max_length=MAX_LOGIT_BIAS_TOKENS)
    tools: list | None = None  # refused when non-empty: no tool calling
    functions: list | None = None  # refused when non-empty (OpenAI's older tools)
    tool_choice: Union[str, dict, None] = None  # refused unless "none" or unset
    response_format: dict | None = None  # refused unless {"type": "text"}: no constrained decoding
    ignore_eos: StrictBool | None = False  # vLLM's extension: fixed-length answers (benchmarks)
    # vLLM's other sampling fields: accepted at their neutral value, refused otherwise (never ignored)
    best_of: StrictInt | None = None  # n = 1
    min_tokens: StrictInt | None = None
    min_p: FiniteNumber | None = None
    repetition_penalty: FiniteNumber | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    use_beam_search: StrictBool | None = None
    # vLLM's: add the tokenizer's special tokens (a BOS) in front of the prompt. kvblend's prompt is its own
    # layout of the chat template, tokenized with none added (vLLM's chat default, false): true is refused where
    # the model's tokenizer would add one (intake), accepted where it adds none
    add_special_tokens: StrictBool | None = None
    # vLLM's: spaces around special tokens in the answer's text. It changes nothing kvblend writes: special tokens
    # never reach the text (skip_special_tokens must be true), and transformers' decoding, kvblend's, has no
    # such option (fast tokenizers never read it, as vLLM's fast detokenizer does not; 5.x's python ones neither)
    spaces_between_special_tokens: StrictBool | None = None

    @field_validator("documents")
    @classmethod
    def _documents(cls, docs):
        for i, d in enumerate(docs or []):
            text = d if isinstance(d, str) else d.text
            if not text.strip():
                raise ValueError(f"document {i + 1} is empty")
        return docs

    @model_validator(mode="after")
    def _text_is_unicode(self):
        # JSON may carry a lone UTF-16 surrogate ("\ud800"), which no tokenizer takes: a 400, not a 500
        for where, text in self._texts():
            if not is_unicode(text):
                raise FieldError(where.replace("[", ".").replace("]", ""),
                                 f"{where} is not valid Unicode text (it holds a lone surrogate)")
        return self

    def _texts(self):
        """(field, text) of every text the prompt or the answer's stop is made from."""
        for i, d in enumerate(self.documents or []):
            yield f"documents[{i}]", d if isinstance(d, str) else d.text
            if not isinstance(d, str) and d.title:
                yield f"documents[{i}].title", d.title
        for i, m in enumerate(getattr(self, "messages", None) or []):
            yield f"messages[{i}].content", m.text()
        prompt = getattr(self, "prompt", None)
        for text in [prompt] if isinstance(prompt, str) else prompt or []:
            yield "prompt", text
        for text in [self.stop] if isinstance(self.stop, str) else self.stop or []:
            yield "stop", text
        if self.cache_salt:
            yield "cache_salt", self.cache_salt

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:  # OpenAI and vLLM answer 400 too
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        return self

    def refused_field(self) -> str | None:
        """A field set to something kvblend cannot honour (it would change the answer), or None."""
        if self.tools:
            return "tools"
        if self.functions:
            return "functions"
        if self.tool_choice not in (None, "none"):
            return "tool_choice"
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            return "response_format"
        for name, neutral in VLLM_NEUTRAL.items():
            if getattr(self, name) not in neutral:
                return name
        return self._undeclared_refused(UNDECLARED_NEUTRAL)

    def _undeclared_refused(self, neutral: dict[str, tuple]) -> str | None:
        """The first undeclared field of ``neutral`` the request sets to another value, or None."""
        extra = self.model_extra or {}
        return next((name for name, values in neutral.items() if extra.get(name) not in values), None)

    def logit_bias_pairs(self, vocab: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs.

        Raises:
            ValueError: a key that is not a token id of this model's vocabulary (0..vocab-1), a token named
                twice ("5" and "05"), or a bias outside [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS].
        """
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 12) or int(key) >= vocab:
                raise ValueError(f"logit_bias: {key!r} is not a token id of this model (0..{vocab - 1})")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias: the bias of token {key} must be in "
                                 f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}")
            if int(key) in {t for t, _ in pairs}:  # "5" and "05": one token twice, its biases would add up
                raise ValueError(f"logit_bias: token {int(key)} is named more than once")
            pairs.append((int(key), float(bias)))
        return tuple(pairs)

    def text_chars(self) -> int:
        """Characters of every text the request carries (documents and their titles, messages or prompt, stop
        strings, cache_salt): what deciding to prepare a request inline must count."""
        return sum(len(text) for _, text in self._texts())

    def document_texts(self) -> list[str]:
        """Document texts in order; a title becomes the document's first line."""
        return [document_text_of(d) for d in self.documents or []]


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def logprob_alternatives(self) -> int | None:
        """Alternatives per answer token to report (None: no logprobs).

        Raises:
            ValueError: ``top_logprobs`` without ``logprobs: true`` (see :func:`logprob_alternatives`).
        """
        return logprob_alternatives(self.logprobs, self.top_logprobs)

    def refused_field(self) -> str | None:
        """A field set to something kvblend cannot honour (it would change the answer), or None."""
        return super().refused_field() or self._undeclared_refused(CHAT_UNDECLARED_NEUTRAL)

    def conversation(self) -> tuple[str | None, tuple[Turn, ...], str]:
        """The system prompt, the earlier turns and the question (see :func:`conversation`).

        Raises:
            ValueError: no user message, or the last message is not the user's.
        """
        return conversation(self.messages)

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def budget_param(self) -> str:
        """The field the answer's budget came from (for errors): ``max_completion_tokens`` when set."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is the question (laid into the model's chat template)."""

    prompt: Union[str, list[str]]
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token
    echo: StrictBool | None = False  # refused when true: the prompt is kvblend's layout, not the client's text
    suffix: str | None = None  # refused when set: no insertion

    def refused_field(self) -> str | None:
        """A field set to something kvblend cannot honour (it would change the answer), or None."""
        if self.echo:
            return "echo"
        if self.suffix:
            return "suffix"
        return super().refused_field()

    def logprob_alternatives(self) -> int | None:
        """Alternatives per answer token to report (None: no logprobs)."""
        return self.logprobs

    def question(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise ValueError("prompt: exactly one prompt per request (n=1, no batches)")
            return self.prompt[0]
        return self.prompt

    def token_budget(self) -> int | None:
        return self.max_tokens

    def budget_param(self) -> str:
        """The field the answer's budget came from (for errors)."""
        return "max_tokens"
