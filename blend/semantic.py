"""Semantic reuse (experimental): seed a missing chunk's KV from a near-duplicate donor.

Only reached when both the engine (``experimental_semantic``) and the policy
(``semantic=True``) opt in, and only for a document whose own canonical KV
misses. Steps, for the new document N and a donor D (a stored canonical chunk
after the same preamble)::

    discovery   MinHash over SHINGLE-token shingles (blend.minhash, blend.donors): estimated
                Jaccard >= MIN_SIMILARITY, best MAX_CANDIDATES
    alignment   difflib over token ids, donor -> new:

        donor  D:  a b c d e f g h . . .
                   | | |   \\ \\ \\ \\                 equal runs: N[j] <- D[i]
        new    N:  a b c X d e f g h . . .          X inserted (or a replaced run)
        forced:      [ - W .. X .. + W ]             every inserted/replaced token
                                                     +- FORCE_WINDOW around each edit
    accept      aligned fraction (N's tokens copied from D) >= MIN_ALIGNED

The donor's row i sat at canonical position p+i; copied to offset j it must
sit at p+j. K is stored before RoPE and the blend path rotates every row at
its new absolute position, so copying pre-RoPE rows re-positions them. What
copying cannot fix is context: after an edit, the donor's rows were computed
with a different left context, which the forced window and the selector's
deviation-selected rows (counted in the usual budget) recompute.

Nothing here writes to the store: a semantic result never lands in the exact
or canonical namespace, and the edited document is stored canonically only
when some later request computes it in full.
"""

from __future__ import annotations

import difflib
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from blend.defaults import (
    DEFAULT_DONOR_ABSENT_GRACE_S, SEMANTIC_FORCE_WINDOW, SEMANTIC_MAX_CANDIDATES, SEMANTIC_MIN_ALIGNED,
    SEMANTIC_MIN_SIMILARITY,
)
from blend.donor_records import Donor, RecordLog, purge_log, removal_record
from blend.donors import DonorIndex
from blend.keys import Namespace, StoreKey, canonical_key_of, key_hex, provenance_digest, token_digest
from blend.kvcache import KVEntry
from blend.store.base import KVStore, LookupStatus, Presence, presence, store_tiers

FORCE_WINDOW = SEMANTIC_FORCE_WINDOW  # tokens recomputed on each side of every edit (their left context changed most)
MIN_SIMILARITY = SEMANTIC_MIN_SIMILARITY  # estimated shingle Jaccard a donor needs (5-gram shingles)
MIN_ALIGNED = SEMANTIC_MIN_ALIGNED  # share of the new document's rows reused unforced (Alignment.aligned_fraction)
MAX_CANDIDATES = SEMANTIC_MAX_CANDIDATES  # donors aligned per miss (alignment is the costly part)
# token pairs the aligner may compare per missing document, summed over its candidates: sum over token
# ids of (count in donor) x (count in document), what difflib's matcher walks (~100-180 ns each here).
# Ordinary text of 8k tokens is ~0.7M (105 ms); text whose tokens repeat (tables, code, a 3-token period)
# reaches n^2 / 3 (4k tokens: 5.3M, 0.6 s), where a candidate past what is left is skipped and the document
# computed (at this bound ~0.3 s at most)
MAX_ALIGN_PAIRS = 1 << 21


def _has_records(tier: RecordLog, name: str) -> bool:
    """Whether ``tier`` holds a log ``name`` with records (its ``has_records``, a stat or one round trip,
    where it has one; else by reading the log)."""
    has = getattr(tier, "has_records", None)
    return bool(has(name)) if has is not None else bool(tier.read_records(name))


def donor_log_name(provenance_json: str) -> str:
    """The record log of one provenance's donors (its keys only resolve under it).

    Args:
        provenance_json: the provenance's canonical JSON.

    Returns:
        ``donors-`` and the first 16 hex digits of its digest.
    """
    return "donors-" + provenance_digest(provenance_json).hex()[:16]


