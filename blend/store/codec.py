"""Entry <-> bytes: one safetensors blob with a kvblend header in its metadata.

Layout (the safetensors format, written and parsed here so that a load is a
single read plus zero-copy tensor views, and a write needs no staging copy)::

    [ n: u64 little-endian ][ n bytes JSON header, space-padded to 8 ][ k bytes ][ v bytes ]
                             {"k": {dtype, shape, data_offsets},
                              "v": {...},
                              "__metadata__": {"kvblend": "<EntryHeader JSON>"}}

The kvblend header carries the format version, namespace, key, provenance
JSON, shape, dtype and a checksum over those claims and the tensor bytes
(:class:`ChecksumKind`: XXH3-128 since 2026-12-06, sha256 before; both are read). Any file a
safetensors reader opens is accepted here only if every one of those agrees
otherwise :func:`decode` raises :class:`EntryError` with a typed reason, which
the tiers turn into a ``REJECTED`` lookup.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass, fields, replace
from enum import Enum
from typing import TYPE_CHECKING, Sequence

import xxhash

from blend.keys import STORE_FORMAT_VERSION, Namespace, StoreKey, key_hex
from blend.store.base import KVEntry

if TYPE_CHECKING:
    import torch

FORMAT_TAG = "kvblend-kv"
MAX_HEADER_BYTES = 1 << 20  # a real header is ~1 KB; anything larger is corrupt
MAX_ENTRY_BYTES = 2 << 30  # default cap on a whole blob a tier reads (30-layer 135M model: 45 KiB/token)
MAX_DIM = 1 << 20  # layers, KV heads, head dim: each in [1, MAX_DIM] (real models: tens to hundreds)
MAX_TOKENS = 1 << 31  # tokens of one entry: [0, MAX_TOKENS]
MAX_ELEMENTS = 1 << 48  # L x Hkv x max(T, 1) x D: what a view's strides span, whatever T (an empty entry too)

# by dtype name (the header's spelling): reading and checking headers needs no torch (``kvblend store ls``)
_ST_DTYPES: dict[str, str] = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # -> safetensors' name
_ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the spelling Provenance uses).

    Args:
        dtype: a torch dtype.

    Returns:
        Its name without the ``torch.`` prefix.
    """
    return str(dtype).removeprefix("torch.")


class EntryErrorKind(Enum):
    TRUNCATED = "truncated"
    BAD_HEADER = "bad header"
    FORMAT_VERSION = "format version"
    SHAPE = "shape"
    DTYPE = "dtype"
    CHECKSUM = "checksum"
    KEY_MISMATCH = "key mismatch"  # the blob names another key or namespace
    TOO_LARGE = "too large"  # claims more bytes than a reader may allocate
    NOT_A_BLOB = "not a blob"  # a FIFO, device, directory or symlink (disk), a list (Redis) where an entry belongs


class EntryError(Exception):
    """A stored blob that must not be used; ``kind`` says why."""

    def __init__(self, kind: EntryErrorKind, detail: str) -> None:
        super().__init__(f"{kind.value}: {detail}")
        self.kind = kind
        self.detail = detail


class ChecksumKind(Enum):
    """The integrity check a blob's header names (its JSON field's name).

    The check guards against corruption (torn writes, bit rot, a truncated copy): whoever can
    rewrite a blob can rewrite its checksum too, so a cryptographic hash adds nothing here, and
    sha256 verified loads at ~0.7 GB/s (39 ms of a 600-row chunk's 42 ms disk load, BENCHMARKS.md
    "Store tiers"). Provenance lives in the keys, which stay sha256.
    """

    SHA256 = "sha256"  # written until 2026-12-06; still read
    XXH3_128 = "xxh3_128"  # written since


WRITE_CHECKSUM = ChecksumKind.XXH3_128


