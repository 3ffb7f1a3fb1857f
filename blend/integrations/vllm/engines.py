"""The kvblend side of the connector: one engine and one store per process, shared by its two roles.

vLLM builds a connector for the scheduler and one for each worker; in one
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or the scheduler beside a single
CPU worker) they share one :class:`SharedEngine` here, so the weights are read
once and an in-memory store is seen by both. Across processes the store must
be one they share (``disk:PATH`` or ``redis://...``).

No vLLM import: the config is read from plain values.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence

import torch

from blend.errors import InvalidRequestError, KVBlendError
from blend.integrations.vllm.plan import BlendParams, vllm_provenance
from blend.keys import Provenance
from blend.kvcache import KVCache
from blend.policy import ReusePolicy
from blend.prompt import Prompt, Segment, SegmentKind
from blend.store.codec import dtype_name
from blend.store.spec import DEFAULT_MEMORY_BUDGET


class OnLoadError(Enum):
    """``kv_connector_extra_config["on_load_error"]``: what vLLM does with a block that fails to load."""

    RECOMPUTE = "recompute"  # the connector sets vLLM's kv_load_failure_policy to recompute
    FAIL = "fail"  # vLLM's policy must be "fail" (its default): the request fails with an error


@dataclass(frozen=True)
class ExtraConfig:
    """The connector's ``kv_connector_extra_config``, checked (:func:`parse_extra_config`)."""

    store: str = "memory"
    force: bool = False
    on_load_error: OnLoadError = OnLoadError.RECOMPUTE
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET


def parse_extra_config(extra: dict) -> ExtraConfig:
    """Check the connector's extra config strictly: a misspelt key or a string where a boolean belongs
    (``"force": "false"`` read as true, ``"on_load_error": "recompte"`` as "fail") must stop vLLM's start-up,
    not change what the connector does.

    Args:
        extra: ``kv_connector_extra_config`` as vLLM passes it (JSON values).

    Returns:
        The values, defaults filled in.

    Raises:
        InvalidRequestError: an unknown key or a value of the wrong type or range (the message names it).
    """
    if not isinstance(extra, dict):
        raise InvalidRequestError(f"kv_connector_extra_config must be an object, got {type(extra).__name__}")
    fields = ExtraConfig.__dataclass_fields__
    unknown = sorted(set(map(str, extra)) - set(fields))
    if unknown:
        raise InvalidRequestError(f"kv_connector_extra_config: unknown key(s) {', '.join(map(repr, unknown))} "
                                  f"(known: {', '.join(fields)})")
    out = ExtraConfig()
    store = extra.get("store", out.store)
    if not isinstance(store, str) or not store:
        raise InvalidRequestError(f"kv_connector_extra_config: store must be a store spec string, got {store!r}")
    force = extra.get("force", out.force)
    if not isinstance(force, bool):
        raise InvalidRequestError(f"kv_connector_extra_config: force must be true or false, got {force!r}")
    try:
        on_load_error = OnLoadError(extra.get("on_load_error", out.on_load_error.value))
    except ValueError:
        raise InvalidRequestError(f"kv_connector_extra_config: on_load_error must be one of "
                                  f"{', '.join(e.value for e in OnLoadError)}, got "
                                  f"{extra.get('on_load_error')!r}") from None
    budget = extra.get("memory_budget_bytes", out.memory_budget_bytes)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise InvalidRequestError(f"kv_connector_extra_config: memory_budget_bytes must be an integer >= 0, "
                                  f"got {budget!r}")
    return ExtraConfig(store=store, force=force, on_load_error=on_load_error, memory_budget_bytes=budget)


