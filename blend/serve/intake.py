"""From a validated request body to what the scheduler runs, with every limit checked.

Each refusal is an :class:`ApiError` carrying its HTTP status and a message
that names the field and the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from blend.errors import InvalidPolicyError, InvalidRequestError
from blend.generation import stop_strings
from blend.policy import ProbePrecision, ReusePolicy
from blend.prompt import Prompt
from blend.sampling import GenerationConfig
from blend.serve.config import ServeConfig
from blend.serve.protocol import Endpoint, ErrorType
from blend.serve.schemas import ChatCompletionRequest, CompletionRequest, KvblendOptions


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


def policy_for(opts: KvblendOptions, salt: str) -> ReusePolicy:
    """The request's reuse policy (same gates as the CLI: blend and semantic are opt-ins)."""
    if opts.reuse == "none":  # nothing is looked up or stored: a salt has nothing to key
        if opts.semantic:
            raise InvalidPolicyError("semantic reuse is a blend option: use kvblend.reuse = \"blend\"")
        return ReusePolicy.none()
    if opts.reuse == "exact":
        if opts.semantic:
            raise InvalidPolicyError("semantic reuse is a blend option: use kvblend.reuse = \"blend\"")
        return ReusePolicy.exact(cache_salt=salt)
    return ReusePolicy.blend(ratio=opts.ratio, selector=opts.selector, semantic=opts.semantic, cache_salt=salt,
                             guard_margin=opts.guard_margin, guard_ratio=opts.guard_ratio,
                             candidates=opts.candidates, probe_precision=ProbePrecision(opts.probe_precision),
                             reused_temperature=opts.reused_temperature)


def prepare(engine, cfg: ServeConfig, body: ChatCompletionRequest | CompletionRequest, endpoint: Endpoint) -> Job:
    """Check ``body`` against the server's limits and build its prompt, policy and sampling settings.

    Raises:
        ApiError: 400 (bad value, context exceeded), 404 (unknown model), 413 (too many documents,
            prompt over the server's limit).
    """
    limits = cfg.limits
    if body.model is not None and body.model not in (cfg.model_id, engine.model_name):
        raise ApiError(404, f"model {body.model!r} is not served here; this server serves {cfg.model_id!r}",
                       ErrorType.NOT_FOUND, "model", "model_not_found")
    refused = body.refused_field()
    if refused is not None:
        raise ApiError(400, f"{refused} is not supported by kvblend serve (no tool calls, constrained decoding, "
                       "echo or several candidates)",
                       param=refused)
    try:
        logprobs = body.logprob_alternatives()
    except ValueError as e:
        raise ApiError(400, str(e), param="top_logprobs") from None
    try:
        logit_bias = body.logit_bias_pairs(engine.dims.vocab)
    except ValueError as e:
        raise ApiError(400, str(e), param="logit_bias") from None
    docs = body.document_texts()
    if len(docs) > limits.max_documents:
        raise ApiError(413, f"{len(docs)} documents; this server takes at most {limits.max_documents} per request",
                       ErrorType.TOO_LARGE, "documents")
    opts = body.kvblend or KvblendOptions()
    if opts.semantic and not engine.config.experimental_semantic:
        raise ApiError(400, "semantic reuse is experimental: start the server with --experimental-semantic",
                       param="kvblend.semantic")
    try:
        policy = policy_for(opts, body.cache_salt or "")
    except InvalidPolicyError as e:
        raise ApiError(400, str(e), param="kvblend") from None
    try:
        if endpoint is Endpoint.CHAT:
            system, history, question = body.conversation()
        else:
            system, history, question = None, (), body.question()
    except ValueError as e:
        raise ApiError(400, str(e), param="messages" if endpoint is Endpoint.CHAT else "prompt") from None
    max_tokens = body.token_budget() or limits.default_max_tokens
    if max_tokens > limits.max_tokens:
        raise ApiError(400, f"max_tokens={max_tokens} exceeds this server's limit of {limits.max_tokens}",
                       param="max_tokens")
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    try:
        gen = GenerationConfig(
            max_tokens=max_tokens,
            temperature=cfg.default_temperature if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=top_k, seed=body.seed,
            stop=stop_strings(body.stop), stop_at_newline=opts.stop_at_newline, ignore_eos=body.ignore_eos,
            logprobs=logprobs, presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias=logit_bias,
        )
    except InvalidRequestError as e:
        raise ApiError(400, str(e)) from None
    try:
        prompt = engine.build_prompt(question, docs, system, history)
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param="messages" if endpoint is Endpoint.CHAT else "prompt") from None
    context = engine.dims.max_positions
    limit = min(limits.max_prompt_tokens or context, context)
    if len(prompt) > limit:
        raise ApiError(413, f"prompt of {len(prompt)} tokens (system, documents and question) exceeds the limit "
                       f"of {limit} tokens", ErrorType.TOO_LARGE, "documents")
    if len(prompt) + max_tokens > context:
        raise ApiError(400, f"prompt of {len(prompt)} tokens plus max_tokens={max_tokens} exceeds the model's "
                       f"context of {context} tokens", param="max_tokens", code="context_length_exceeded")
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Job(prompt, policy, gen, bool(body.stream), include_usage, opts.return_tokens)
