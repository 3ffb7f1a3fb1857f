"""Rotary position embeddings, driven by the model's own rotary module.

The cos/sin tables come from the transformers rotary embedding of the loaded
model, so every RoPE variant its config describes (default, linear,
dynamic-NTK, YaRN, llama3, partial rotary) is reproduced exactly, including
the attention scaling some variants fold into the tables.

A canonical chunk's K is stored BEFORE RoPE; :func:`apply_rope` rotates it at
whatever absolute positions a prompt places it (an exact-prefix entry's K, which
never moves, is stored after it).
"""

from __future__ import annotations

import contextlib
import json
import threading
from typing import Iterator

import torch


class RopeTables:
    """fp32 cos/sin tables indexed by absolute position, grown on demand.

    Args:
        rotary_emb: the model's rotary module (``model.model.rotary_emb``).
        device: where tables live.
    """

    def __init__(self, rotary_emb: torch.nn.Module, device: torch.device) -> None:
        self.rotary_emb = rotary_emb
        self.device = device
        rope_type = self.rope_type = str(getattr(rotary_emb, "rope_type", "")) or "default"
        # tables that depend on the longest position of the call: dynamic NTK rescales by it, LongRoPE
        # switches from its short to its long factors by it (both in transformers' rotary forward)
        self.dynamic = "dynamic" in rope_type or rope_type == "longrope"
        # past this many positions a KV depends on the length of the forward that computed it
        # (prefix reuse is not exact there)
        self.length_dependent_after: int | None = (
            _length_dependent_after(rotary_emb, rope_type) if self.dynamic else None
        )
        self._cos = torch.empty(0, 0)
        self._sin = torch.empty(0, 0)
        self._lock = threading.Lock()

    def _build(self, n: int) -> None:
        # outside inference mode: the module is the transformers model's own, and what its forward stores
        # on it here (LongRoPE's inv_freq and long factors) must stay normal tensors, or the model's next
        # forward outside inference mode fails on LongRoPE's in-place update of inv_freq
        with torch.inference_mode(False), torch.no_grad():
            if self.dynamic:
                # transformers' dynamic module keeps the largest scaling it has seen (stateful);
                # reset it so the tables are a function of n alone
                emb = self.rotary_emb
                if hasattr(emb, "original_inv_freq"):
                    # a copy: LongRoPE writes its long factors into inv_freq in place, which would overwrite
                    # the short ones kept in original_inv_freq if the two were one tensor (.to() on its device)
                    emb.register_buffer("inv_freq", emb.original_inv_freq.to(self.device).clone(), persistent=False)
                    emb.max_seq_len_cached = emb.original_max_seq_len
            pos = torch.arange(n, device=self.device)[None]  # (1, n)
            dummy = torch.zeros(1, device=self.device, dtype=torch.float32)
            cos, sin = self.rotary_emb(dummy, pos)  # (1, n, R) fp32
        self._cos, self._sin = cos[0].contiguous(), sin[0].contiguous()  # (n, R)

    @contextlib.contextmanager
    def module_in_use(self) -> Iterator[None]:
        """Hold the tables' lock while something else calls the rotary module: a transformers forward of
        the same model (the quality gate's reference) changes a dynamic-NTK or LongRoPE module's state,
        which a table build on another thread would read half-changed."""
        with self._lock:
            yield

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables at the given positions.

        Args:
            positions: (T,) int64 absolute positions.

        Returns:
            cos, sin: (T, R) float32.
        """
        need = int(positions.max().item()) + 1 if positions.numel() else 1
        # threads share the tables (a quality-gate prefill beside a decode step): build and read as one
        with self._lock:
            if self.dynamic:
                # dynamic-NTK tables depend on the longest position; rebuild exactly for it
                if self._cos.shape[0] != need:
                    self._build(need)
            elif self._cos.shape[0] < need:
                self._build(max(need, 2 * self._cos.shape[0], 256))
            return self._cos[positions], self._sin[positions]  # (T, R), (T, R)


def _length_dependent_after(rotary_emb: torch.nn.Module, rope_type: str) -> int | None:
    """Positions past which a length-dependent rotary module's tables change.

    Args:
        rotary_emb: the model's rotary module.
        rope_type: its ``rope_type``.

    Returns:
        LongRoPE: its ``original_max_position_embeddings`` (transformers switches factors past it);
        dynamic NTK: the module's ``original_max_seq_len``; None when unknown.
    """
    if rope_type == "longrope":
        cfg = rotary_emb.config
        params = getattr(cfg, "rope_parameters", None) or {}
        n = (params.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", 0)
             or cfg.max_position_embeddings)
    else:
        n = getattr(rotary_emb, "original_max_seq_len", 0)
    return int(n) or None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim.

    Args:
        x: any tensor whose last dimension is even, (..., R).

    Returns:
        The rotated halves, (..., R).
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``out[..., :R] = x*cos + rotate_half(x)*sin`` over the first R dims, the rest of x copied through.

    Built without ``rotate_half``'s negated copy and concatenation: ``(-x2) * s1`` added is exactly
    ``x2 * s1`` subtracted, so each element gets the same two rounded products and one rounded sum as
    the textbook form, bit for bit, for a third of its temporaries (a 3k-token prefill's queries:
    7.2 -> 1.8 ms per layer, fp32, two threads).

    Args:
        out: (..., T, D) destination in x's dtype, not overlapping x.
        x: (..., T, D) before RoPE.
        cos, sin: (T, R) tables already in x's dtype, R <= D even.
    """
    r = cos.shape[-1]
    half = r // 2
    xr, o = x[..., :r], out[..., :r]
    torch.mul(xr, cos, out=o)  # (..., T, R)
    o[..., :half].sub_(xr[..., half:] * sin[:, :half])  # x1*c1 - x2*s1
    o[..., half:].add_(xr[..., :half] * sin[:, half:])  # x2*c2 + x1*s2
    if r < x.shape[-1]:  # partial rotary: the rest passes through
        out[..., r:] = x[..., r:]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` at the positions the tables were taken at.

    Args:
        x: (H, T, D) queries or keys before RoPE.
        cos, sin: (T, R) fp32 tables, R <= D (partial rotary rotates the first R dims).

    Returns:
        (H, T, D) contiguous, in x's dtype, the numbers transformers computes (tables cast to x's dtype,
        ``x*cos + rotate_half(x)*sin``), bit for bit.
    """
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # (H, T, D)
    _rotate_into(out, x, cos.to(x.dtype), sin.to(x.dtype))
    return out


def apply_rope_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """:func:`apply_rope` written into ``out`` (e.g. a KV cache's rows), bit for bit the same numbers.

    Args:
        out: (..., T, D) destination in x's dtype, not overlapping x.
        x: (..., T, D) keys before RoPE (any leading dims: heads, or layers and heads).
        cos, sin: (T, R) fp32 tables.
    """
    _rotate_into(out, x, cos.to(x.dtype), sin.to(x.dtype))


def partial_rotary_factor(config) -> float | None:
    """The config's ``partial_rotary_factor`` (transformers moves a top-level one into ``rope_parameters``).

    Args:
        config: a transformers model config.

    Returns:
        The factor, or None where the config sets none.
    """
    params = getattr(config, "rope_parameters", None)
    value = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    return value if value is not None else getattr(config, "partial_rotary_factor", None)


def rope_config_json(config) -> str:
    """Canonical JSON of everything in a model config that shapes its RoPE.

    Args:
        config: a transformers config.

    Returns:
        Sorted JSON of the RoPE fields the config sets (unset ones left out; a value JSON cannot hold
        is written as its ``str``).
    """
    fields = {}
    for name in ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
                 "max_position_embeddings", "head_dim"):
        value = getattr(config, name, None)
        if value is not None:
            fields[name] = value
    return json.dumps(fields, sort_keys=True, default=str)
