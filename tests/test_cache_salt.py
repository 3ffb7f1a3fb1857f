"""cache_salt: mixed into every key a request derives; the empty salt keeps the old keys."""

import hashlib

import pytest

from blend.errors import InvalidPolicyError
from blend.keys import EXACT_ROOT, Provenance, canonical_key, exact_chain, token_digest
from blend.policy import ReusePolicy
from blend.report import ReuseClass
from conftest import make_docs, unguarded_blend

PROV = Provenance(model_arch="llama:x", weights_sha256="w", tokenizer_sha256="t", dtype="float32",
                  kv_dtype="float32", device_class="cpu", backend="torch", rope="{}")
PRE, A, B = [1, 2, 3], [10, 11], [20, 21, 22]


def test_empty_salt_keeps_the_keys_that_existed_before_salts():
    # the formulas as they were before cache_salt was added (the chain's root renamed since: EXACT_ROOT)
    old_chain, prev = [], EXACT_ROOT + PROV.digest()
    for seg in (PRE, A, B):
        prev = hashlib.sha256(b"exact" + prev + token_digest(seg)).digest()
        old_chain.append(prev)
    old_canonical = hashlib.sha256(b"canonical" + PROV.digest() + token_digest(PRE) + token_digest(A)).digest()
    assert exact_chain(PROV, [PRE, A, B]) == old_chain == exact_chain(PROV, [PRE, A, B], "")
    assert canonical_key(PROV, PRE, A) == old_canonical == canonical_key(PROV, PRE, A, "")


def test_two_salts_share_no_key():
    keys = {}
    for salt in ("", "tenant-a", "tenant-b", "tenant-a\x00"):
        keys[salt] = set(exact_chain(PROV, [PRE, A, B], salt)) | {canonical_key(PROV, PRE, A, salt),
                                                                  canonical_key(PROV, PRE, B, salt)}
    salts = list(keys)
    for i, s in enumerate(salts):
        assert len(keys[s]) == 5
        for t in salts[i + 1:]:
            assert not keys[s] & keys[t], (s, t)


@pytest.mark.parametrize("make_policy", [
    lambda salt: ReusePolicy.exact(cache_salt=salt),
    lambda salt: unguarded_blend(ratio=0.2, cache_salt=salt),
])
def test_engine_requests_with_different_salts_share_nothing(tiny_engine, make_policy):
    prompt = tiny_engine.build_prompt("which stone?", make_docs(3))
    first, _, rep_a = tiny_engine.prefill(prompt, make_policy("a"))
    assert rep_a.reused_tokens == 0
    _, _, rep_b = tiny_engine.prefill(prompt, make_policy("b"))  # another tenant: nothing found
    assert rep_b.reused_tokens == 0
    assert all(s.reuse_class is not ReuseClass.EXACT for s in rep_b.segments)
    again, _, rep_a2 = tiny_engine.prefill(prompt, make_policy("a"))  # the same tenant: its own KV is found
    assert rep_a2.reused_tokens > 0
    assert [s.key for s in rep_a2.segments] == [s.key for s in rep_a.segments]
    assert not {s.key for s in rep_a.segments if s.key} & {s.key for s in rep_b.segments if s.key}
    assert first.equal(again)  # cold equals warm within a tenant


def test_semantic_reuse_refuses_a_salt():
    with pytest.raises(InvalidPolicyError, match="cache_salt"):
        unguarded_blend(semantic=True, cache_salt="t")
    with pytest.raises(InvalidPolicyError, match="string"):
        ReusePolicy.exact(cache_salt=3)
    with pytest.raises(InvalidPolicyError, match="lone surrogate"):  # a key derivation would crash mid-request
        ReusePolicy.exact(cache_salt="tenant-\ud800")
