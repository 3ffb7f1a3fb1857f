"""Donor index: which stored canonical chunks are near-duplicates of a new one.

The store holds KV, not token ids, so semantic reuse keeps its own small
index of the canonical chunks it may borrow from. Each entry records the
chunk's canonical store key, the digest of the preamble it was computed after,
its token ids and a MinHash signature of its token shingles (:mod:`blend.minhash`)::

    token ids   t0 t1 t2 t3 t4 t5 t6 ...
    shingles    [t0..t4] [t1..t5] [t2..t6] ...      (SHINGLE consecutive ids)
    shingle h   s_j = mix(poly(ids))                  uint64, one per shingle
    signature   sig_i = min_j mix(s_j ^ seed_i)        i = 0..NUM_HASHES-1

``mean(sig_a == sig_b)`` estimates the Jaccard similarity of two chunks'
shingle sets. Every hash is a fixed splitmix64 mix over numpy uint64 (never
Python ``hash()``), so signatures are equal across processes and machines and
the index can be saved and reloaded.

Persistence: registrations are appended, one JSON line each, to a record
log kept by the persistent store tiers (a file beside a disk store, a list in
Redis; see :func:`attach_log`), so a later process over the same store finds
the same donors. Forgetting a donor (its KV was evicted) appends a removal
record, so the next process does not offer it again; a later registration of
the same key brings it back. Records are replayed in order; a log whose lines
are mostly dead, or that holds more than the ``max_donors`` most recent donors
(or :data:`~blend.donor_records.LOG_KEEP_BYTES` of them), is compacted to those when a process
attaches to it and as it grows, by lines and by bytes appended (compare-and-swap, so a concurrent append is
never lost): donors whose KV a byte budget evicted would otherwise stay for
ever, until the log passed the size a tier reads at all. Replay computes
signatures only for the donors it keeps. A torn or corrupt
line is skipped; a donor whose KV is gone from the store is skipped at lookup
time like any miss.

Lookups are a vectorised scan over the signatures of the chunks that share the
request's preamble (a few microseconds per thousand chunks); banded LSH would
replace the scan at millions of chunks.

Records, their parsing (untrusted bytes: :func:`~blend.donor_records.parse_record` raises only
:class:`~blend.donor_records.DonorRecordError`) and replay live in :mod:`blend.donor_records`; this module
holds the in-memory index, which appends to the logs and compacts them.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from blend import safeio
from blend.defaults import DEFAULT_MAX_DONOR_TOKENS, DEFAULT_MAX_DONORS
from blend.donor_records import (
    CompactableLog, Donor, DonorRecordError, RecordLog, donor_row, encode_record, newest_registrations,
    parse_saved_index, removal_row, replay_records, saved_index_max_bytes,
)
from blend.keys import StoreKey, token_digest
from blend.minhash import NUM_HASHES, SHINGLE, minhash

log = logging.getLogger(__name__)

COMPACT_MIN_LINES = 64  # a log is compacted at attach when it has this many lines and over half are dead
# a growing log is compacted once this process appended this many bytes to it, whatever the count of lines: a
# compaction leaves at most LOG_KEEP_BYTES, so the log stays well under what a tier reads at all (MAX_LOG_BYTES)
COMPACT_APPEND_BYTES = 32 << 20


class DonorIndex:
    """Near-duplicate search over registered canonical chunks, per preamble.

    Memory holds at most ``max_donors`` donors and ``max_tokens`` of their tokens, the most recently
    registered (the log keeps the others).

    Thread-safe: a serving engine's requests (prefill workers, the decode loop) register, look up
    and forget donors at once. One lock covers the index and its log appends, so a lookup never
    pairs one donor list with another list's signatures and the log's order is the index's.
    """

    def __init__(self, max_donors: int = DEFAULT_MAX_DONORS, max_tokens: int = DEFAULT_MAX_DONOR_TOKENS) -> None:
        if max_donors < 1 or max_tokens < 1:
            raise ValueError(f"max_donors and max_tokens must be >= 1, got {max_donors} and {max_tokens}")
        self.max_donors = max_donors  # held in memory; past it the oldest registration leaves (not the log)
        self.max_tokens = max_tokens  # their tokens held in memory, likewise (the newest donor always stays)
        self._tokens = 0  # tokens of the donors held
        self._by_pre: dict[bytes, list[Donor]] = {}
        self._keys: set[bytes] = set()
        self._order: OrderedDict[bytes, tuple[bytes, int]] = OrderedDict()  # key -> (preamble, tokens), oldest first
        self._matrix: dict[bytes, np.ndarray] = {}  # (N, H) signatures, rebuilt after changes
        self._logs: list[RecordLog] = []  # where new registrations are appended
        self._log_name = ""
        self._verify: Callable[[Donor], bool] | None = None
        self._appended = 0  # lines this index appended since the logs were last read whole
        self._appended_bytes = 0  # and their bytes
        self._lock = threading.RLock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)

    @property
    def logged(self) -> bool:
        """Whether the index appends to a persistent tier's log (other processes read what it records)."""
        with self._lock:
            return bool(self._logs)

    def __contains__(self, key: StoreKey) -> bool:
        with self._lock:
            return bytes(key) in self._keys

    def add(self, key: StoreKey, preamble_ids: Sequence[int], token_ids: Sequence[int]) -> bool:
        """Register a canonical chunk; returns False if its key is already registered."""
        if key in self:  # the common case (every hit offers its chunk again): no signature to compute
            return False
        pre = token_digest(preamble_ids)
        donor = Donor(StoreKey(bytes(key)), pre, tuple(int(t) for t in token_ids), minhash(token_ids))
        with self._lock:
            if bytes(key) in self._keys:
                return False
            self._insert(donor)
            self._append(donor_row(donor))
        return True

    def _append(self, row: dict) -> None:
        line = encode_record(row)
        for sink in self._logs:
            sink.append_record(self._log_name, line)
        self._appended += 1
        self._appended_bytes += len(line) + 1
        if self._logs and (self._appended >= max(COMPACT_MIN_LINES, len(self._keys))
                           or self._appended_bytes >= COMPACT_APPEND_BYTES):
            # a long-running process: compact as the log grows, not only when a process attaches (a log
            # past MAX_LOG_BYTES is not read at all, and a new process would start with no donors); by bytes
            # too: 16,384 lines of 2k-token donors passed that cap before the count called a compaction
            self._appended = self._appended_bytes = 0
            for sink in self._logs:
                self._compact(sink, sink.read_records(self._log_name), donors=False)

    def _compact(self, sink: RecordLog, lines: list[bytes], donors: bool = True) -> list[Donor]:
        """Rewrite ``sink``'s log to one line per live donor, the ``max_donors`` most recent within
        :data:`~blend.donor_records.LOG_KEEP_BYTES`, if over half its lines are dead or it holds more than
        those (and nobody appended since ``lines`` were read).

        Returns:
            The donors kept (verified), signatures computed; none with ``donors=False`` (a periodic
            compaction: only the log is rewritten, from the records as they are).
        """
        live, bad = replay_records(lines)
        kept = newest_registrations(live, self.max_donors)
        trimmed = len(kept) < len(live)
        out: list[Donor] = []
        if donors:
            out = [r.donor() for r in kept]  # signatures only for the donors kept
            if self._verify is not None:
                ok = [d for d in out if self._verify(d)]
                bad, out = bad + len(out) - len(ok), ok
            if bad:
                log.warning("donor log %s: skipped %d unreadable line(s)", self._log_name, bad)
        if isinstance(sink, CompactableLog) and (trimmed or (len(lines) >= COMPACT_MIN_LINES
                                                             and len(lines) > 2 * len(kept))):
            rows = [encode_record(donor_row(d)) for d in out] if donors else [r.record() for r in kept]
            if sink.rewrite_records(self._log_name, lines, rows):
                log.info("donor log %s: compacted %d lines to %d", self._log_name, len(lines), len(rows))
        return out

    def _insert(self, donor: Donor) -> None:
        self._by_pre.setdefault(donor.preamble, []).append(donor)
        self._keys.add(bytes(donor.key))
        self._order[bytes(donor.key)] = (donor.preamble, len(donor.token_ids))
        self._tokens += len(donor.token_ids)
        self._matrix.pop(donor.preamble, None)
        # the oldest registration leaves memory (the log keeps it)
        while len(self._order) > self.max_donors or (self._tokens > self.max_tokens and len(self._order) > 1):
            old = next(iter(self._order))
            self._drop(old, self._order[old][0])

    def _drop(self, key: bytes, pre: bytes) -> None:
        """Forget ``key`` (registered under preamble ``pre``) in memory only."""
        self._keys.discard(key)
        _, tokens = self._order.pop(key, (b"", 0))
        self._tokens -= tokens
        kept = [d for d in self._by_pre.get(pre, []) if bytes(d.key) != key]
        if kept:
            self._by_pre[pre] = kept
        else:
            self._by_pre.pop(pre, None)
        self._matrix.pop(pre, None)

    def attach_log(self, tiers: Sequence[object], name: str, verify: Callable[[Donor], bool] | None = None) -> int:
        """Load the donors recorded by the persistent ``tiers`` and record new ones there.

        A log with many dead lines (removed or repeated donors) is compacted on the
        way: rewritten to one line per live donor, if no other process appended to
        it since it was read (see :class:`CompactableLog`).

        Args:
            tiers: store tiers; those implementing :class:`RecordLog` are used.
            name: the log's name (one per model provenance: keys are provenance-bound).
            verify: whether a recorded donor's key is the canonical key of its preamble and tokens (None: not
                checked). A line edited into another valid record would otherwise lend the KV stored under its
                key to documents that match its (other) tokens; such a donor is skipped like a corrupt line.

        Returns:
            Donors loaded: registrations replayed in order, a removal record cancelling
            the registrations before it; keys already registered, torn or corrupt lines
            are skipped.
        """
        with self._lock:
            return self._attach(tiers, name, verify)

    def _attach(self, tiers: Sequence[object], name: str, verify: Callable[[Donor], bool] | None) -> int:
        """:meth:`attach_log` with the lock held."""
        self._logs = [t for t in tiers if isinstance(t, RecordLog)]
        self._log_name, self._verify = name, verify
        loaded: list[bytes] = []
        for sink in self._logs:
            for donor in self._compact(sink, sink.read_records(name)):
                if bytes(donor.key) not in self._keys:
                    self._insert(donor)
                    loaded.append(bytes(donor.key))
        return sum(k in self._keys for k in loaded)  # past max_donors the oldest left memory again

    def remove(self, key: StoreKey, record_absent: bool = False) -> bool:
        """Forget a chunk (e.g. its KV was evicted from the store), here and in the attached logs.

        Args:
            key: its canonical key.
            record_absent: append the removal record even where ``key`` is not in memory (a deletion on
                purpose: another process may have registered it since this one read the log, or memory's
                cap dropped it while the log keeps it).

        Returns:
            Whether it was registered in memory.
        """
        with self._lock:
            present = bytes(key) in self._keys
            if present:
                self._drop(bytes(key), self._order[bytes(key)][0])
            if present or record_absent:
                self._append(removal_row(key))
            return present

    def candidates(self, preamble_ids: Sequence[int], token_ids: Sequence[int], min_similarity: float,
                   top: int = 4) -> list[tuple[Donor, float]]:
        """Registered chunks after the same preamble, most similar first.

        Args:
            preamble_ids: the request's preamble (donors must share it).
            token_ids: the new chunk's token ids.
            min_similarity: estimated Jaccard similarity a donor must reach.
            top: at most this many.

        Returns:
            (donor, estimated similarity) pairs, similarity descending, ties by registration order.
        """
        pre = token_digest(preamble_ids)
        with self._lock:
            if not self._by_pre.get(pre):  # no donor under this preamble: no signature to compute
                return []
        sig = minhash(token_ids)  # (H,) outside the lock
        with self._lock:  # the donor list and its signature matrix, as one consistent pair
            donors = self._by_pre.get(pre)
            if not donors:
                return []
            mat = self._matrix.get(pre)
            if mat is None:
                mat = self._matrix[pre] = np.stack([d.signature for d in donors])  # (N, H)
            sims = (mat == sig[None, :]).mean(axis=1)  # (N,)
            order = np.argsort(-sims, kind="stable")[:top]
            return [(donors[i], float(sims[i])) for i in order if sims[i] >= min_similarity]

    # ---- persistence --------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write the index as JSON (atomic: temp file + rename)."""
        with self._lock:
            rows = [donor_row(d) for donors in self._by_pre.values() for d in donors]
        # a private temp file per save (concurrent saves never share one), fsynced, then renamed
        safeio.atomic_write_text(path, json.dumps({"shingle": SHINGLE, "num_hashes": NUM_HASHES, "donors": rows}))

    @classmethod
    def load(cls, path: str | Path, max_donors: int = DEFAULT_MAX_DONORS,
             max_tokens: int = DEFAULT_MAX_DONOR_TOKENS) -> "DonorIndex":
        """Read an index written by :meth:`save` (signatures are recomputed, so always consistent).

        Args:
            path: the saved file.
            max_donors: the index's donor cap: a file of more donors is refused.
            max_tokens: its token cap, likewise (a file larger than such an index's bytes is not read at all,
                and parsing stops at the first row past a cap, before any signature is computed).

        Raises:
            DonorRecordError: naming ``path``: unreadable, not a saved index, a bad donor row, or more donors or
                tokens than the caps.
        """
        try:
            data = safeio.read_regular(path, saved_index_max_bytes(max_donors, max_tokens), follow_symlinks=True)
            regs = parse_saved_index(data.decode(), max_donors, max_tokens)
        except (OSError, UnicodeDecodeError) as e:  # safeio.UnsafeFileError (FileTooLargeError) is an OSError
            raise DonorRecordError(f"{path}: unreadable donor index ({type(e).__name__}: {str(e)[:80]})") from None
        except DonorRecordError as e:
            raise DonorRecordError(f"{path}: {e}") from None
        idx = cls(max_donors, max_tokens)
        for reg in regs:
            if reg.key not in idx._keys:
                idx._insert(reg.donor())
        return idx
