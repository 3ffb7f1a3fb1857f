"""What an engine is built from: its settings, its dtype names, the provenance of the KV it makes, and
the tokens that end its answers."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
import transformers

from blend.cpu_features import cpu_kernel_class
from blend.defaults import DEFAULT_DEVICE, DEFAULT_DTYPE, DEFAULT_GEMM, DEFAULT_MODEL
from blend.errors import InvalidRequestError
from blend.gemm import GemmBackend
from blend.keys import Provenance
from blend.kernels import attention_label
from blend.models import LoadedModel
from blend.rope import rope_config_json

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide settings (per-request state goes in the policy and arguments)."""

    model: str = DEFAULT_MODEL
    dtype: str = DEFAULT_DTYPE
    kv_dtype: str | None = None  # storage dtype of KV; None = dtype
    device: str = DEFAULT_DEVICE
    gemm: str = DEFAULT_GEMM  # linear layers' backend: auto | torch | onednn (blend/gemm.py)
    experimental_semantic: bool = False
    quality_gate: bool = True  # run/consult `kvblend check` before the first blend
    overlap_loading: bool = True  # fetch chunk KV in background threads while computing


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name.

    Args:
        name: a key of :data:`DTYPES` ("float32", "bfloat16", "float16").

    Returns:
        Its torch dtype.

    Raises:
        InvalidRequestError: an unknown name.
    """
    if name not in DTYPES:
        raise InvalidRequestError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def fp32_precision_label() -> str:
    """torch's process-wide float32 matmul precision ("highest" by default; "high"/"medium" let float32
    GEMMs and attention run in TF32 or bf16): it changes the numbers of every KV row, so it is part of
    the provenance, and a request refuses to run once it has changed since the engine was built.

    Returns:
        e.g. ``fp32mm-highest-ieee``.
    """
    mkldnn = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    onednn = getattr(mkldnn, "fp32_precision", "na")
    onednn = "ieee" if onednn in ("none", "ieee") else onednn  # both full float32 ("highest" sets "ieee")
    return f"fp32mm-{torch.get_float32_matmul_precision()}-{onednn}"


def model_arch(config) -> str:
    """A model config's architecture tag: its ``model_type`` and a digest of every field (the RoPE's, the
    norms' epsilons, ...) but the folder it was read from.

    Args:
        config: a transformers ``PretrainedConfig`` (kvblend's model's, or the one vLLM runs).

    Returns:
        e.g. ``llama:b97a67a8bda082a8`` (:attr:`~blend.keys.Provenance.model_arch`).
    """
    fields = config.to_dict()
    fields.pop("_name_or_path", None)  # where the checkpoint was read from: the same weights at another path
    arch = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{config.model_type}:{arch}"


def build_provenance(loaded: LoadedModel, cfg: EngineConfig, device: torch.device, gemm: GemmBackend,
                     fp32_label: str) -> Provenance:
    """Every field that changes the KV this engine produces (the linear layers' backend included).

    Args:
        loaded: the model, its weights' and tokenizer's digests.
        cfg: the engine's settings (dtype and KV dtype).
        device: where it runs (its kernel class is recorded).
        gemm: the linear layers' backend.
        fp32_label: :func:`fp32_precision_label` as the engine read it (the one reading its requests
            compare with).

    Returns:
        The engine's provenance.
    """
    config = loaded.model.config
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        device_class = f"cuda:sm{major}{minor}"
    elif device.type == "cpu":
        device_class = cpu_kernel_class()  # the ISA the kernels dispatch on
    else:
        device_class = device.type
    return Provenance(
        model_arch=model_arch(config),
        weights_sha256=loaded.weights_sha256,
        tokenizer_sha256=loaded.tokenizer_sha256,
        dtype=cfg.dtype,
        kv_dtype=cfg.kv_dtype or cfg.dtype,
        device_class=device_class,
        # transformers' version too: its rotary module makes the RoPE tables (blend.rope), so a release that
        # changes their arithmetic (YaRN, llama3 scaling) must not be served the KV the old tables made
        backend=(f"kvblend-layers/torch-{torch.__version__}/transformers-{transformers.__version__}/sdpa/"
                 f"{gemm.value}/{attention_label()}/{fp32_label}"),
        rope=rope_config_json(config),
    )


def eos_ids(model, tokenizer) -> set[int]:
    """The tokens that end an answer: the model config's, its ``generation_config.json``'s (instruct
    checkpoints list their end-of-turn token there, e.g. Qwen2.5's ``<|im_end|>`` and ``<|endoftext|>``)
    and the tokenizer's.

    Args:
        model: the transformers model.
        tokenizer: its tokenizer.

    Returns:
        The token ids.
    """
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(source, "eos_token_id", None)
        for e in eos if isinstance(eos, (list, tuple)) else [eos]:
            if e is not None:
                ids.add(int(e))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
