"""Rotary position embeddings, driven by the model's own rotary module.

The cos/sin tables come from the transformers rotary embedding of the loaded
model, so every RoPE variant its config describes (default, linear,
dynamic-NTK, YaRN, llama3, partial rotary) is reproduced exactly, including
the attention scaling some variants fold into the tables.

K is stored BEFORE RoPE; :func:`apply_rope` rotates it at whatever absolute
positions a prompt places it.
"""

from __future__ import annotations

import json

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
        self.dynamic = "dynamic" in str(getattr(rotary_emb, "rope_type", ""))
        # dynamic NTK rescales past this many positions, so past it a KV depends on the length
        # of the forward that computed it (prefix reuse is not exact there)
        self.length_dependent_after: int | None = (
            int(getattr(rotary_emb, "original_max_seq_len", 0)) or None if self.dynamic else None
        )
        self._cos = torch.empty(0, 0)
        self._sin = torch.empty(0, 0)

    def _build(self, n: int) -> None:
        if self.dynamic:
            # transformers' dynamic module keeps the largest scaling it has seen (stateful);
            # reset it so the tables are a function of n alone
            emb = self.rotary_emb
            if hasattr(emb, "original_inv_freq"):
                emb.register_buffer("inv_freq", emb.original_inv_freq.to(self.device), persistent=False)
                emb.max_seq_len_cached = emb.original_max_seq_len
        pos = torch.arange(n, device=self.device)[None]  # (1, n)
        dummy = torch.zeros(1, device=self.device, dtype=torch.float32)
        cos, sin = self.rotary_emb(dummy, pos)  # (1, n, R) fp32
        self._cos, self._sin = cos[0].contiguous(), sin[0].contiguous()  # (n, R)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables at the given positions.

        Args:
            positions: (T,) int64 absolute positions.

        Returns:
            cos, sin: (T, R) float32.
        """
        need = int(positions.max().item()) + 1 if positions.numel() else 1
        if self.dynamic:
            # dynamic-NTK tables depend on the longest position; rebuild exactly for it
            if self._cos.shape[0] != need:
                self._build(need)
        elif self._cos.shape[0] < need:
            self._build(max(need, 2 * self._cos.shape[0], 256))
        return self._cos[positions], self._sin[positions]  # (T, R), (T, R)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` at the positions the tables were taken at.

    Args:
        x: (H, T, D) queries or keys before RoPE.
        cos, sin: (T, R) fp32 tables, R <= D (partial rotary rotates the first R dims).

    Returns:
        (H, T, D) in x's dtype, computed as transformers does (tables cast to x's dtype).
    """
    cos = cos.to(x.dtype)  # (T, R)
    sin = sin.to(x.dtype)  # (T, R)
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, keep = x[..., :r], x[..., r:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, keep), dim=-1)


def apply_rope_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """:func:`apply_rope` written into ``out`` (e.g. a KV cache's rows), bit for bit the same numbers.

    Args:
        out: (..., T, D) destination in x's dtype, not overlapping x.
        x: (..., T, D) keys before RoPE (any leading dims: heads, or layers and heads).
        cos, sin: (T, R) fp32 tables.
    """
    cos = cos.to(x.dtype)  # (T, R)
    sin = sin.to(x.dtype)  # (T, R)
    if cos.shape[-1] != x.shape[-1]:  # partial rotary: the general form
        out.copy_(apply_rope(x, cos, sin))
        return
    half = x.shape[-1] // 2
    torch.mul(x, cos, out=out)  # (..., T, D) the same two products and one sum per element as apply_rope
    # rotate_half(x) * sin without building rotate_half: (-x2) * s1 added is exactly x2 * s1 subtracted
    out[..., :half].sub_(x[..., half:] * sin[:, :half])  # x1*c1 - x2*s1
    out[..., half:].add_(x[..., :half] * sin[:, half:])  # x2*c2 + x1*s2


def rope_config_json(config) -> str:
    """Canonical JSON of everything in a model config that shapes its RoPE."""
    fields = {}
    for name in ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
                 "max_position_embeddings", "head_dim"):
        value = getattr(config, name, None)
        if value is not None:
            fields[name] = value
    return json.dumps(fields, sort_keys=True, default=str)
