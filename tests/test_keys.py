"""Invariant 4: changing any single provenance field, the preamble or one token changes the key."""

import dataclasses

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from blend.keys import Provenance, canonical_key, exact_chain, key_hex
from blend.policy import ReusePolicy
from blend.report import ReuseClass
from conftest import make_docs, unguarded_blend

BASE = Provenance(
    model_arch="llama:abc", weights_sha256="w" * 64, tokenizer_sha256="t" * 64, dtype="float32",
    kv_dtype="float32", device_class="cpu", backend="kvblend-layers/torch/sdpa",
    rope='{"rope_theta": 100000.0}', adapter="none",
)
FIELDS = [f.name for f in dataclasses.fields(Provenance)]
tokens = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40)


def changed(prov: Provenance, field: str, salt: str) -> Provenance:
    value = getattr(prov, field)
    new = value + 1 if isinstance(value, int) else value + salt
    return dataclasses.replace(prov, **{field: new})


@settings(max_examples=60, deadline=None)
@given(field=st.sampled_from(FIELDS), salt=st.text(min_size=1, max_size=5), pre=tokens, chunk=tokens)
def test_any_single_field_changes_both_key_kinds(field, salt, pre, chunk):
    other = changed(BASE, field, salt)
    assert canonical_key(BASE, pre, chunk) != canonical_key(other, pre, chunk)
    assert exact_chain(BASE, [pre, chunk]) != exact_chain(other, [pre, chunk])
    assert all(a != b for a, b in zip(exact_chain(BASE, [pre, chunk]), exact_chain(other, [pre, chunk])))


@settings(max_examples=60, deadline=None)
@given(pre=tokens, chunk=tokens, where=st.integers(0, 10_000), delta=st.integers(1, 1000))
def test_one_token_or_the_preamble_changes_the_key(pre, chunk, where, delta):
    i = where % len(chunk)
    chunk2 = chunk[:i] + [(chunk[i] + delta) % 2**31] + chunk[i + 1:]
    assert canonical_key(BASE, pre, chunk) != canonical_key(BASE, pre, chunk2)
    pre2 = pre + [7]
    assert canonical_key(BASE, pre, chunk) != canonical_key(BASE, pre2, chunk)
    assert exact_chain(BASE, [pre, chunk])[1] != exact_chain(BASE, [pre2, chunk])[1]


def test_chain_is_prefix_dependent_and_boundaries_matter():
    a, b = [1, 2, 3], [4, 5]
    assert exact_chain(BASE, [a, b])[0] == exact_chain(BASE, [a])[0]
    assert exact_chain(BASE, [a, b])[1] != exact_chain(BASE, [b, a])[1]
    # the same tokens split differently are different segments
    assert exact_chain(BASE, [[1, 2], [3, 4, 5]])[1] != exact_chain(BASE, [a, b])[1]
    # exact keys depend on the neighbours before a segment: the same document after another one
    pre, doc = [9, 9], [6, 7, 8]
    assert exact_chain(BASE, [pre, a, doc])[2] != exact_chain(BASE, [pre, b, doc])[2]
    assert len(exact_chain(BASE, [a, b])[1]) == 32


def test_canonical_keys_never_depend_on_neighbours_exact_ones_do(tiny_engine_factory):
    """The same document between different neighbours (at another position too): a blend reuses it
    under one canonical key (preamble and its own tokens only), exact reuse keys it by its whole prefix."""
    eng = tiny_engine_factory()
    d = make_docs(5)
    first = eng.build_prompt("Which?", [d[0], d[2], d[1]])
    second = eng.build_prompt("Which?", [d[3], d[4], d[2], d[0]])
    assert first.documents[1].token_ids == second.documents[2].token_ids
    eng.precompute_chunks(d)
    blended = [eng.generate(p, unguarded_blend(ratio=0.15), max_new_tokens=1).report.segments for p in (first, second)]
    row1, row2 = blended[0][2], blended[1][3]  # the shared document (after the preamble's row)
    assert row1.reuse_class is row2.reuse_class is ReuseClass.BLENDED and row1.start != row2.start
    want = key_hex(canonical_key(eng.provenance, first.preamble.token_ids, first.documents[1].token_ids))
    assert row1.key == row2.key == want
    exact = [eng.generate(p, max_new_tokens=1).report.segments for p in (first, second)]
    assert exact[0][2].key and exact[1][3].key and exact[0][2].key != exact[1][3].key
    assert want not in (exact[0][2].key, exact[1][3].key)