@dataclass(frozen=True)
class Alignment:
    """How a new document maps onto a donor.

    Attributes:
        src: (M,) int64 donor offsets whose rows are copied ...
        dst: (M,) int64 ... to these new-document offsets.
        forced: (F,) int64 sorted new-document offsets to recompute at every layer.
        edits: number of edit operations (replace / insert / delete runs).
        length: tokens in the new document.
    """

    src: torch.Tensor
    dst: torch.Tensor
    forced: torch.Tensor
    edits: int
    length: int

    @property
    def aligned_fraction(self) -> float:
        """Share of the new document's rows reused as they are: copied from the donor and not forced.

        Short equal runs between nearby edits are copied but forced, so two unrelated
        documents over a common vocabulary (many short chance matches) score near 0.
        """
        if not self.length:
            return 0.0
        kept = torch.ones(self.length, dtype=torch.bool)
        kept[self.forced] = False
        return int(kept[self.dst].sum()) / self.length


def match_pairs(donor_ids: Sequence[int], new_ids: Sequence[int]) -> int:
    """The work of aligning two token lists: sum over token ids of (count in one) x (count in the other),
    the candidate matches difflib's matcher walks (its time follows this, not the lengths' product).

    Args:
        donor_ids: the donor chunk's token ids.
        new_ids: the new chunk's token ids.

    Returns:
        The number of equal-token pairs between the two lists.
    """
    donor_counts = Counter(donor_ids)
    return sum(n * donor_counts[t] for t, n in Counter(new_ids).items())


def align(donor_ids: Sequence[int], new_ids: Sequence[int], window: int = FORCE_WINDOW) -> Alignment:
    """Align a new document to a donor over token ids.

    Args:
        donor_ids: the donor's tokens.
        new_ids: the new document's tokens.
        window: tokens forced on each side of every edit.

    Returns:
        The copy map and the forced offsets (inserted/replaced tokens plus the
        window; a pure deletion forces the window around where it happened).
    """
    n = len(new_ids)
    sm = difflib.SequenceMatcher(None, list(donor_ids), list(new_ids), autojunk=False)
    src, dst = [], []
    forced = torch.zeros(n, dtype=torch.bool)
    edits = 0
    for op, i1, i2, j1, j2 in sm.get_opcodes():
        if op == "equal":
            src.extend(range(i1, i2))
            dst.extend(range(j1, j2))
            continue
        edits += 1  # replace / insert: new tokens j1..j2; delete: j1 == j2, the seam
        forced[max(0, j1 - window): min(n, j2 + window)] = True
    return Alignment(torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long),
                     torch.nonzero(forced).flatten(), edits, n)


@dataclass(frozen=True)
class DonorKV:
    """A missing document's KV seeded from a donor.

    Attributes:
        kv: laid out on the document's own tokens (aligned rows from the donor,
            edited rows zero), K before RoPE.
        forced: (F,) int64 offsets to recompute at every layer; None when the donor
            has the very same tokens (its rows *are* the document's canonical KV).
        note: the donor's key, similarity, aligned fraction and edits (for the report).
    """

    kv: KVEntry
    forced: torch.Tensor | None
    note: str


