"""Entry <-> bytes: one safetensors blob with a kvblend header in its metadata.

Layout (the safetensors format, written and parsed here so that a load is a
single read plus zero-copy tensor views, and a write needs no staging copy)::

    [ n: u64 little-endian ][ n bytes JSON header, space-padded to 8 ][ k bytes ][ v bytes ]
                             {"k": {dtype, shape, data_offsets},
                              "v": {...},
                              "__metadata__": {"kvblend": "<EntryHeader JSON>"}}

The kvblend header carries the format version, namespace, key, provenance
JSON, shape, dtype and a sha256 over those claims and the tensor bytes. Any file a
safetensors reader opens is accepted here only if every one of those agrees;
otherwise :func:`decode` raises :class:`EntryError` with a typed reason, which
the tiers turn into a ``REJECTED`` lookup.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import Sequence

import torch

from blend.keys import STORE_FORMAT_VERSION, Namespace, StoreKey, key_hex
from blend.store.base import KVEntry

FORMAT_TAG = "kvblend-kv"
MAX_HEADER_BYTES = 1 << 20  # a real header is ~1 KB; anything larger is corrupt

_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
}
_ST_DTYPES_INV = {v: k for k, v in _ST_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the spelling Provenance uses)."""
    return str(dtype).removeprefix("torch.")


class EntryErrorKind(Enum):
    TRUNCATED = "truncated"
    BAD_HEADER = "bad header"
    FORMAT_VERSION = "format version"
    SHAPE = "shape"
    DTYPE = "dtype"
    CHECKSUM = "checksum"
    KEY_MISMATCH = "key mismatch"  # the blob names another key or namespace


class EntryError(Exception):
    """A stored blob that must not be used; ``kind`` says why."""

    def __init__(self, kind: EntryErrorKind, detail: str) -> None:
        super().__init__(f"{kind.value}: {detail}")
        self.kind = kind
        self.detail = detail


@dataclass(frozen=True)
class EntryHeader:
    """What the kvblend metadata of a blob claims (validated by :func:`decode`)."""

    format_version: int
    namespace: str
    key: str  # hex
    provenance: str  # canonical JSON of the producing Provenance
    shape: tuple[int, int, int, int]  # (L, Hkv, T, D), same for k and v
    dtype: str  # "float32" | "float16" | "bfloat16"
    sha256: str  # hex, over the other fields' JSON, then k bytes, then v bytes
    tag: str = FORMAT_TAG

    @property
    def tensor_bytes(self) -> int:
        L, H, T, D = self.shape
        return 2 * L * H * T * D * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


def _checksum(meta: EntryHeader, *data: memoryview) -> str:
    """sha256 over the header's claims (all but the checksum) and then the tensor bytes.

    Covering the claims too means a header edited to another shape of the same
    byte count, another provenance or another key fails the check.
    """
    h = hashlib.sha256(replace(meta, sha256="").to_json().encode())
    for d in data:
        h.update(d)
    return h.hexdigest()


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor in memory order, without a copy when contiguous."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.view(torch.uint8).numpy()).cast("B")  # (numel * itemsize,)


def encode_parts(ns: Namespace, key: StoreKey, entry: KVEntry) -> list[memoryview | bytes]:
    """Serialize ``entry`` as [safetensors header, k bytes, v bytes].

    Args:
        ns: namespace the entry is stored in (recorded, checked on decode).
        key: the entry's key (recorded, checked on decode).
        entry: k and v of equal shape (L, Hkv, T, D) and dtype.

    Returns:
        Buffers whose concatenation is the blob; write them in order.
    """
    if entry.k.dtype not in _ST_DTYPES:
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
        sha256="",
    )
    meta = replace(meta, sha256=_checksum(meta, kb, vb))
    st = _ST_DTYPES[entry.k.dtype]
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
    """One contiguous blob (see :func:`encode_parts`)."""
    return b"".join(encode_parts(ns, key, entry))


def header_length(prefix: bytes | bytearray | memoryview) -> int:
    """Bytes taken by the length field plus the JSON header, from the first 8 bytes."""
    if len(prefix) < 8:
        raise EntryError(EntryErrorKind.TRUNCATED, f"{len(prefix)} bytes, no length field")
    (n,) = struct.unpack("<Q", bytes(prefix[:8]))
    if n > MAX_HEADER_BYTES:
        raise EntryError(EntryErrorKind.BAD_HEADER, f"header length {n} exceeds {MAX_HEADER_BYTES}")
    return 8 + n