@dataclass(frozen=True)
class EntryHeader:
    """What the kvblend metadata of a blob claims (validated by :func:`decode`).

    In JSON the checksum is one field named after its kind (``"xxh3_128": "<hex>"``); every other
    field is itself.
    """

    format_version: int
    namespace: str
    key: str  # hex
    provenance: str  # canonical JSON of the producing Provenance
    shape: tuple[int, int, int, int]  # (L, Hkv, T, D), same for k and v
    dtype: str  # "float32" | "float16" | "bfloat16"
    checksum: str  # hex, over the other fields' JSON (this one empty), then k bytes, then v bytes
    checksum_kind: ChecksumKind = WRITE_CHECKSUM
    tag: str = FORMAT_TAG

    @property
    def tensor_bytes(self) -> int:
        """Bytes of k and v together."""
        L, H, T, D = self.shape
        return 2 * L * H * T * D * _ITEMSIZE[self.dtype]

    def to_json(self) -> str:
        d = {f: v for f, v in asdict(self).items() if f not in ("checksum", "checksum_kind")}
        d[self.checksum_kind.value] = self.checksum
        return json.dumps(d, sort_keys=True, separators=(",", ":"))


_BASE_FIELDS = frozenset(f.name for f in fields(EntryHeader)) - {"checksum", "checksum_kind"}
_CHECKSUM_FIELDS = {k.value: k for k in ChecksumKind}
_STR_FIELDS = ("namespace", "key", "provenance", "dtype", "tag")


