"""Kernels of the blend path: RoPE+mix, KV deviation, sparse-query attention.

Every public function dispatches (see ``dispatch``) to a Triton kernel for CUDA
tensors or to its torch reference otherwise. Importing this package never
imports Triton.
"""

if __name__ == "kernels":
    # This folder is ``blend.kernels`` (a package-dir mapping). Python imports it under the bare
    # name ``kernels`` only when the repository root is on sys.path (``python -m`` or pytest run
    # from the root), where it would shadow the PyPI package of that name, which transformers
    # (>= 5.25) imports. Hand the name over to that package; where it is not installed, to an empty
    # module without a file or version, which transformers' availability probe reads as "absent".
    import importlib as _importlib
    import os as _os
    import sys as _sys
    import types as _types

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _saved = list(_sys.path)
    del _sys.modules[__name__]
    _sys.path[:] = [p for p in _saved if _os.path.abspath(p or _os.curdir) != _root]
    try:
        _real = _importlib.import_module(__name__)
    except ModuleNotFoundError as e:
        if e.name != __name__:  # the installed package is there but broken: say so, do not hide it
            raise
        _real = _types.ModuleType(__name__, "placeholder: no package named 'kernels' is installed")
    finally:
        _sys.path[:] = _saved
    _sys.modules[__name__] = _real  # what ``import kernels`` binds
else:
    from .dispatch import (
        ENV_VAR,
        BackendPolicy,
        KernelBackend,
        kernel_backend,
        kv_deviation,
        rope_mix,
        rope_rows,
        sparse_query_attention,
    )
    from .onednn_attention import attention_label
    from .probabilities import HiddenKeys, attention_probs, hidden_keys, query_attention_mass
    from .query_blocks import BlockPlan, plan_query_blocks, sparse_query_attention_blocked
    from .reference import kv_deviation_ref, rope_mix_ref, sparse_query_attention_ref
    from .tolerances import TOL, Tol

    __all__ = [
        "BlockPlan",
        "ENV_VAR",
        "HiddenKeys",
        "TOL",
        "attention_label",
        "attention_probs",
        "BackendPolicy",
        "KernelBackend",
        "Tol",
        "hidden_keys",
        "kernel_backend",
        "kv_deviation",
        "kv_deviation_ref",
        "plan_query_blocks",
        "query_attention_mass",
        "rope_mix",
        "rope_mix_ref",
        "rope_rows",
        "sparse_query_attention",
        "sparse_query_attention_blocked",
        "sparse_query_attention_ref",
    ]
