"""From a validated request body to what the scheduler runs, with every limit checked.

Each refusal is an :class:`ApiError` carrying its HTTP status and a message
that names the field and the limit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from blend.control_text import unmark
from blend.defaults import (
    DEFAULT_ATTENTION_PRECISION, DEFAULT_LINEAR_PRECISION, DEFAULT_PENALTY, DEFAULT_SAMPLING_TOP_K, DEFAULT_TOP_P,
)
from blend.errors import InvalidPolicyError, InvalidRequestError
from blend.generation import stop_strings
from blend.policy import POLICY_DEFAULTS, GuardMode, ProbePrecision, RecomputePrecision, ReuseMode, ReusePolicy
from blend.policy_rules import BLEND_OPTIONS, setting_changed
from blend.prompt import Prompt, adds_special_tokens, bos_prompt
from blend.sampling import GenerationConfig, InvalidSettingError
from blend.serve.config import ServeConfig
from blend.serve.protocol import Endpoint, ErrorType
from blend.serve.schemas import ChatCompletionRequest, CompletionRequest, KvblendOptions

# the ``kvblend`` options only a blend reads (the policy's blend settings, blend.policy_rules.BLEND_OPTIONS), set away
# from the policy's defaults under reuse "exact" or "none": refused (``ratio: 0.3`` beside ``reuse: "exact"`` was
# dropped without a word). Where the option's own default is None, None is not a setting: the server's default
BLEND_SETTINGS = tuple(name for name in KvblendOptions.model_fields if name in BLEND_OPTIONS)


class ApiError(Exception):
    """A request refused with an HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, kind: ErrorType = ErrorType.INVALID_REQUEST,
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.headers = headers or {}


@dataclass(frozen=True)
class Job:
    """One request, ready for the scheduler."""

    prompt: Prompt
    policy: ReusePolicy
    config: GenerationConfig
    stream: bool
    include_usage: bool
    return_tokens: bool

    @property
    def logprobs(self) -> bool:
        """The request asked for its tokens' log-probabilities."""
        return self.config.logprobs is not None


def policy_for(opts: KvblendOptions, salt: str, take_exact: bool = False,
               precisions: tuple[str, str] = (DEFAULT_ATTENTION_PRECISION, DEFAULT_LINEAR_PRECISION)) -> ReusePolicy:
    """The request's reuse policy (same gates as the CLI: blend and semantic are opt-ins).

    Args:
        opts: the request's ``kvblend`` options.
        salt: its cache salt.
        take_exact: a blend's ``take_exact`` where the request names none (the server's: on when it
            refines, whose exact KV a blend would not take otherwise).
        precisions: a blend's ``attention_precision`` and ``linear_precision`` where the request names
            none (the server's defaults).

    Returns:
        The policy.

    Raises:
        InvalidPolicyError: options that contradict each other.
    """
    mode = ReuseMode(opts.reuse)
    if mode is not ReuseMode.BLEND:  # a blend option under another mode is refused, not dropped
        for name in BLEND_SETTINGS:
            value = getattr(opts, name)
            if value is None and KvblendOptions.model_fields[name].default is None:
                continue  # not given (a blend takes the server's default)
            if setting_changed(name, value, POLICY_DEFAULTS):
                label = "semantic reuse" if name == "semantic" else name
                raise InvalidPolicyError(f"{label} is a blend option: use kvblend.reuse = \"blend\"")
    if mode is ReuseMode.NONE:  # nothing is looked up or stored: a salt has nothing to key
        return ReusePolicy.none()
    if mode is ReuseMode.EXACT:
        return ReusePolicy.exact(cache_salt=salt)
    return ReusePolicy.blend(ratio=opts.ratio, selector=opts.selector, semantic=opts.semantic, cache_salt=salt,
                             guard_margin=opts.guard_margin, guard_ratio=opts.guard_ratio,
                             guard_mode=GuardMode(opts.guard_mode),
                             candidates=opts.candidates, probe_precision=ProbePrecision(opts.probe_precision),
                             reused_temperature=opts.reused_temperature,
                             attention_precision=RecomputePrecision(opts.attention_precision or precisions[0]),
                             linear_precision=RecomputePrecision(opts.linear_precision or precisions[1]),
                             take_exact=take_exact if opts.take_exact is None else opts.take_exact)


