"""Fuzz: the small files kvblend caches results in, each read back only when it is exactly what was written.

- the quality gate's record (``$KVBLEND_HOME/gate/*.json``): ``load_record`` returns None or a record of this
  engine's provenance holding every check once, each ``passed`` as its figure and bound say, against this
  engine's bounds (a record never lets blending on by what it lacks);
- a checkpoint's weights fingerprint file: ``read_fingerprint`` returns None or 64 lowercase hex digits;
- the sweep's cached reference logits: whatever the file holds, ``reference_logits`` returns full prefill's
  logits bit for bit (a damaged file is computed again, never used).

Mutations start from the files as written: structural rewrites, JSON texts json.dumps never writes, bit flips,
truncations; all within the per-example bounds.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from blend import fingerprints, gate
from blend.evals.ref_cache import reference_logits
from blend.policy import ReusePolicy
from conftest import make_docs
from _fuzz_util import bounded, dumps_mutated, fuzz_budget, mutate_bytes, mutate_json

HEX = frozenset("0123456789abcdef")


def _json_damage(value, data: st.DataObject) -> bytes:
    how = data.draw(st.sampled_from(["json", "text", "bytes"]), label="how")
    if how == "json":
        return json.dumps(mutate_json(value, data)).encode()
    return dumps_mutated(value, data) if how == "text" else mutate_bytes(json.dumps(value).encode(), data)


@pytest.fixture(scope="module")
def engine(tiny_engine_factory, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # the gate's records go under this module's own home
        mp.setenv("KVBLEND_HOME", str(tmp_path_factory.mktemp("home")))
        yield tiny_engine_factory()


# ---- the quality gate's record ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def gate_record(engine):
    bounds = gate.check_bounds(engine.dtype, engine.kv_dtype)
    figures = {n: 1.0 if n in gate.AT_LEAST else 0.0 for n in gate.CheckName}
    passed = gate.GateResult(engine.model_name, engine.provenance.digest().hex(), tuple(
        gate.CheckResult.judged(n, figures[n], bounds[n], "test") for n in gate.CheckName))
    gate.record(engine, passed)
    assert gate.load_record(engine) == passed
    return json.loads(gate.gate_path(engine).read_text()), bounds


@fuzz_budget(100)
@given(data=st.data())
def test_a_damaged_gate_record_is_no_record_or_a_consistent_one(engine, gate_record, data):
    value, bounds = gate_record
    for _ in range(data.draw(st.integers(0, 2), label="more rewrites")):
        value = mutate_json(value, data)
    gate.gate_path(engine).write_bytes(_json_damage(value, data))
    with bounded():
        got = gate.load_record(engine)
    if got is not None:
        assert got.provenance_sha256 == engine.provenance.digest().hex()
        assert sorted(c.name.value for c in got.checks) == sorted(n.value for n in gate.CheckName)
        for c in got.checks:
            assert c.passed is gate.passes(c.name, c.figure, c.bound) and c.bound == bounds[c.name]


# ---- a checkpoint's weights fingerprint --------------------------------------------------------------

FINGERPRINT = {"weights_sha256": "ab" * 32, "stamp": "cd" * 32}


@fuzz_budget(100)
@given(data=st.data())
def test_a_damaged_fingerprint_file_is_no_fingerprint_or_a_well_formed_one(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fp") / fingerprints.FINGERPRINT_FILE
    path.write_bytes(_json_damage(FINGERPRINT, data))
    with bounded():
        row = fingerprints.read_record(path)
    got = row["weights_sha256"] if row is not None else None
    assert got is None or (isinstance(got, str) and len(got) == 64 and set(got) <= HEX)


# ---- the sweep's reference logits --------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(engine, tmp_path_factory):
    """(prompt, full prefill's logits, the cache folder, its one file's bytes as written)."""
    prompt = engine.build_prompt("Which one?", make_docs(2))
    want, _, _ = engine.prefill(prompt, ReusePolicy.one_pass())
    folder = tmp_path_factory.mktemp("refs")
    assert torch.equal(reference_logits(engine, prompt, folder), want)
    [path] = folder.glob("*.pt")
    return prompt, want, folder, path.read_bytes()


def _flip_in_the_logits(blob: bytes, want: torch.Tensor, bit: int) -> bytes:
    """The saved record with one bit of one logit's bytes flipped (the zip stores them as they are)."""
    at = blob.find(want.numpy().tobytes()[:64])
    assert at > 0
    out = bytearray(blob)
    out[at + 21] ^= 1 << bit
    return bytes(out)


def test_a_flipped_bit_in_cached_logits_is_computed_again_not_used(engine, reference):
    """torch.load reads a stored tensor's bytes without checking them: a flipped bit in the cached file
    changed one logit of the reference, and every KL of the item with it."""
    prompt, want, folder, blob = reference
    [path] = folder.glob("*.pt")
    path.write_bytes(_flip_in_the_logits(blob, want, 5))
    assert torch.equal(reference_logits(engine, prompt, folder), want)
    assert path.read_bytes() == blob  # rewritten


def test_a_cached_bare_tensor_as_files_before_the_digest_held_is_computed_again(engine, reference):
    prompt, want, folder, blob = reference
    [path] = folder.glob("*.pt")
    buf = io.BytesIO()
    torch.save(want + 1, buf)  # a file from before the digest: nothing says its values are the reference's
    path.write_bytes(buf.getvalue())
    assert torch.equal(reference_logits(engine, prompt, folder), want)
    assert path.read_bytes() == blob


@fuzz_budget(30)  # ~0.1 s an example (a damaged file's logits are computed again)
@given(data=st.data())
def test_a_damaged_cached_reference_gives_full_prefills_logits(engine, reference, data):
    prompt, want, folder, blob = reference
    [path] = folder.glob("*.pt")
    if data.draw(st.booleans(), label="in the logits"):
        damaged = _flip_in_the_logits(blob, want, data.draw(st.integers(0, 7), label="bit"))
    else:
        damaged = mutate_bytes(blob, data)
    path.write_bytes(damaged)
    with bounded(max_bytes=64 << 20):
        got = reference_logits(engine, prompt, folder)
    assert torch.equal(got, want)