def test_engine_provenance_differs_by_dtype_model_and_kv_dtype():
    from blend.engine import Engine

    base = Engine.load("tiny-llama").provenance
    assert Engine.load("tiny-llama", dtype="bfloat16").provenance.dtype == "bfloat16"
    assert Engine.load("tiny-llama", kv_dtype="float16").provenance != base
    qwen = Engine.load("tiny-qwen2").provenance
    assert qwen.weights_sha256 != base.weights_sha256 and qwen.model_arch != base.model_arch
    scaled = Engine.load("tiny-llama-rope-linear").provenance
    assert scaled.rope != base.rope


KV_BITS_CHILD = """
import hashlib, json
from blend.engine import Engine
eng = Engine.load("tiny-llama", quality_gate=False)
prompt = eng.build_prompt("Which?", [" ".join(["alpha beta gamma delta"] * 30)])
kv = eng.segments.canonical_kv(prompt.preamble, prompt.documents[0].token_ids)
bits = hashlib.sha256(kv.k.numpy().tobytes() + kv.v.numpy().tobytes()).hexdigest()
print(json.dumps({"provenance": eng.provenance_json, "kv": bits}))
"""


def test_cpus_that_compute_other_kv_bits_have_other_provenances():
    """ATen's CPU kernels (norms, softmax, attention) and oneDNN's GEMMs dispatch on the CPU's vector ISA, and
    an AVX2 CPU's KV differs from an AVX-512 CPU's in the last bits: a store shared by both (Redis) must not
    serve one's entries to the other as exact. ``ATEN_CPU_CAPABILITY`` stands in for the other CPU here."""
    import json
    import os
    import subprocess
    import sys

    import pytest
    import torch

    runs = {}
    for cap in ("", "avx2", "default"):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": cap, "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, "-c", KV_BITS_CHILD], env=env, capture_output=True, text=True,
                             check=True, timeout=300)
        runs[cap] = json.loads(out.stdout.strip().splitlines()[-1])
    if len({r["kv"] for r in runs.values()}) < 2:
        pytest.skip(f"every ISA this CPU ({torch.backends.cpu.get_cpu_capability()}) offers computed the same bits")
    for a in runs:
        for b in runs:
            if a < b and runs[a]["kv"] != runs[b]["kv"]:
                assert runs[a]["provenance"] != runs[b]["provenance"], (a, b)


def test_an_engines_provenance_names_the_dtype_its_runner_computes_in(tiny_engine):
    """``Engine(runner, config)`` over a bfloat16 runner with a float32 config would store bf16-computed KV
    under a float32 provenance (and serve it to float32 engines as exact): refused."""
    import pytest
    import torch

    from blend.engine import Engine
    from blend.engine_setup import EngineConfig
    from blend.errors import InvalidRequestError
    from blend.model import ModelRunner

    runner = ModelRunner(tiny_engine.runner.loaded, torch.bfloat16, tiny_engine.device)
    with pytest.raises(InvalidRequestError, match="bfloat16"):
        Engine(runner, EngineConfig(model="tiny-llama", dtype="float32"))
    assert Engine(runner, EngineConfig(model="tiny-llama", dtype="bfloat16")).provenance.dtype == "bfloat16"


def test_the_float32_matmul_precision_is_in_the_key_and_a_change_after_loading_is_refused(tiny_engine_factory):
    """torch.set_float32_matmul_precision("medium") runs float32 GEMMs in bf16 on CPUs that have it:
    other KV under the same keys (0.016 off) before it was part of the provenance."""
    import torch

    from blend.engine_setup import fp32_precision_label
    from blend.errors import InvalidRequestError
    before = tiny_engine_factory()
    saved = torch.get_float32_matmul_precision(), torch.backends.mkldnn.matmul.fp32_precision
    try:
        torch.set_float32_matmul_precision("medium")
        medium = tiny_engine_factory()
        assert medium.provenance.digest() != before.provenance.digest()
        with pytest.raises(InvalidRequestError, match="float32 matmul precision changed"):
            before.generate(before.build_prompt("q?", ["a document"]), ReusePolicy.exact(), max_new_tokens=1)
        with pytest.raises(InvalidRequestError, match="float32 matmul precision changed"):
            before.precompute_chunks(["a document"])
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.mkldnn.matmul.fp32_precision = saved[1]
    assert fp32_precision_label() == before._fp32_precision  # restored: "none" and "ieee" read the same


def test_onednn_fpmath_mode_is_in_the_device_class(monkeypatch):
    from blend.cpu_features import cpu_kernel_class
    plain = cpu_kernel_class()
    monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", "BF16")
    assert cpu_kernel_class() != plain


def test_the_engines_provenance_names_the_library_that_makes_its_rope_tables(tiny_engine):
    """The RoPE tables come from transformers' rotary module: a transformers release that changed their
    arithmetic kept the keys, and served KV made with the old tables."""
    import transformers

    assert f"/transformers-{transformers.__version__}/" in tiny_engine.provenance.backend