def prepare(engine, cfg: ServeConfig, body: ChatCompletionRequest | CompletionRequest, endpoint: Endpoint) -> Job:
    """Check ``body`` against the server's limits and build its prompt, policy and sampling settings.

    Args:
        engine: the server's engine (its tokenizer, dims and config).
        cfg: the server's config (its limits, model id, default temperature, precisions).
        body: the parsed request body.
        endpoint: which endpoint received it (chat or completions).

    Returns:
        The :class:`Job`: prompt, policy, generation config and response options.

    Raises:
        ApiError: 400 (bad value; ``context_length_exceeded``: the prompt, or the prompt and the asked
            budget, over the model's context), 404 (unknown model), 413 (too many documents, prompt over
            the server's ``max_prompt_tokens``).
    """
    limits = cfg.limits
    if body.model is not None and body.model not in (cfg.model_id, engine.model_name):
        raise ApiError(404, f"model {body.model!r} is not served here; this server serves {cfg.model_id!r}",
                       ErrorType.NOT_FOUND, "model", "model_not_found")
    refused = body.refused_field()
    if refused is not None:
        raise ApiError(400, f"{refused} is not supported by kvblend serve at that value: it would change the answer "
                       "and kvblend does not implement it (no tool calls, constrained decoding, echo, several "
                       "candidates, or vLLM's min_p, min_tokens, repetition_penalty, stop_token_ids, ...)",
                       param=refused)
    if body.add_special_tokens and adds_special_tokens(engine.tokenizer):
        raise ApiError(400, "add_special_tokens: true is not supported by kvblend serve with this model: its "
                       "tokenizer would add special tokens (a BOS) in front of the prompt, whose layout takes the "
                       "chat template's own (send false, vLLM's chat default, or leave it out)",
                       param="add_special_tokens")
    try:
        logprobs = body.logprob_alternatives()
    except ValueError as e:
        raise ApiError(400, str(e), param="top_logprobs") from None
    try:
        logit_bias = body.logit_bias_pairs(engine.dims.vocab)
    except ValueError as e:
        raise ApiError(400, str(e), param="logit_bias") from None
    messages = len(getattr(body, "messages", ()))
    if messages > limits.max_messages:
        raise ApiError(413, f"{messages} messages; this server takes at most {limits.max_messages} per request",
                       ErrorType.TOO_LARGE, "messages")
    docs = body.document_texts()
    if len(docs) > limits.max_documents:
        raise ApiError(413, f"{len(docs)} documents; this server takes at most {limits.max_documents} per request",
                       ErrorType.TOO_LARGE, "documents")
    opts = body.kvblend or KvblendOptions()
    if opts.semantic and not engine.config.experimental_semantic:
        raise ApiError(400, "semantic reuse is experimental: start the server with --experimental-semantic",
                       param="kvblend.semantic")
    try:
        policy = policy_for(opts, body.cache_salt or "", take_exact=cfg.scheduler.refine_after is not None,
                            precisions=(cfg.attention_precision, cfg.linear_precision))
    except InvalidPolicyError as e:
        raise ApiError(400, str(e), param="kvblend") from None
    try:
        if endpoint is Endpoint.CHAT:
            system, history, question = body.conversation()
        else:
            system, history, question = None, (), body.question()
    except ValueError as e:
        raise ApiError(400, str(e), param="messages" if endpoint is Endpoint.CHAT else "prompt") from None
    prompt_param = "messages" if endpoint is Endpoint.CHAT else "prompt"
    asked, budget_param = body.token_budget(), body.budget_param()
    if asked is not None and asked > limits.max_tokens:
        raise ApiError(400, f"{budget_param}={asked} exceeds this server's limit of {limits.max_tokens}",
                       param=budget_param)
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else DEFAULT_SAMPLING_TOP_K  # vLLM's -1: off
    try:
        gen = GenerationConfig(
            max_tokens=asked or min(limits.default_max_tokens, limits.max_tokens),
            temperature=cfg.default_temperature if body.temperature is None else body.temperature,
            top_p=DEFAULT_TOP_P if body.top_p is None else body.top_p, top_k=top_k, seed=body.seed,
            stop=stop_strings(body.stop), stop_at_newline=opts.stop_at_newline, ignore_eos=bool(body.ignore_eos),
            logprobs=logprobs,
            presence_penalty=DEFAULT_PENALTY if body.presence_penalty is None else body.presence_penalty,
            frequency_penalty=DEFAULT_PENALTY if body.frequency_penalty is None else body.frequency_penalty,
            logit_bias=logit_bias,
        )
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param=_setting_param(e, body, endpoint)) from None
    context = engine.dims.max_positions
    server_limit = limits.max_prompt_tokens
    if history:  # laying out a conversation re-renders it once per turn: refuse one that cannot fit before
        # paying for that (its texts alone, tokenized once, already exceed the limit)
        # each text as the prompt builder takes it (markers removed, stripped): padding never reaches the model
        least = sum(len(engine.tokenizer(unmark(t).strip(), add_special_tokens=False)["input_ids"])
                    for t in (question, *docs, *(turn.text for turn in history)))
        # in the order of the checks after the layout: the server's limit (413), then the model's context (400)
        if server_limit is not None and server_limit < context and least > server_limit:
            raise ApiError(413, f"the conversation's texts alone are {least} tokens, over the limit of "
                           f"{server_limit} tokens", ErrorType.TOO_LARGE, "documents")
        if least >= context:
            raise ApiError(400, f"the conversation's texts alone are {least} tokens: no room in the model's "
                           f"context of {context} tokens ({engine.dims.context_from})", param=prompt_param,
                           code="context_length_exceeded")
    try:
        if endpoint is Endpoint.COMPLETIONS and question == "":  # OpenAI's empty prompt: generate from BOS
            if docs:
                raise InvalidRequestError("the prompt is empty: documents are laid out before a question, so "
                                          "give one (an empty prompt generates from the BOS token alone)")
            prompt = bos_prompt(engine.tokenizer)
        else:
            prompt = engine.build_prompt(question, docs, system, history)
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param=prompt_param) from None
    if server_limit is not None and server_limit < context and len(prompt) > server_limit:
        raise ApiError(413, f"prompt of {len(prompt)} tokens (system, documents and question) exceeds the limit "
                       f"of {server_limit} tokens", ErrorType.TOO_LARGE, "documents")
    room = context - len(prompt)  # answer tokens the context still holds
    if room < 1:
        raise ApiError(400, f"prompt of {len(prompt)} tokens (system, documents and question) leaves no room in "
                       f"the model's context of {context} tokens ({engine.dims.context_from})", param=prompt_param,
                       code="context_length_exceeded")
    if asked is None:  # the server's default budget, cut to the room left
        gen = replace(gen, max_tokens=min(gen.max_tokens, room))
    elif asked > room:
        raise ApiError(400, f"prompt of {len(prompt)} tokens plus {budget_param}={asked} exceeds the model's "
                       f"context of {context} tokens ({engine.dims.context_from})", param=budget_param,
                       code="context_length_exceeded")
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Job(prompt, policy, gen, bool(body.stream), include_usage, opts.return_tokens)


def _setting_param(error: InvalidRequestError, body: ChatCompletionRequest | CompletionRequest,
                   endpoint: Endpoint) -> str | None:
    """The request field behind a refused sampling setting.

    Args:
        error: what :class:`GenerationConfig` raised.
        body: the request.
        endpoint: which endpoint (chat's alternatives are ``top_logprobs``).

    Returns:
        The field's name as the client sent it, or None when the error names no field.
    """
    field = error.field if isinstance(error, InvalidSettingError) else None
    if field == "max_tokens":
        return body.budget_param()
    if field == "logprobs" and endpoint is Endpoint.CHAT:
        return "top_logprobs"
    return field