def checksum(meta: EntryHeader, *data: memoryview) -> str:
    """The header's kind of checksum over its claims (all but the checksum) and then the tensor bytes.

    Covering the claims too means a header edited to another shape of the same
    byte count, another provenance or another key fails the check.

    Args:
        meta: the entry's header (its ``checksum`` field is left out of what is hashed; its
            ``checksum_kind`` picks XXH3-128 or sha256).
        data: the tensor bytes, in order (K's, then V's).

    Returns:
        The checksum as lowercase hex.
    """
    claims = replace(meta, checksum="").to_json().encode()
    h = hashlib.sha256(claims) if meta.checksum_kind is ChecksumKind.SHA256 else xxhash.xxh3_128(claims)
    for d in data:
        h.update(d)
    return h.hexdigest()


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor in memory order, without a copy when contiguous."""
    import torch  # a tensor exists: torch is loaded already

    t = t.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")  # (numel * itemsize,), also when empty


def encode_parts(ns: Namespace, key: StoreKey, entry: KVEntry) -> list[memoryview | bytes]:
    """Serialize ``entry`` as [safetensors header, k bytes, v bytes].

    Args:
        ns: namespace the entry is stored in (recorded, checked on decode).
        key: the entry's key (recorded, checked on decode).
        entry: k and v of equal shape (L, Hkv, T, D) and dtype.

    Returns:
        Buffers whose concatenation is the blob; write them in order.
    """
    if dtype_name(entry.k.dtype) not in _ST_DTYPES:
        raise ValueError(f"unsupported KV dtype {entry.k.dtype}")
    if entry.k.shape != entry.v.shape or entry.k.dim() != 4 or entry.k.dtype != entry.v.dtype:
        raise ValueError(f"k/v must share a 4-d shape and dtype: {entry.k.shape} {entry.v.shape}")
    kb, vb = _raw(entry.k), _raw(entry.v)
    meta = EntryHeader(
        format_version=STORE_FORMAT_VERSION,
        namespace=ns.value,
        key=key_hex(key),
        provenance=entry.provenance,
        shape=tuple(int(s) for s in entry.k.shape),  # type: ignore[arg-type]
        dtype=dtype_name(entry.k.dtype),
        checksum="",
        checksum_kind=WRITE_CHECKSUM,
    )
    meta = replace(meta, checksum=checksum(meta, kb, vb))
    st = _ST_DTYPES[meta.dtype]
    shape = list(meta.shape)
    header = {
        "__metadata__": {"kvblend": meta.to_json()},
        "k": {"dtype": st, "shape": shape, "data_offsets": [0, len(kb)]},
        "v": {"dtype": st, "shape": shape, "data_offsets": [len(kb), len(kb) + len(vb)]},
    }
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    return [struct.pack("<Q", len(hj)) + hj, kb, vb]


def encode(ns: Namespace, key: StoreKey, entry: KVEntry) -> bytes:
    """One contiguous blob (see :func:`encode_parts`).

    Args:
        ns, key: where the entry is stored (named in its header, checked on decode).
        entry: the KV to encode.

    Returns:
        The blob: length field, JSON header, K bytes, V bytes.
    """
    return b"".join(encode_parts(ns, key, entry))


def header_length(prefix: bytes | bytearray | memoryview) -> int:
    """Bytes taken by the length field plus the JSON header, from the first 8 bytes.

    Args:
        prefix: at least the blob's first 8 bytes.

    Returns:
        8 plus the header's length: the offset of the header's end.

    Raises:
        EntryError: fewer than 8 bytes (truncated), or a header longer than ``MAX_HEADER_BYTES``.
    """
    if len(prefix) < 8:
        raise EntryError(EntryErrorKind.TRUNCATED, f"{len(prefix)} bytes, no length field")
    (n,) = struct.unpack("<Q", bytes(prefix[:8]))
    if n > MAX_HEADER_BYTES:
        raise EntryError(EntryErrorKind.BAD_HEADER, f"header length {n} exceeds {MAX_HEADER_BYTES}")
    return 8 + n


def _json(text: str | bytes, what: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError; nesting: RecursionError
        raise EntryError(EntryErrorKind.BAD_HEADER, f"unparsable {what} ({type(e).__name__})") from None


def _count(x: object, what: str, kind: EntryErrorKind = EntryErrorKind.SHAPE) -> int:
    """A JSON whole number >= 0 (``True`` is not one)."""
    if type(x) is not int or x < 0:
        raise EntryError(kind, f"{what} must be a whole number >= 0, got {x!r:.40}")
    return x


def _ints(x: object, n: int, what: str) -> tuple[int, ...]:
    if not isinstance(x, list) or len(x) != n:
        raise EntryError(EntryErrorKind.SHAPE, f"{what} must be a list of {n} whole numbers, got {x!r:.60}")
    return tuple(_count(v, what) for v in x)


def _entry_header(meta: object) -> EntryHeader:
    """The kvblend metadata, every field of its declared JSON type."""
    if not isinstance(meta, dict) or meta.get("tag") != FORMAT_TAG:
        raise EntryError(EntryErrorKind.BAD_HEADER, "not a kvblend entry")
    version = meta.get("format_version")
    if type(version) is not int or version != STORE_FORMAT_VERSION:
        raise EntryError(EntryErrorKind.FORMAT_VERSION, f"format {version!r:.40}, this build reads {STORE_FORMAT_VERSION}")
    named = [name for name in meta if name in _CHECKSUM_FIELDS]
    if len(named) != 1 or set(meta) != _BASE_FIELDS | {named[0]}:
        raise EntryError(EntryErrorKind.BAD_HEADER, f"kvblend fields {sorted(meta)!r:.200} are not "
                                                    f"{sorted(_BASE_FIELDS)} and one of {sorted(_CHECKSUM_FIELDS)}")
    for name in (*_STR_FIELDS, named[0]):
        if not isinstance(meta[name], str):
            raise EntryError(EntryErrorKind.BAD_HEADER, f"kvblend field {name!r} is not a string")
    if meta["dtype"] not in _ST_DTYPES:
        raise EntryError(EntryErrorKind.DTYPE, f"unsupported dtype {meta['dtype']!r:.40}")
    shape = _ints(meta["shape"], 4, "shape")
    _check_dims(shape)
    base = {name: meta[name] for name in _BASE_FIELDS}
    return EntryHeader(**{**base, "shape": shape}, checksum=meta[named[0]],  # type: ignore[arg-type]
                       checksum_kind=_CHECKSUM_FIELDS[named[0]])


def _check_dims(shape: tuple[int, ...]) -> None:
    """Each dimension in its range and the strides they imply bounded: a header claiming (0, 2**40,
    2**40, 1) over zero bytes would pass the size and checksum checks, then fail to become a tensor."""
    L, H, T, D = shape
    for name, n in (("layers", L), ("KV heads", H), ("head dim", D)):
        if not 1 <= n <= MAX_DIM:
            raise EntryError(EntryErrorKind.SHAPE, f"{name} {n} outside [1, {MAX_DIM}]")
    if T > MAX_TOKENS:
        raise EntryError(EntryErrorKind.SHAPE, f"{T} tokens, over {MAX_TOKENS}")
    if L * H * max(T, 1) * D > MAX_ELEMENTS:
        raise EntryError(EntryErrorKind.SHAPE, f"shape {list(shape)} spans over {MAX_ELEMENTS} elements")


def decode_header(blob: bytes | bytearray | memoryview) -> tuple[EntryHeader, dict, int]:
    """Parse and check the headers (not the tensor data) of a blob.

    Every field is checked for its JSON type before it is used, so any bytes
    give a header or an :class:`EntryError`, never another exception.

    Args:
        blob: at least the first ``header_length`` bytes of a blob.

    Returns:
        (kvblend header, safetensors tensor table, offset of the data section).

    Raises:
        EntryError: for any blob that is not a well-formed kvblend header.
    """
    start = header_length(blob)
    if len(blob) < start:
        raise EntryError(EntryErrorKind.TRUNCATED, f"{len(blob)} bytes, header needs {start}")
    table = _json(bytes(blob[8:start]), "header")
    if not isinstance(table, dict):
        raise EntryError(EntryErrorKind.BAD_HEADER, "header is not a JSON object")
    extra = sorted(set(table) - {"__metadata__", "k", "v"})
    if extra:
        raise EntryError(EntryErrorKind.BAD_HEADER, f"unexpected header entries {extra!r:.80}")
    md = table.get("__metadata__")
    if not isinstance(md, dict) or not isinstance(md.get("kvblend"), str):
        raise EntryError(EntryErrorKind.BAD_HEADER, "not a kvblend entry (no kvblend metadata)")
    hdr = _entry_header(_json(md["kvblend"], "kvblend metadata"))
    st_dtype = _ST_DTYPES[hdr.dtype]
    nbytes = hdr.tensor_bytes // 2
    for i, name in enumerate(("k", "v")):
        info = table.get(name)
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise EntryError(EntryErrorKind.BAD_HEADER, f"tensor {name!r} is not {{dtype, shape, data_offsets}}")
        if info["dtype"] != st_dtype:
            raise EntryError(EntryErrorKind.DTYPE, f"{name} is {info['dtype']!r:.20}, header says {hdr.dtype}")
        if _ints(info["shape"], 4, f"{name} shape") != hdr.shape:
            raise EntryError(EntryErrorKind.SHAPE, f"{name} is {info['shape']}, header says {list(hdr.shape)}")
        offsets = _ints(info["data_offsets"], 2, f"{name} data_offsets")
        if offsets != (i * nbytes, (i + 1) * nbytes):
            raise EntryError(EntryErrorKind.SHAPE, f"{name} data offsets {list(offsets)} disagree with shape {list(hdr.shape)}")
    return hdr, table, start


def blob_size(hdr: EntryHeader, start: int) -> int:
    """Bytes of the whole blob a header claims (length field, header, k and v).

    Args:
        hdr: the decoded header; start: where its tensor bytes start (:func:`header_length`).

    Returns:
        The blob's size in bytes.
    """
    return start + hdr.tensor_bytes


def check_size(hdr: EntryHeader, start: int, have: int, max_bytes: int = MAX_ENTRY_BYTES) -> int:
    """Check a blob's stored size against its header's claim and a cap, before reading it.

    Args:
        hdr, start: from :func:`decode_header` on the blob's first bytes.
        have: bytes the tier holds for the blob (file size, value length).
        max_bytes: the largest blob a reader may allocate.

    Returns:
        The claimed size (== ``have``).

    Raises:
        EntryError: TOO_LARGE past the cap, TRUNCATED if shorter than claimed,
            SHAPE if longer (trailing bytes).
    """
    want = blob_size(hdr, start)
    if want > max_bytes:
        raise EntryError(EntryErrorKind.TOO_LARGE, f"header claims {want} bytes, over the cap of {max_bytes}")
    if have < want:
        raise EntryError(EntryErrorKind.TRUNCATED, f"{have - start} data bytes, shape needs {want - start}")
    if have > want:
        raise EntryError(EntryErrorKind.SHAPE, f"{have - want} trailing bytes after the tensors")
    return want


def decode(
    blob: bytearray | bytes | memoryview,
    ns: Namespace | None = None,
    key: StoreKey | None = None,
    max_bytes: int = MAX_ENTRY_BYTES,
) -> KVEntry:
    """Validate a blob completely and view it as a :class:`KVEntry`.

    Args:
        blob: the whole blob; a ``bytearray`` gives writable zero-copy tensors.
        ns, key: where the blob was found; checked against its header if given.
        max_bytes: the cap on a blob's size (see :func:`check_size`).

    Returns:
        The entry (tensors share memory with ``blob``).

    Raises:
        EntryError: truncated, bad header, other format version, shape, dtype,
            checksum, key mismatch or over the cap; never another exception.
    """
    hdr, _, start = decode_header(blob)
    if ns is not None and hdr.namespace != ns.value:
        raise EntryError(EntryErrorKind.KEY_MISMATCH, f"namespace {hdr.namespace!r:.40}, found in {ns.value!r}")
    if key is not None and hdr.key != key_hex(key):
        raise EntryError(EntryErrorKind.KEY_MISMATCH, f"blob names key {hdr.key[:16]!r}..")
    check_size(hdr, start, len(blob), max_bytes)
    if checksum(hdr, memoryview(blob)[start:]) != hdr.checksum:
        raise EntryError(EntryErrorKind.CHECKSUM, f"{hdr.checksum_kind.value} over the header claims and tensor "
                                                  "bytes differs")
    import torch  # here, not at import: reading headers (``kvblend store ls``) needs no torch

    dtype = getattr(torch, hdr.dtype)  # one of _ST_DTYPES' names: float32, float16, bfloat16
    nbytes = hdr.tensor_bytes // 2
    try:
        k = _view(blob, start, nbytes, dtype, hdr.shape)  # (L, Hkv, T, D)
        v = _view(blob, start + nbytes, nbytes, dtype, hdr.shape)  # (L, Hkv, T, D)
    except (RuntimeError, TypeError, ValueError, OverflowError) as e:  # a shape torch cannot lay out
        raise EntryError(EntryErrorKind.SHAPE, f"shape {list(hdr.shape)} is not a tensor "
                                               f"({type(e).__name__}: {str(e)[:80]})") from None
    return KVEntry(k=k, v=v, provenance=hdr.provenance)


def all_finite(t: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN and no infinity.

    A NaN or an infinity anywhere in a reused row reaches every later query's attention, so the answer; a
    checksum does not catch it where the writer computed it (an fp16 overflow on a peer) or re-signed it.
    One fp32 sum decides nearly every tensor without a temporary (~0.6 ms for a 29 MB entry, half the
    checksum's pass); only a sum that overflows is checked element by element.

    Args:
        t: a floating tensor.

    Returns:
        True when every element is finite.
    """
    import torch  # a tensor exists: torch is loaded already

    if t.numel() == 0 or bool(torch.isfinite(t.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(t).all())  # (...) bool: a NaN or an infinity, or only finite values too large to sum


def _view(blob: bytearray | bytes | memoryview, offset: int, nbytes: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    import torch  # decode's caller loaded it

    if nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    if isinstance(blob, bytes):  # read-only buffer: torch would warn; copy once
        blob = bytearray(memoryview(blob)[offset : offset + nbytes])
        offset = 0
    flat = torch.frombuffer(blob, dtype=torch.uint8, count=nbytes, offset=offset)  # (nbytes,)
    return flat.view(dtype).view(tuple(shape))  # (L, Hkv, T, D)
