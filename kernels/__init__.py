"""Kernels of the blend path: RoPE+mix, KV deviation, sparse-query attention.

Every public function dispatches (see ``dispatch``) to a Triton kernel for CUDA
tensors or to its torch reference otherwise. Importing this package never
imports Triton.
"""

from .dispatch import (
    ENV_VAR,
    BackendPolicy,
    KernelBackend,
    kernel_backend,
    kv_deviation,
    rope_mix,
    sparse_query_attention,
)
from .reference import (
    attention_probs,
    kv_deviation_ref,
    query_attention_mass,
    rope_mix_ref,
    sparse_query_attention_blocked,
    sparse_query_attention_ref,
)
from .tolerances import TOL, Tol

__all__ = [
    "ENV_VAR",
    "TOL",
    "attention_probs",
    "BackendPolicy",
    "KernelBackend",
    "Tol",
    "kernel_backend",
    "kv_deviation",
    "kv_deviation_ref",
    "query_attention_mass",
    "rope_mix",
    "rope_mix_ref",
    "sparse_query_attention",
    "sparse_query_attention_blocked",
    "sparse_query_attention_ref",
]