class Donors:
    """The donor index of one engine's store: a component the segment cache owns.

    Created on first use from the donors the store's persistent tiers recorded
    (disk, Redis), so a new process over the same store finds the same donors.
    Disabled unless the engine enabled ``experimental_semantic``.

    A donor whose KV is gone is forgotten, and its removal logged for every process, only when the
    store is known to lack it (:func:`blend.store.base.presence`): a tier that cannot answer (a Redis
    outage, an unreadable folder) only skips it for this request. Where the index has a log, the
    absence must also last ``absent_grace_s`` from the first look that found it: another process logs
    a registration before its write-behind put reaches the shared tiers.

    Args:
        store: the engine's store (canonical entries live there).
        provenance_json: the engine's provenance (selects the record log).
        enabled: the engine's experimental flag.
    """

    def __init__(self, store: KVStore, provenance_json: str, enabled: bool,
                 absent_grace_s: float = DEFAULT_DONOR_ABSENT_GRACE_S) -> None:
        self.store, self.provenance_json, self.enabled = store, provenance_json, enabled
        self.absent_grace_s = absent_grace_s
        self._absent_since: dict[bytes, float] = {}  # donor key -> when its KV was first found absent (monotonic)
        self._absent_lock = threading.Lock()
        self._prov_digest = provenance_digest(provenance_json)  # what canonical keys are derived under
        self.log_name = donor_log_name(provenance_json)
        self._index: DonorIndex | None = None
        self._first_use = threading.Lock()

    @property
    def index(self) -> DonorIndex:
        """The index, attached to the record log on first use (by one thread: another request's
        first use waits for it, and never sees an index that would not yet log its registrations)."""
        if self._index is None:
            with self._first_use:
                if self._index is None:
                    index = DonorIndex()
                    if self.enabled:
                        # the log attaches to the chain's persistent tiers
                        index.attach_log(store_tiers(self.store), self.log_name, self._is_canonical)
                    self._index = index
        return self._index

    def _is_canonical(self, donor: Donor) -> bool:
        """Whether a recorded donor's key is this engine's canonical key of its preamble and tokens (donors
        are unsalted: semantic reuse refuses a cache salt)."""
        return donor.key == canonical_key_of(self._prov_digest, donor.preamble, token_digest(donor.token_ids))

    def use_index(self, index: DonorIndex) -> None:
        """Replace the index (e.g. :meth:`DonorIndex.load` of one saved beside a disk store). Its rows
        are untrusted: :meth:`donor_kv` uses a donor only where its key is this engine's canonical key
        of the donor's own preamble and tokens, and drops any other.

        On an engine with semantic reuse the index is attached to the store's donor log as the first use's
        is (its donors are added): this engine's registrations and removals (a deleted document's) keep
        reaching the log, where other processes read them."""
        if self.enabled:
            index.attach_log(store_tiers(self.store), self.log_name, self._is_canonical)
        with self._first_use:
            self._index = index

    def register(self, key: StoreKey, preamble_ids: Sequence[int], doc_ids: Sequence[int]) -> bool:
        """Offer a stored canonical chunk as a donor (call after it is stored or found).

        Returns:
            True if it was newly registered (always False when disabled).
        """
        return self.enabled and self.index.add(key, preamble_ids, doc_ids)

    def forget(self, key: StoreKey) -> bool:
        """Stop offering a chunk as a donor (its KV was deleted on purpose, e.g. its document was).

        On an engine without semantic reuse (``kvblend ingest`` deleting a file's chunks) nothing is
        loaded: a removal record still goes to the persistent tiers' donor log where one exists (looked
        for at each call: a log another process created since counts), so the processes that do enable
        semantic reuse stop offering the chunk too.

        Returns:
            True if it was registered in this process's memory (on an engine with semantic reuse the removal
            record is appended to the log either way).
        """
        if self.enabled:  # recorded even where this process does not hold it (another registered it since
            # this one read the log, or memory's cap dropped it): the log must not keep it live
            return self.index.remove(key, record_absent=True)
        for tier in self._log_tiers():
            if _has_records(tier, self.log_name):  # a stat or one round trip: never a read of the log
                tier.append_record(self.log_name, removal_record(key))
        return False

    def purge_logs(self) -> bool:
        """Rewrite the persistent tiers' donor logs without the donors forgotten so far (after a batch of
        :meth:`forget` calls: an ingest that deleted documents). Until then a removed chunk's tokens stay
        readable in the log, under a removal record.

        Returns:
            True if every log that exists was rewritten (or needed nothing).
        """
        # (a registration appended meanwhile, here or by another process, fails the rewrite's compare-and-swap,
        # and the purge reads the log again; an empty or absent log needs nothing)
        return all([purge_log(t, self.log_name) for t in self._log_tiers()])

    def _log_tiers(self) -> list[RecordLog]:
        """The store's tiers that keep record logs (the persistent ones)."""
        return [t for t in store_tiers(self.store) if isinstance(t, RecordLog)]

    def _kv_present(self, key: StoreKey) -> bool:
        """Whether a donor's KV is in the store; one known to be absent is forgotten (:meth:`_absent`).

        Returns:
            True only if some tier holds it (False too where a tier could not answer: skipped, not forgotten).
        """
        state = presence(self.store, Namespace.CANONICAL, key)
        if state is Presence.ABSENT:
            self._absent(key)
        elif state is Presence.PRESENT:
            with self._absent_lock:
                self._absent_since.pop(bytes(key), None)
        return state is Presence.PRESENT

    def _absent(self, key: StoreKey) -> None:
        """A donor whose KV the store definitely lacks: forgotten here and in the log once the absence has
        lasted :attr:`absent_grace_s` (at once where the index has no log: no other process reads it)."""
        now = time.monotonic()
        with self._absent_lock:
            first = self._absent_since.setdefault(bytes(key), now)
            if len(self._absent_since) > 2 * self.index.max_donors:  # donors that left memory since
                self._absent_since = {k: t for k, t in self._absent_since.items() if StoreKey(k) in self.index}
            gone = now - first >= self.absent_grace_s or not self.index.logged
            if gone:
                self._absent_since.pop(bytes(key), None)
        if gone:
            self.index.remove(key)

    def donor_kv(self, preamble_ids: Sequence[int], doc_ids: Sequence[int], own_key: StoreKey,
                 unusable: Callable[[KVEntry], str] | None = None) -> DonorKV | None:
        """KV for a document whose canonical entry missed, seeded from the best donor.

        Args:
            preamble_ids: the request's preamble (selects the donors).
            doc_ids: the missing document's tokens.
            own_key: its canonical key (a donor registered under it is not a donor of itself).
            unusable: why a donor's stored entry cannot be this model's KV ('' if it can; e.g.
                :meth:`blend.segments.SegmentCache.shape_problem`): such a donor is dropped from the
                index like an evicted one, and the next candidate is tried.

        Returns:
            The seeded KV, or None when no donor passes :data:`MIN_SIMILARITY` and
            :data:`MIN_ALIGNED`, or when the engine did not enable semantic reuse (the
            caller computes the document).
        """
        if not self.enabled:  # the engine's opt-in, whatever index was handed in (use_index)
            return None
        scored, pre, cells_left = [], token_digest(preamble_ids), MAX_ALIGN_PAIRS
        for donor, sim in self.index.candidates(preamble_ids, doc_ids, MIN_SIMILARITY, top=MAX_CANDIDATES + 1):
            if donor.key == own_key:  # registered but its KV is gone: not a donor of itself
                continue
            if donor.preamble != pre or not self._is_canonical(donor):
                # an index handed in (use_index: a saved file is untrusted input) is checked here as the
                # log is on replay: a row whose key is not the canonical key of its own preamble and
                # tokens would lend another chunk's KV under this document's name
                self.index.remove(donor.key)
                continue
            cells = match_pairs(donor.token_ids, doc_ids)
            if cells > cells_left:  # aligning it could cost more than computing the document
                continue
            if not self._kv_present(donor.key):  # evicted (or not known to be there): never aligned for nothing
                continue
            cells_left -= cells
            a = align(donor.token_ids, doc_ids)
            if a.aligned_fraction >= MIN_ALIGNED:
                scored.append((a.aligned_fraction, sim, donor, a))
        scored.sort(key=lambda s: (-s[0], -s[1]))  # stable: best aligned, then most similar
        for frac, sim, donor, a in scored[:MAX_CANDIDATES]:
            found = self.store.get(Namespace.CANONICAL, donor.key, self.provenance_json)
            if found.status is LookupStatus.MISS:  # deleted since, or a tier that failed to answer
                self._kv_present(donor.key)
                continue
            if (found.status is not LookupStatus.HIT or found.entry.num_tokens != len(donor.token_ids)
                    or (unusable is not None and unusable(found.entry))):
                self.index.remove(donor.key)  # stored but unusable: stop offering it
                continue
            dk, dv = found.entry.k, found.entry.v  # (L, Hkv, Td, D)
            shape = (dk.shape[0], dk.shape[1], len(doc_ids), dk.shape[3])
            k = torch.zeros(shape, dtype=dk.dtype)  # (L, Hkv, T, D) before RoPE
            v = torch.zeros(shape, dtype=dv.dtype)
            k[:, :, a.dst] = dk[:, :, a.src]
            v[:, :, a.dst] = dv[:, :, a.src]
            note = (f"donor {key_hex(donor.key)} similarity {sim:.3f} aligned {frac:.3f} "
                    f"edits {a.edits} forced {a.forced.numel()}")
            # (a verified donor never has this document's own tokens: it would have its own key)
            return DonorKV(KVEntry(k, v), a.forced, note)
        return None
