"""The connector's decisions, as pure functions over token ids (no vLLM import).

Two kinds of claim on a vLLM request's prompt (vLLM computes the rest):

- **exact**: vLLM's own KV of whole blocks, saved in kvblend's store under
  prefix-chained block keys of a *vLLM provenance* (backend, block size and
  "K after RoPE" in the record: kvblend's own entries, under the engine's
  provenance, never alias them). A request claims the longest run of stored blocks after what
  vLLM already holds locally, leaving at least one prompt token to compute.
- **blend**: a request that names its document spans in ``kv_transfer_params``
  gets kvblend's blended KV of preamble + documents (canonical chunk KV,
  re-positioned, selected rows recomputed on the same weights); the claim ends
  where the question starts. Opt-in per request, and (with vLLM's prefix
  cache on) only under a cache salt that carries :data:`BLEND_SALT_MARK`, so
  approximate blocks never enter vLLM's prefix cache under exact token hashes.

``kv_transfer_params`` of a blended request::

    {"kvblend": {"mode": "blend", "ratio": 0.15, "selector": "probe",
                 "guard_margin": 0.7,                       # optional near-tie guard; default null (off)
                 "attention_precision": "bf16",             # optional: compute (default) | bf16 | auto
                 "linear_precision": "bf16",                # optional: compute (default) | bf16 | auto
                 "documents": [[s1, e1], [s2, e2], ...]}}   # token spans, contiguous,
                                                            # preamble before s1, question after the last e

``attention_precision`` / ``linear_precision`` are kvblend's opt-in bf16 arithmetic for the recomputed
rows above the blend's last check layer (:class:`~blend.policy.RecomputePrecision`), as in
``kvblend serve``'s ``kvblend`` request fields; a blend under either salts its blocks apart.

With ``guard_margin`` (opt-in here, unlike kvblend's own default: see
:data:`~blend.defaults.DEFAULT_VLLM_GUARD_MARGIN`) the near-tie guard runs as in
kvblend's engine: kvblend computes the question's rows too (vLLM computes them
again), and a blend whose first-token top-2 gap is under the margin is blended
again at the guard's ratio before its KV is written into vLLM's blocks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence

from blend.defaults import (
    DEFAULT_ATTENTION_PRECISION, DEFAULT_LINEAR_PRECISION, DEFAULT_RATIO, DEFAULT_SELECTOR, DEFAULT_VLLM_GUARD_MARGIN,
)
from blend.errors import InvalidRequestError
from blend.keys import Provenance, StoreKey, exact_chain, token_digest
from blend.numeric import finite_real, shown
from blend.policy import RECOMPUTE_PRECISION_FIELDS, RECOMPUTE_PRECISION_NAMES, SELECTOR_NAMES, RecomputePrecision

PARAMS_KEY = "kvblend"  # our entry in a request's kv_transfer_params
BLEND_ENTRY_KEYS = frozenset({"mode", "ratio", "selector", "guard_margin", "documents",  # what that entry may hold
                              *(name for name, _ in RECOMPUTE_PRECISION_FIELDS)})
BLEND_SALT_MARK = "kvblend-blend"  # a blended request's cache_salt carries this (see blend_salt)
VLLM_KV_LAYOUT = "k-after-rope"  # what a vLLM-provenance entry's K holds


class ClaimKind(Enum):
    """What a request's claimed tokens come from."""

    NONE = "none"
    EXACT = "exact"  # blocks vLLM computed before, from kvblend's store
    BLEND = "blend"  # kvblend's blended KV of preamble + documents


@dataclass(frozen=True)
class BlendParams:
    """A blended request's parameters (from ``kv_transfer_params``)."""

    ratio: float
    selector: str
    spans: tuple[tuple[int, int], ...]  # document token spans [start, end), contiguous
    guard_margin: float | None = DEFAULT_VLLM_GUARD_MARGIN  # near-tie guard (nats); None: off
    attention_precision: RecomputePrecision = RecomputePrecision(DEFAULT_ATTENTION_PRECISION)
    linear_precision: RecomputePrecision = RecomputePrecision(DEFAULT_LINEAR_PRECISION)

    @property
    def guard_tag(self) -> str:
        """The guard as a salt reads it ("off" or the margin, every digit: 0.7 and 0.70000001 differ)."""
        return "off" if self.guard_margin is None else repr(float(self.guard_margin))

    @property
    def precision_tag(self) -> str:
        """The recompute precisions as a salt reads them: "" at the defaults (so the salts of blends
        that name none are what they were before the fields), else ``:attn=...:lin=...``."""
        if (self.attention_precision is RecomputePrecision(DEFAULT_ATTENTION_PRECISION)
                and self.linear_precision is RecomputePrecision(DEFAULT_LINEAR_PRECISION)):
            return ""
        return f":attn={self.attention_precision.value}:lin={self.linear_precision.value}"

    @property
    def question_start(self) -> int:
        return self.spans[-1][1]


