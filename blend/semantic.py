"""Semantic reuse (experimental): seed a missing chunk's KV from a near-duplicate donor.

Only reached when both the engine (``experimental_semantic``) and the policy
(``semantic=True``) opt in, and only for a document whose own canonical KV
misses. Steps, for the new document N and a donor D (a stored canonical chunk
after the same preamble)::

    discovery   MinHash over SHINGLE-token shingles (blend.donors): estimated
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
import hashlib
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from blend.donors import DonorIndex
from blend.keys import Namespace, StoreKey, canonical_key, key_hex
from blend.prompt import Prompt, Segment
from blend.report import ReuseClass, ReuseReport, SegmentReport
from blend.runner import SegmentKV
from blend.store.base import LookupStatus

if TYPE_CHECKING:
    from blend.blending import ChunkKV
    from blend.engine import Engine

FORCE_WINDOW = 4  # tokens recomputed on each side of every edit (their left context changed most)
MIN_SIMILARITY = 0.3  # estimated shingle Jaccard a donor needs to be considered (5-gram shingles)
MIN_ALIGNED = 0.5  # share of the new document's rows reused unforced (Alignment.aligned_fraction)
MAX_CANDIDATES = 4  # donors aligned per miss (alignment is the costly part)

_INDEXES: "weakref.WeakKeyDictionary[Engine, DonorIndex]" = weakref.WeakKeyDictionary()


def donor_log_name(engine: "Engine") -> str:
    """The record log of this engine's donors: one per provenance (its keys only resolve under it)."""
    return "donors-" + hashlib.sha256(engine.provenance_json.encode()).hexdigest()[:16]


def donor_index(engine: "Engine") -> DonorIndex:
    """The engine's donor index, created on first use from the donors its store's
    persistent tiers recorded (disk, Redis); lives as long as the engine."""
    idx = _INDEXES.get(engine)
    if idx is None:
        idx = _INDEXES[engine] = DonorIndex()
        tiers = getattr(engine.store, "tiers", [engine.store])
        idx.attach_log(tiers, donor_log_name(engine))
    return idx


def set_donor_index(engine: "Engine", index: DonorIndex) -> None:
    """Attach an index (e.g. :meth:`DonorIndex.load` of one saved beside a disk store)."""
    _INDEXES[engine] = index


def register_donor(engine: "Engine", preamble_ids: Sequence[int], doc_ids: Sequence[int],
                   key: StoreKey | None = None) -> bool:
    """Make a stored canonical chunk available as a donor.

    Call it after the chunk's canonical KV is stored (or found). A no-op unless
    the engine enabled ``experimental_semantic``.

    Args:
        engine: the engine whose store holds the chunk.
        preamble_ids: the preamble it was computed after.
        doc_ids: its token ids.
        key: its canonical key (computed if omitted).

    Returns:
        True if it was newly registered.
    """
    if not engine.config.experimental_semantic:
        return False
    key = key if key is not None else canonical_key(engine.provenance, preamble_ids, doc_ids)
    return donor_index(engine).add(key, preamble_ids, doc_ids)


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


def donor_chunk(engine: "Engine", prompt: Prompt, doc: Segment, rep: SegmentReport,
                report: ReuseReport) -> "ChunkKV | None":
    """KV for a document whose canonical entry missed, seeded from the best donor.

    Args:
        engine: the engine (store, provenance, donor index).
        prompt: the request (its preamble selects the donors).
        doc: the missing document.
        rep: its report row; set to ``semantic`` with the donor on success.
        report: the request's report (donor search and load time go to ``lookup_s``).

    Returns:
        The document's KV laid out on its own tokens (aligned rows from the donor,
        edited rows zero) with the rows to recompute, or None when no donor passes
        :data:`MIN_SIMILARITY` and :data:`MIN_ALIGNED` (the caller computes it).
    """
    from blend.blending import ChunkKV

    t0 = time.perf_counter()
    try:
        idx = donor_index(engine)
        own = canonical_key(engine.provenance, prompt.preamble.token_ids, doc.token_ids)
        scored = []
        for donor, sim in idx.candidates(prompt.preamble.token_ids, doc.token_ids, MIN_SIMILARITY,
                                         top=MAX_CANDIDATES + 1):
            if donor.key == own:  # registered but its KV is gone: not a donor of itself
                continue
            a = align(donor.token_ids, doc.token_ids)
            if a.aligned_fraction >= MIN_ALIGNED:
                scored.append((a.aligned_fraction, sim, donor, a))
        scored.sort(key=lambda s: (-s[0], -s[1]))  # stable: best aligned, then most similar
        prov_json = engine.provenance_json
        for frac, sim, donor, a in scored[:MAX_CANDIDATES]:
            found = engine.store.get(Namespace.CANONICAL, donor.key, prov_json)
            if found.status is not LookupStatus.HIT or found.entry.num_tokens != len(donor.token_ids):
                idx.remove(donor.key)  # evicted or unusable: stop offering it
                continue
            dk, dv = found.entry.k, found.entry.v  # (L, Hkv, Td, D)
            shape = (dk.shape[0], dk.shape[1], len(doc), dk.shape[3])
            k = torch.zeros(shape, dtype=dk.dtype)  # (L, Hkv, T, D) before RoPE
            v = torch.zeros(shape, dtype=dv.dtype)
            k[:, :, a.dst] = dk[:, :, a.src]
            v[:, :, a.dst] = dv[:, :, a.src]
            rep.reuse_class = ReuseClass.SEMANTIC
            rep.note = (f"donor {key_hex(donor.key)} similarity {sim:.3f} aligned {frac:.3f} "
                        f"edits {a.edits} forced {a.forced.numel()}")
            # identical tokens after the same preamble: the donor rows *are* this document's
            # canonical KV, so nothing is forced and it is treated like its own entry
            forced = None if a.edits == 0 and len(donor.token_ids) == len(doc) else a.forced
            return ChunkKV(kv=SegmentKV(k, v), report=rep, forced=forced)
        return None
    finally:
        report.timings.lookup_s += time.perf_counter() - t0
