"""How one request decodes (:class:`GenerationConfig`, validated on construction) and the bounds its
settings lie in. The sampler that reads it is :mod:`blend.sampling`; this module imports no torch, so a
command line's sampling flags are checked (``kvblend ask --temperature 9``) before anything heavy loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from blend.defaults import (DEFAULT_MAX_NEW_TOKENS, DEFAULT_PENALTY, DEFAULT_SAMPLING_TOP_K, DEFAULT_TEMPERATURE,
                            DEFAULT_TOP_P, MAX_SAMPLING_TEMPERATURE, MAX_SEED, MIN_SAMPLING_SEED,
                            MIN_SAMPLING_TEMPERATURE)
from blend.errors import InvalidRequestError
from blend.numeric import finite_real

DEFAULT_MAX_TOKENS = DEFAULT_MAX_NEW_TOKENS  # the Python API's and the CLI's budget (the server has its own)
MAX_STOP_STRINGS = 4  # as OpenAI allows
MAX_STOP_CHARS = 64
MAX_TOP_LOGPROBS = 20  # alternatives per token at most (OpenAI's chat limit, vLLM's default)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]
MAX_LOGIT_BIAS_TOKENS = 300  # tokens one logit_bias may name (OpenAI's limit)


class InvalidSettingError(InvalidRequestError):
    """A :class:`GenerationConfig` field out of range.

    Args:
        field: the offending field's name (``max_tokens``, ``stop`` ...).
        message: what is wrong, naming the field and its range.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class GenerationConfig:
    """How one request decodes (validated on construction).

    Attributes:
        max_tokens: generated tokens at most (>= 1).
        temperature: 0 = greedy (as is any below MIN_SAMPLING_TEMPERATURE); otherwise logits are
            divided by it (<= 2).
        top_p: nucleus sampling: the smallest set of tokens whose probability reaches it (0 <= p <= 1;
            the most likely token is always kept, so 0 keeps only it).
        top_k: keep only the k most likely tokens (0 = off).
        seed: sampling seed; None draws one (answers then differ run to run).
        stop: strings that end the answer; the answer's text stops before the first one.
        stop_at_newline: end the answer before the first token containing a newline
            (the engine's historical single-line answers).
        ignore_eos: keep going past end-of-sequence tokens (fixed-length answers for
            benchmarks, as vLLM's ``ignore_eos``).
        logprobs: None = off; N = record each answer token's log-probability and the N
            most likely alternatives of its step (0..MAX_TOP_LOGPROBS; see :mod:`blend.logprobs`).
        presence_penalty: subtracted from the logit of every token the answer already holds.
        frequency_penalty: subtracted once per occurrence in the answer so far.
        logit_bias: (token id, bias) pairs added to those tokens' logits at every step.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_SAMPLING_TOP_K
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_at_newline: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = DEFAULT_PENALTY
    frequency_penalty: float = DEFAULT_PENALTY
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidSettingError("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _finite(self.temperature) or not 0.0 <= self.temperature <= MAX_SAMPLING_TEMPERATURE:
            raise InvalidSettingError("temperature", f"temperature must be in [0, 2], got {self.temperature!r}")
        if not _finite(self.top_p) or not 0.0 <= self.top_p <= 1.0:
            raise InvalidSettingError("top_p", f"top_p must be in [0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidSettingError("top_k", f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not MIN_SAMPLING_SEED <= self.seed < MAX_SEED):
            raise InvalidSettingError("seed", f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}")
        if isinstance(self.stop, str) or not isinstance(self.stop, tuple):
            raise InvalidSettingError("stop", "stop must be a tuple of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidSettingError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
                raise InvalidSettingError("stop", f"each stop string must be 1..{MAX_STOP_CHARS} characters, "
                                                  f"got {s!r}")
        n = self.logprobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS):
            raise InvalidSettingError("logprobs", f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] "
                                                  f"(alternatives per token) or None, got {n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _finite(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise InvalidSettingError(name, f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v!r}")
        if not isinstance(self.logit_bias, tuple) or len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidSettingError("logit_bias", f"logit_bias must be a tuple of at most "
                                                    f"{MAX_LOGIT_BIAS_TOKENS} (token, bias) pairs")
        for pair in self.logit_bias:
            if (not isinstance(pair, tuple) or len(pair) != 2 or isinstance(pair[0], bool)
                    or not isinstance(pair[0], int) or pair[0] < 0 or not _finite(pair[1])
                    or not -MAX_LOGIT_BIAS <= pair[1] <= MAX_LOGIT_BIAS):
                raise InvalidSettingError("logit_bias", f"logit_bias: each entry is a token id >= 0 and a bias in "
                                                        f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {pair!r}")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids):  # the biases would add up past the bound
            twice = sorted({t for t in ids if ids.count(t) > 1})
            raise InvalidSettingError("logit_bias", f"logit_bias names token(s) {twice} more than once")

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or one too small to divide float32 logits by."""
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    def check_vocabulary(self, vocab: int) -> None:
        """Refuse ``logit_bias`` ids outside a model's vocabulary (a bias on no token would be ignored).

        Args:
            vocab: the model's vocabulary size (its logits' length).

        Raises:
            InvalidSettingError: an id >= ``vocab``.
        """
        outside = sorted(t for t, _ in self.logit_bias if t >= vocab)
        if outside:
            raise InvalidSettingError("logit_bias", f"logit_bias: token id(s) {outside[:5]} are not in this model's "
                                                    f"vocabulary (0..{vocab - 1})")

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a logit bias change the logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


def _finite(x: object) -> bool:
    """An int or float (not a bool) whose float is finite (an integer too large for a float is not)."""
    return isinstance(x, (int, float)) and finite_real(x)