def vllm_provenance(engine_prov: Provenance, backend: str, block_size: int, kv_dtype: str) -> Provenance:
    """The provenance of KV that vLLM computed: kvblend's fields with vLLM's backend, block size and layout.

    Args:
        engine_prov: the kvblend engine's provenance for the same weights.
        backend: e.g. ``vllm-0.32.0/CPU_ATTN``.
        block_size: vLLM's block size (entries are one block each).
        kv_dtype: dtype of vLLM's KV cache.

    Returns:
        A provenance whose digest differs from the engine's (no key can alias).
    """
    return dataclasses.replace(engine_prov, backend=f"{backend}/block{block_size}/{VLLM_KV_LAYOUT}",
                               kv_dtype=kv_dtype)


def block_keys(prov: Provenance, token_ids: Sequence[int], block_size: int, salt: str = "") -> list[StoreKey]:
    """Prefix-chained keys of every whole block of ``token_ids`` (key i commits to blocks 0..i).

    Args:
        prov: the provenance of the KV (vLLM's: :func:`vllm_provenance`).
        token_ids: the prompt's token ids (a partial last block has no key).
        block_size: vLLM's block size, in tokens.
        salt: the request's cache salt ("" = none).

    Returns:
        One key per whole block, in order.
    """
    n = len(token_ids) // block_size
    return exact_chain(prov, [token_ids[i * block_size:(i + 1) * block_size] for i in range(n)], salt)


def exact_claim(present: Sequence[bool], num_prompt: int, num_computed: int, block_size: int) -> int:
    """Tokens an exact claim adds after vLLM's local prefix.

    Args:
        present: whether block i is in the store, for every whole prompt block, in order.
        num_prompt: prompt length.
        num_computed: tokens vLLM already holds (block-aligned).
        block_size: tokens per block.

    Returns:
        A block-aligned count >= 0 of tokens to load; the last prompt token is never claimed.
    """
    usable = min(len(present), (num_prompt - 1) // block_size)  # keep >= 1 token for vLLM to compute
    run = 0
    while run < usable and present[run]:
        run += 1
    return max(0, run * block_size - num_computed)


def blend_claim(params: BlendParams, num_computed: int, block_size: int) -> int:
    """Tokens a blend claim adds: every row before the question (its last block may be partial:
    vLLM writes the question's first rows into the rest of it).

    Args:
        params: the request's blend parameters.
        num_computed: prompt tokens vLLM already holds (its local prefix cache).
        block_size: vLLM's block size (unused: the claim may end inside a block).

    Returns:
        Rows from ``num_computed`` up to the question's first row (0 where vLLM holds them already).
    """
    return max(0, params.question_start - num_computed)


def _number(x: Any, lo: float, hi: float, message: str) -> float:
    """``x`` as a finite float in [lo, hi]; anything else (a bool, a string, NaN, infinity, an
    integer too large for a float) is an :class:`InvalidRequestError` with ``message``.

    :func:`blend.numeric.finite_real` first, so no OverflowError or TypeError escapes."""
    if not isinstance(x, (int, float)) or not finite_real(x) or not lo <= x <= hi:
        raise InvalidRequestError(f"{message}, got {shown(x)}")
    return float(x)


def parse_blend_params(kv_transfer_params: Any, num_prompt: int) -> BlendParams | None:
    """A request's blend parameters, or None when it asks for no blend.

    Args:
        kv_transfer_params: the request's ``kv_transfer_params`` (any JSON value; untrusted).
        num_prompt: prompt length.

    Returns:
        The parameters, or None (no ``kvblend`` entry, or ``mode: "exact"``: vLLM's blocks from the store only).

    Raises:
        InvalidRequestError: a ``kvblend`` entry that is malformed: another mode, a key it does not know (a
            misspelt option must not run at its default), a bad value.
    """
    if not isinstance(kv_transfer_params, dict) or PARAMS_KEY not in kv_transfer_params:
        return None
    p = kv_transfer_params[PARAMS_KEY]
    if not isinstance(p, dict):
        raise InvalidRequestError(f"kv_transfer_params[{PARAMS_KEY!r}] must be an object")
    unknown = sorted(set(p) - BLEND_ENTRY_KEYS, key=str)
    if unknown:
        raise InvalidRequestError(f"unknown key(s) in kv_transfer_params[{PARAMS_KEY!r}]: "
                                  f"{', '.join(map(repr, unknown))} (known: {', '.join(sorted(BLEND_ENTRY_KEYS))})")
    mode = p.get("mode", "blend")
    if mode == "exact":  # a precision is a blend option: refused here, not dropped (as kvblend serve does)
        for name, default in RECOMPUTE_PRECISION_FIELDS:
            if p.get(name) is not None and _precision(p[name], name) is not RecomputePrecision(default):
                raise InvalidRequestError(f"kvblend {name} is a blend option (mode 'exact' loads vLLM's own KV)")
        return None
    if mode != "blend":
        raise InvalidRequestError(f"kvblend mode must be 'blend' or 'exact', got {shown(mode)}")
    ratio = _number(p.get("ratio", DEFAULT_RATIO), 0.0, 1.0, "kvblend ratio must be a number in [0, 1]")
    selector = p.get("selector", DEFAULT_SELECTOR)
    if selector not in SELECTOR_NAMES:
        raise InvalidRequestError(f"unknown kvblend selector {selector!r}")
    guard = p.get("guard_margin", DEFAULT_VLLM_GUARD_MARGIN)
    if guard is not None:
        guard = _number(guard, 0.0, math.inf, "kvblend guard_margin must be a finite number >= 0 or null")
    docs = p.get("documents")
    if not isinstance(docs, list) or not docs:
        raise InvalidRequestError("kvblend blend needs 'documents': a non-empty list of [start, end] token spans")
    spans = []
    for d in docs:
        if not (isinstance(d, (list, tuple)) and len(d) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                    for x in d)):
            raise InvalidRequestError(f"a document span must be [start, end] integers, got {d!r}")
        spans.append((int(d[0]), int(d[1])))
    if spans[0][0] < 1:
        raise InvalidRequestError("the first document must start after a non-empty preamble")
    for (s, e), nxt in zip(spans, spans[1:] + [None]):
        if e <= s:
            raise InvalidRequestError(f"document span [{s}, {e}) is empty")
        if nxt is not None and nxt[0] != e:
            raise InvalidRequestError("document spans must be contiguous and in order")
    if spans[-1][1] >= num_prompt:
        raise InvalidRequestError("the question after the last document is empty")
    # a null precision is one not named, as in kvblend serve's intake
    precisions = {name: _precision(default if p.get(name) is None else p[name], name)
                  for name, default in RECOMPUTE_PRECISION_FIELDS}
    return BlendParams(ratio, str(selector), tuple(spans), guard, **precisions)


