"""Provenance and store keys.

A cache hit is a claim about provenance: a stored KV row may only be served
for a request whose every KV-changing field is equal. Every such field lives
in :class:`Provenance`; keys are sha256 over a canonical encoding of it plus
the token ids (never Python ``hash()``, which is salted per process).

Exact-reuse keys are prefix-chained: the key of segment i hashes the key of
segment i-1, so a segment only hits behind the very same prefix::

    preamble      doc A          doc B          question
    k0=H(P,t0) -> k1=H(k0,tA) -> k2=H(k1,tB) -> (never stored)

Because that chain fixes every token before a segment, it fixes the segment's
positions too: an EXACT entry holds K *after* RoPE at those positions (a load
copies it), while CANONICAL and APPROX entries hold K before RoPE (a load
rotates it to wherever the prompt places the chunk); see
:attr:`Namespace.k_after_rope`. The chain's root names that form
(``EXACT_ROOT``), so an entry stored in the earlier form (K before RoPE under
an EXACT key) is never reached again.

Canonical chunk keys (blend) hash the preamble's tokens and the chunk's own
tokens only: the chunk is always computed alone right after the preamble.

A request's ``cache_salt`` (a tenant's secret, as vLLM and SGLang name it) is
mixed into every key it derives, so requests with different salts share no
KV; the empty salt adds nothing, so unsalted keys are the same as before salts
existed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from enum import Enum
from typing import NewType, Sequence

StoreKey = NewType("StoreKey", bytes)  # 32 raw sha256 bytes

STORE_FORMAT_VERSION = 1


class Namespace(Enum):
    """Disjoint key spaces: approximate KV never lands where exact KV lives."""

    EXACT = "exact"  # prefix-chained segments, bit-identical to a cold prefill
    CANONICAL = "canonical"  # a chunk computed alone right after the preamble
    APPROX = "approx"  # anything produced by a blended or semantic path

    @property
    def k_after_rope(self) -> bool:
        """Whether this namespace's entries hold K after RoPE: EXACT ones, at the positions their prefix
        chain fixes (a load copies them, no rotation); the others hold K before RoPE."""
        return self is Namespace.EXACT


# the root of every prefix chain; it names the EXACT entries' form (K after RoPE). Until 2026-12-06 the
# root was b"exact-root" and EXACT entries held K before RoPE: those keys are never derived again.
EXACT_ROOT = b"exact-root/k-after-rope"


@dataclass(frozen=True)
class Provenance:
    """Every field that changes the KV a model produces for given tokens.

    Changing any one field must change every key derived from it.
    """

    model_arch: str  # model_type plus a hash of the architecture config
    weights_sha256: str  # fingerprint over the model's tensors
    tokenizer_sha256: str  # fingerprint of the tokenizer's vocabulary and rules
    dtype: str  # compute dtype, e.g. "float32"
    kv_dtype: str  # dtype the KV is stored at (may be lower than dtype)
    device_class: str  # "cuda:sm<capability>", or "cpu/<ISA>/<kernel flags>" (blend.cpu_features.cpu_kernel_class)
    backend: str  # attention/kernel backend and its version
    rope: str  # canonical JSON of the rotary configuration (type, theta, scaling)
    adapter: str = "none"  # LoRA/adapter identity and weights hash
    format_version: int = STORE_FORMAT_VERSION

    def canonical_json(self) -> str:
        """Canonical, sorted JSON of every field (stored in entry headers)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    def digest(self) -> bytes:
        """sha256 of the canonical JSON."""
        return provenance_digest(self.canonical_json())


def provenance_digest(canonical_json: str) -> bytes:
    """:meth:`Provenance.digest` from the canonical JSON alone (what a component given only the JSON holds).

    Args:
        canonical_json: :meth:`Provenance.canonical_json`'s text.

    Returns:
        Its sha256, 32 bytes.
    """
    return hashlib.sha256(canonical_json.encode()).digest()


def _tokens_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 (raises on ids outside [0, 2**32))."""
    import numpy as np  # on use: the store's inspection commands read keys without hashing tokens

    return np.asarray(token_ids, dtype="<u4").tobytes()


def token_digest(token_ids: Sequence[int]) -> bytes:
    """sha256 over token ids as little-endian uint32 with a length prefix.

    Args:
        token_ids: the tokens (each below 2**32).

    Returns:
        The digest, 32 bytes.
    """
    h = hashlib.sha256()
    h.update(len(token_ids).to_bytes(8, "little"))
    h.update(_tokens_bytes(token_ids))
    return h.digest()


def _salted(head: bytes, salt: str) -> bytes:
    """``head`` unchanged for the empty salt, else with the salt's length-prefixed UTF-8 bytes."""
    if not salt:
        return head
    raw = salt.encode("utf-8")
    return head + b"salt" + len(raw).to_bytes(8, "little") + raw


def exact_chain(prov: Provenance, segments: Sequence[Sequence[int]], salt: str = "") -> list[StoreKey]:
    """Prefix-chained keys, one per segment.

    Args:
        prov: the engine's provenance.
        segments: token ids of each segment, in prompt order.
        salt: the request's cache salt ("" = none).

    Returns:
        keys[i] commits to the provenance, the salt and every token of segments 0..i.
    """
    keys: list[StoreKey] = []
    prev = _salted(EXACT_ROOT + prov.digest(), salt)
    for seg in segments:
        prev = hashlib.sha256(b"exact" + prev + token_digest(seg)).digest()
        keys.append(StoreKey(prev))
    return keys


def canonical_key(prov: Provenance, preamble: Sequence[int], chunk: Sequence[int], salt: str = "") -> StoreKey:
    """Key of a chunk's canonical KV (computed alone right after ``preamble``).

    Args:
        prov: the engine's provenance.
        preamble: token ids that preceded the chunk when it was computed.
        chunk: the chunk's token ids.
        salt: the request's cache salt ("" = none).

    Returns:
        A key independent of any other chunk and of which request computed it.
    """
    return canonical_key_of(prov.digest(), token_digest(preamble), token_digest(chunk), salt)


def canonical_key_of(prov_digest: bytes, preamble_digest: bytes, chunk_digest: bytes, salt: str = "") -> StoreKey:
    """:func:`canonical_key` from the digests (a donor record carries its preamble's digest, not its tokens).

    Args:
        prov_digest: :meth:`Provenance.digest`.
        preamble_digest, chunk_digest: :func:`token_digest` of the preamble and of the chunk.
        salt: the request's cache salt ("" = none).

    Returns:
        The key :func:`canonical_key` gives for the same provenance, preamble, chunk and salt.
    """
    return StoreKey(hashlib.sha256(_salted(b"canonical" + prov_digest, salt) + preamble_digest + chunk_digest).digest())


def key_hex(key: StoreKey) -> str:
    """Printable form of a key.

    Args:
        key: a store key.

    Returns:
        Its bytes in lowercase hex (64 digits for a sha256 key).
    """
    return bytes(key).hex()