def decode_header(blob: bytes | bytearray | memoryview) -> tuple[EntryHeader, dict, int]:
    """Parse and check the headers (not the tensor data) of a blob.

    Args:
        blob: at least the first ``header_length`` bytes of a blob.

    Returns:
        (kvblend header, safetensors tensor table, offset of the data section).
    """
    start = header_length(blob)
    if len(blob) < start:
        raise EntryError(EntryErrorKind.TRUNCATED, f"{len(blob)} bytes, header needs {start}")
    try:
        table = json.loads(bytes(blob[8:start]))
        meta = json.loads(table["__metadata__"]["kvblend"])
    except (ValueError, KeyError, TypeError) as e:
        raise EntryError(EntryErrorKind.BAD_HEADER, f"unparsable header ({e!r})") from None
    if not isinstance(meta, dict) or meta.get("tag") != FORMAT_TAG:
        raise EntryError(EntryErrorKind.BAD_HEADER, "not a kvblend entry")
    if meta.get("format_version") != STORE_FORMAT_VERSION:
        raise EntryError(
            EntryErrorKind.FORMAT_VERSION,
            f"format {meta.get('format_version')!r}, this build reads {STORE_FORMAT_VERSION}",
        )
    try:
        hdr = EntryHeader(**{**meta, "shape": tuple(int(s) for s in meta["shape"])})
    except (TypeError, KeyError, ValueError) as e:
        raise EntryError(EntryErrorKind.BAD_HEADER, f"bad kvblend fields ({e!r})") from None
    if len(hdr.shape) != 4 or any(s < 0 for s in hdr.shape):
        raise EntryError(EntryErrorKind.SHAPE, f"shape {hdr.shape} is not (L, Hkv, T, D)")
    tdt = getattr(torch, hdr.dtype, None) if isinstance(hdr.dtype, str) else None
    if tdt not in _ST_DTYPES:
        raise EntryError(EntryErrorKind.DTYPE, f"unsupported dtype {hdr.dtype!r}")
    for name in ("k", "v"):
        info = table.get(name)
        if not isinstance(info, dict):
            raise EntryError(EntryErrorKind.BAD_HEADER, f"no tensor {name!r}")
        if info.get("dtype") != _ST_DTYPES[tdt]:
            raise EntryError(EntryErrorKind.DTYPE, f"{name} is {info.get('dtype')}, header says {hdr.dtype}")
        if tuple(info.get("shape", ())) != hdr.shape:
            raise EntryError(EntryErrorKind.SHAPE, f"{name} is {info.get('shape')}, header says {list(hdr.shape)}")
    return hdr, table, start


def decode(
    blob: bytearray | bytes | memoryview,
    ns: Namespace | None = None,
    key: StoreKey | None = None,
) -> KVEntry:
    """Validate a blob completely and view it as a :class:`KVEntry`.

    Args:
        blob: the whole blob; a ``bytearray`` gives writable zero-copy tensors.
        ns, key: where the blob was found; checked against its header if given.

    Returns:
        The entry (tensors share memory with ``blob``).

    Raises:
        EntryError: truncated, bad header, other format version, shape, dtype,
            checksum or key mismatch.
    """
    hdr, table, start = decode_header(blob)
    if ns is not None and hdr.namespace != ns.value:
        raise EntryError(EntryErrorKind.KEY_MISMATCH, f"namespace {hdr.namespace!r}, found in {ns.value!r}")
    if key is not None and hdr.key != key_hex(key):
        raise EntryError(EntryErrorKind.KEY_MISMATCH, f"blob names key {hdr.key[:16]}..")
    dtype = getattr(torch, hdr.dtype)
    L, H, T, D = hdr.shape
    nbytes = L * H * T * D * torch.empty((), dtype=dtype).element_size()
    offsets = [tuple(table[n]["data_offsets"]) for n in ("k", "v")]
    if offsets != [(0, nbytes), (nbytes, 2 * nbytes)]:
        raise EntryError(EntryErrorKind.SHAPE, f"data offsets {offsets} disagree with shape {list(hdr.shape)}")
    have = len(blob) - start
    if have < 2 * nbytes:
        raise EntryError(EntryErrorKind.TRUNCATED, f"{have} data bytes, shape needs {2 * nbytes}")
    if have > 2 * nbytes:
        raise EntryError(EntryErrorKind.SHAPE, f"{have - 2 * nbytes} trailing bytes after the tensors")
    if _checksum(hdr, memoryview(blob)[start:]) != hdr.sha256:
        raise EntryError(EntryErrorKind.CHECKSUM, "sha256 over the header claims and tensor bytes differs")
    return KVEntry(
        k=_view(blob, start, nbytes, dtype, hdr.shape),  # (L, Hkv, T, D)
        v=_view(blob, start + nbytes, nbytes, dtype, hdr.shape),  # (L, Hkv, T, D)
        provenance=hdr.provenance,
    )


def _view(blob: bytearray | bytes | memoryview, offset: int, nbytes: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    if isinstance(blob, bytes):  # read-only buffer: torch would warn; copy once
        blob = bytearray(memoryview(blob)[offset : offset + nbytes])
        offset = 0
    flat = torch.frombuffer(blob, dtype=torch.uint8, count=nbytes, offset=offset)  # (nbytes,)
    return flat.view(dtype).view(tuple(shape))  # (L, Hkv, T, D)