def _precision(value: Any, name: str) -> RecomputePrecision:
    """A request's recompute precision by name (compute, bf16 or auto).

    Raises:
        InvalidRequestError: anything else.
    """
    if not isinstance(value, str) or value not in RECOMPUTE_PRECISION_NAMES:
        raise InvalidRequestError(f"kvblend {name} must be one of {', '.join(RECOMPUTE_PRECISION_NAMES)}, "
                                  f"got {shown(value)}")
    return RecomputePrecision(value)


def blend_request(prompt_token_ids: Sequence[int], doc_spans: Sequence[tuple[int, int]], ratio: float = DEFAULT_RATIO,
                  selector: str = DEFAULT_SELECTOR, guard_margin: float | None = DEFAULT_VLLM_GUARD_MARGIN,
                  attention_precision: str | RecomputePrecision = DEFAULT_ATTENTION_PRECISION,
                  linear_precision: str | RecomputePrecision = DEFAULT_LINEAR_PRECISION) -> dict[str, Any]:
    """The ``kv_transfer_params`` that ask the connector to blend a prompt's documents.

    Args:
        prompt_token_ids: the prompt (preamble, documents, question), e.g. kvblend's ``Prompt.token_ids``.
        doc_spans: [start, end) token span of each document.
        ratio: recompute share.
        selector: kvblend selector.
        guard_margin: the near-tie guard's margin in nats (None, the default here: off), as in kvblend's
            own policy.
        attention_precision, linear_precision: the recomputed rows' attention and linear layers above the
            last check layer: "compute" (the engine's dtype, the default), "bf16" or "auto"
            (:class:`~blend.policy.RecomputePrecision`, or its name); named in the entry only where not
            the default.

    Returns:
        A dict to pass as ``kv_transfer_params`` (validated here).

    Raises:
        InvalidRequestError: a parameter the connector would refuse.
    """
    entry = {"mode": "blend", "ratio": ratio, "selector": selector, "guard_margin": guard_margin,
             "documents": [[int(s), int(e)] for s, e in doc_spans]}
    for (name, default), value in zip(RECOMPUTE_PRECISION_FIELDS, (attention_precision, linear_precision)):
        value = value.value if isinstance(value, RecomputePrecision) else value
        if value != default:
            entry[name] = value
    params = {PARAMS_KEY: entry}
    parse_blend_params(params, len(prompt_token_ids))
    return params