@dataclass(frozen=True)
class ConnectorConfig:
    """What the connector needs to know (from vLLM's config and ``kv_connector_extra_config``).

    Attributes:
        model: the checkpoint directory vLLM serves (kvblend loads the same weights).
        dtype: vLLM's model dtype name.
        backend: vLLM's version, device type and the digest of its settings that change KV
            (:func:`vllm_numerics`), for the provenance of the KV it computes.
        store: kvblend store spec (``memory``, ``disk:PATH``, ``redis://...``, or a chain).
        force: blend even if kvblend's quality gate has not passed for this model.
        recompute_on_load_error: set vLLM's ``kv_load_failure_policy`` to ``recompute`` (a block that
            fails to load is recomputed, the request goes on); False needs vLLM's policy to be ``fail``
            (:func:`load_failure_policy`).
        model_arch: :func:`~blend.engine_setup.model_arch` of the model config vLLM runs (``hf_overrides``
            applied), "" where unknown; kvblend's engine reads config.json from disk, and its blended KV is
            injected only where the two agree.
    """

    model: str
    dtype: str
    backend: str
    store: str = "memory"
    force: bool = False
    recompute_on_load_error: bool = True
    prefix_caching: bool = True  # vLLM's own prefix cache is on (blends then need their salt)
    device: str = "cpu"  # where kvblend's engine runs: vLLM's device
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET  # the in-process tier of the store
    model_arch: str = ""  # the model config vLLM runs (see above)

    @classmethod
    def from_vllm(cls, vllm_config: Any, extra: dict) -> "ConnectorConfig":
        """Read vLLM's config object and the connector's extra config.

        Args:
            vllm_config: vLLM's ``VllmConfig``.
            extra: ``kv_connector_extra_config`` (checked by :func:`parse_extra_config`).

        Returns:
            The config.

        Raises:
            InvalidRequestError: a KV cache dtype or quantization kvblend cannot serve, or a bad extra config.
        """
        import vllm

        from blend.engine_setup import model_arch

        ex = parse_extra_config(extra)
        mc = vllm_config.model_config
        dtype = dtype_name(mc.dtype)
        cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
        if cache_dtype not in ("auto", dtype):
            raise InvalidRequestError(f"kvblend's connector needs the KV cache in the model dtype, got {cache_dtype}")
        quant = getattr(mc, "quantization", None)
        if quant:  # kvblend's engine blends with the checkpoint's own weights, and its keys name no quantization
            raise InvalidRequestError(f"kvblend's connector needs an unquantized model, got quantization={quant!r}")
        backend = f"vllm-{vllm.__version__}/{vllm_config.device_config.device_type}/{vllm_numerics(vllm_config)}"
        hf = getattr(mc, "hf_config", None)
        return cls(model=str(mc.model), dtype=dtype, backend=backend, store=ex.store, force=ex.force,
                   recompute_on_load_error=ex.on_load_error is OnLoadError.RECOMPUTE,
                   prefix_caching=bool(getattr(vllm_config.cache_config, "enable_prefix_caching", True)),
                   device=str(vllm_config.device_config.device_type),
                   memory_budget_bytes=ex.memory_budget_bytes, model_arch=model_arch(hf) if hf is not None else "")


def load_failure_policy(cfg: ConnectorConfig, configured: str) -> str:
    """The ``kv_load_failure_policy`` vLLM's scheduler must run under the connector's ``on_load_error`` (the
    scheduler reads it from the config once it has built its connector, so the connector may set it).

    Args:
        cfg: the connector's config.
        configured: vLLM's ``kv_transfer_config.kv_load_failure_policy`` as given (``fail`` by default).

    Returns:
        ``recompute`` or ``fail``.

    Raises:
        InvalidRequestError: ``"on_load_error": "fail"`` beside vLLM's ``recompute``, which is never vLLM's
            default, so both were asked for: vLLM would recompute the blocks kvblend was told to fail on.
    """
    if cfg.recompute_on_load_error:
        return "recompute"
    if configured != OnLoadError.FAIL.value:
        raise InvalidRequestError(
            f'kv_connector_extra_config "on_load_error": "fail" contradicts kv_transfer_config '
            f'"kv_load_failure_policy": {configured!r} (vLLM would recompute a block that fails to load, not fail '
            f'the request): set one of them to the other\'s value')
    return OnLoadError.FAIL.value


def _model_hash(mc: Any) -> str:
    """vLLM's model-config hash without the checkpoint's folder in it (``model``: its path). The KV's
    provenance already names the weights by content, so replicas that load one checkpoint from different
    folders share their blocks (vLLM's own hash differed between them, and so did every key)."""
    clone = copy.copy(mc)
    try:
        object.__setattr__(clone, "model", "")  # past a validating dataclass's __setattr__: a plain field
    except (AttributeError, TypeError):
        return str(mc.compute_hash())
    return str(clone.compute_hash())


def _hf_json(hf: Any) -> str:
    """The model config vLLM runs (``hf_overrides`` applied) as JSON, without the folder it came from."""
    to_dict = getattr(hf, "to_dict", None)
    if to_dict is None:
        return str(hf.to_json_string(use_diff=False))
    return json.dumps({k: v for k, v in to_dict().items() if k != "_name_or_path"}, sort_keys=True, default=str)


def vllm_numerics(vllm_config: Any) -> str:
    """A digest of vLLM's settings that change the KV it computes, for the blocks' keys: its model config's
    own hash, the model config it runs with (``hf_overrides`` applied: kvblend's engine reads config.json
    from disk and would not see them), and the load, attention, compilation and kernel configs' hashes
    (the attention backend, custom ops, dummy weights).

    Args:
        vllm_config: vLLM's ``VllmConfig``.

    Returns:
        16 hex digits.
    """
    mc = vllm_config.model_config
    hf = getattr(mc, "hf_config", None)
    parts = [_model_hash(mc), _hf_json(hf) if hf is not None else "None"]
    for name in ("load_config", "attention_config", "compilation_config", "kernel_config"):
        cfg = getattr(vllm_config, name, None)
        parts.append(cfg.compute_hash() if hasattr(cfg, "compute_hash") else "None")
    # the float32 matmul precision vLLM's GPU workers set (TF32 at "high"): an environment variable, so the
    # scheduler's process and the workers' derive the same keys
    parts.append(os.environ.get("VLLM_FLOAT32_MATMUL_PRECISION", "default"))
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:16]