def prompt_spans(segment_lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Document spans of a kvblend prompt from its segment lengths (preamble, documents..., question).

    E.g. ``prompt_spans([len(s) for s in prompt.segments])`` for ``Engine.build_prompt``'s prompt.

    Args:
        segment_lengths: tokens per segment, in prompt order.

    Returns:
        Each document's ``[start, end)`` in the prompt's tokens, contiguous, in order.

    Raises:
        InvalidRequestError: fewer than three segments.
    """
    if len(segment_lengths) < 3:
        raise InvalidRequestError("a blended prompt needs a preamble, at least one document and a question")
    spans, pos = [], int(segment_lengths[0])
    for n in segment_lengths[1:-1]:
        spans.append((pos, pos + int(n)))
        pos += int(n)
    return spans


def blend_salt(params: dict[str, Any], prompt_token_ids: Sequence[int], tenant: str = "") -> str:
    """The ``cache_salt`` a blended request must carry when vLLM's prefix cache is on.

    vLLM hashes a request's blocks into its local prefix cache by their tokens; blended blocks are
    approximate and depend on the blend policy *and on the whole prompt* (the probe ranks rows by
    the question's attention), so they must live under a salt that commits to both: only the same
    prompt under the same policy may reuse them. ``tenant``: the caller's own salt, kept in front.

    Args:
        params: the request's ``kv_transfer_params`` (its ``kvblend`` entry is parsed).
        prompt_token_ids: the whole prompt's token ids.
        tenant: the caller's own cache salt ("" = none).

    Returns:
        ``<tenant>|<the blend's suffix>``: the policy, the document spans and a digest of the prompt.

    Raises:
        InvalidRequestError: ``params`` asks for no blend, or its ``kvblend`` entry is malformed.
    """
    p = parse_blend_params(params, len(prompt_token_ids))
    if p is None:
        raise InvalidRequestError("blend_salt needs the kv_transfer_params of a blend request")
    return f"{tenant}|{_blend_suffix(p, prompt_token_ids)}"  # as salt_allows_blend and tenant_salt read it


def _blend_suffix(params: BlendParams, prompt_token_ids: Sequence[int]) -> str:
    """What a blend's salt ends with: the policy and the whole prompt (see :func:`blend_salt`)."""
    digest = token_digest(prompt_token_ids).hex()[:24]
    # the document spans too: the same tokens cut into other documents blend differently
    spans = hashlib.sha256(json.dumps(params.spans).encode()).hexdigest()[:12]
    return (f"{BLEND_SALT_MARK}:{params.ratio!r}:{params.selector}:{params.guard_tag}{params.precision_tag}:"
            f"{spans}:{digest}")


def salt_allows_blend(salt: str | None, params: BlendParams, prompt_token_ids: Sequence[int]) -> bool:
    """Whether ``salt`` keeps this blend's blocks apart from every other prompt's (see :func:`blend_salt`).

    Args:
        salt: the request's ``cache_salt`` (None or "": no salt, which never allows a blend).
        params: the request's parsed blend parameters.
        prompt_token_ids: the whole prompt's token ids.

    Returns:
        Whether the salt ends with this blend's suffix.
    """
    return bool(salt) and salt.endswith(_blend_suffix(params, prompt_token_ids))


def tenant_salt(salt: str | None, params: BlendParams | None, prompt_token_ids: Sequence[int]) -> str:
    """The salt kvblend's own keys (the preamble, canonical chunks) take for a vLLM request.

    Tenants with different salts share no KV, blended or exact. A blend's salt (:func:`blend_salt`) is
    ``tenant|suffix``, the suffix committing to the whole prompt for vLLM's prefix cache: kvblend's chunk
    keys take the tenant alone (with the suffix, no other question would ever reuse a chunk). Any other
    salt is the tenant's as it is.

    Args:
        salt: the request's ``cache_salt`` (None: none).
        params: its blend parameters (None: not a blend).
        prompt_token_ids: its prompt.

    Returns:
        The tenant salt ("" = none).
    """
    if not salt:
        return ""
    suffix = "|" + _blend_suffix(params, prompt_token_ids) if params is not None else ""
    return salt[: -len(suffix)] if suffix and salt.endswith(suffix) else salt