class SharedEngine:
    """A kvblend engine over vLLM's weights, its store, and the provenance of vLLM's own KV.

    Args:
        cfg: the connector's config.
        block_size: vLLM's block size (in the provenance of the KV vLLM computes).
    """

    def __init__(self, cfg: ConnectorConfig, block_size: int) -> None:
        from blend.engine import Engine
        from blend.store.spec import open_store

        self.cfg = cfg
        # write-through: a block saved after vLLM's forward is in every tier (Redis included) when
        # the request ends, with no request-end hook to wait on background writes
        self.store = open_store(cfg.store, memory_budget_bytes=cfg.memory_budget_bytes, write_behind=False)
        self.engine = Engine.load(cfg.model, dtype=cfg.dtype, store=self.store, quality_gate=not cfg.force,
                                  device=cfg.device)
        self.vllm_prov: Provenance = vllm_provenance(self.engine.provenance, cfg.backend, block_size, cfg.dtype)
        self.vllm_prov_json = self.vllm_prov.canonical_json()
        # kvblend's engine runs config.json as it is on disk; vLLM may run it changed (hf_overrides: RoPE theta,
        # norms...). Exact blocks are vLLM's own KV (their keys carry vLLM's config); a blend is kvblend's KV
        ours = self.engine.provenance.model_arch
        self.blend_refusal = "" if cfg.model_arch in ("", ours) else (
            f"blend refused: vLLM runs another model config ({cfg.model_arch}) than the checkpoint's config.json "
            f"that kvblend's engine runs ({ours}), e.g. hf_overrides; the request runs plain")
        self._lock = threading.Lock()  # one blend at a time per process (the engine's caches)

    def prompt_of(self, token_ids: Sequence[int], params: BlendParams) -> Prompt:
        """kvblend's segmented prompt of a vLLM request: preamble, the named documents, the question."""
        spans = params.spans
        segs = [Segment(SegmentKind.PREAMBLE, tuple(token_ids[: spans[0][0]]), "")]
        segs += [Segment(SegmentKind.DOCUMENT, tuple(token_ids[s:e]), "") for s, e in spans]
        segs.append(Segment(SegmentKind.QUESTION, tuple(token_ids[spans[-1][1]:]), ""))
        return Prompt(tuple(segs))

    def blend(self, token_ids: Sequence[int], params: BlendParams, salt: str = "") -> tuple[KVCache, dict]:
        """kvblend's blended prefill of the request's context; its cache holds at least every row
        before the question (K after RoPE).

        Args:
            token_ids: the prompt.
            params: its blend parameters.
            salt: the request's tenant salt (:func:`~blend.integrations.vllm.plan.tenant_salt`), mixed
                into every key the blend derives.

        Returns:
            The filled cache and the reuse report (as a JSON-able dict).

        Raises:
            KVBlendError: vLLM runs another model config than kvblend's engine (:attr:`blend_refusal`).
        """
        if self.blend_refusal:  # the scheduler refuses such blends first; never KV of another model config
            raise KVBlendError(self.blend_refusal)
        policy = ReusePolicy.blend(ratio=params.ratio, selector=params.selector, force=self.cfg.force,
                                   guard_margin=params.guard_margin, cache_salt=salt,
                                   attention_precision=params.attention_precision,
                                   linear_precision=params.linear_precision)
        with self._lock, torch.inference_mode():
            # vLLM computes the question itself; without the guard kvblend stops the question's rows
            # after the check layer, with it kvblend computes them too, to see the first token's gap
            _, cache, report = self.engine.prefill(self.prompt_of(token_ids, params), policy,
                                                   question=policy.guarded)
        rep = report.to_dict()
        slim = {k: rep[k] for k in ("policy", "applied", "selector", "ratio", "spent", "gate", "guard",
                                    "first_token_margin") if rep.get(k) not in (None, "")}
        slim.update(reused_tokens=report.reused_tokens, recomputed_tokens=report.recomputed_tokens,
                    classes=[s.reuse_class.value for s in report.segments],
                    blend_s=round(report.timings.ttft_s, 6))
        return cache, json.loads(json.dumps(slim))


_ENGINES: dict[tuple[ConnectorConfig, int], SharedEngine] = {}
_ENGINES_LOCK = threading.Lock()


def shared_engine(cfg: ConnectorConfig, block_size: int) -> SharedEngine:
    """This process's engine for ``cfg`` (made on first use).

    Args:
        cfg: the connector's config.
        block_size: vLLM's block size (engines of two block sizes are two engines).

    Returns:
        The one :class:`SharedEngine` of this process for that pair.
    """
    with _ENGINES_LOCK:
        key = (cfg, block_size)
        if key not in _ENGINES:
            _ENGINES[key] = SharedEngine(cfg, block_size)
        return _ENGINES[key]


def loaded_engines() -> list[SharedEngine]:
    """The engines made in this process so far (tests and tools reach the connector's engine here).

    Returns:
        A copy of the list, in the order they were made.
    """
    with _ENGINES_LOCK:
        return list(_ENGINES.values())
