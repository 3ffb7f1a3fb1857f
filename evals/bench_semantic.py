"""Semantic (donor) reuse on edited MuSiQue passages: quality vs full prefill, TTFT, donor discovery.

For each question, the original passages' canonical KV is stored and registered
as donors; then every passage of the prompt is edited the same way (word
substitutions at 1/5/10% of words, one sentence inserted, one sentence deleted)
and the edited prompt is answered by:

- ``full``: full prefill of the edited prompt (the reference);
- ``semantic``: blend at ``--ratio`` with donor KV for the edited passages;
- ``fresh``: blend at ``--ratio`` after computing each edited passage canonically
  (what the engine does without the semantic opt-in);
- ``stale``: blend over the *original* passages (the edit ignored) — how much
  the edit matters to the answer at all.

Quality is against full prefill of the edited text: answer agreement, token F1,
first-token KL and top-1 agreement. TTFT is a ratio to full prefill in the same
process, methods interleaved. A second table measures donor discovery (MinHash
over token shingles vs MiniLM cosine) on the same edits against a distractor
pool and passages that have no donor.

    python -m blend.evals.bench_semantic --limit 8 --passages 3
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from blend.defaults import DEFAULT_EVAL_DATA, DEFAULT_MODEL, DEFAULT_RATIO
from blend.evals.data import Document, Item, load_items
from blend.evals.environment import describe_environment
from blend.evals.metrics import answers_agree, best_over, kl_divergence, token_f1, top1_agree
from blend.keys import Namespace, canonical_key
from blend.policy import ReusePolicy
from blend.prompt import document_text, tokenize_segment
from blend.report import ReuseClass
from blend import safeio

VARIANTS = ("sub1", "sub5", "sub10", "insert", "delete")
METHODS = ("full", "semantic", "fresh", "stale")
_SENT = re.compile(r"(?<=[.!?])\s+")


def _sentences(text: str) -> list[str]:
    return [s for s in _SENT.split(text.strip()) if s]


def edit_text(text: str, variant: str, rng: random.Random, vocab: list[str], spare: list[str]) -> str:
    """One edited version of a passage body.

    Args:
        text: the passage body (without title).
        variant: one of :data:`VARIANTS`.
        rng: seeded per (item, passage, variant).
        vocab: replacement words (from other passages).
        spare: sentences from other passages, for insertions.
    """
    if variant.startswith("sub"):
        words = text.split(" ")
        n = max(1, round(int(variant[3:]) / 100 * len(words)))
        for i in rng.sample(range(len(words)), min(n, len(words))):
            new = rng.choice(vocab)
            while new == words[i]:
                new = rng.choice(vocab)
            words[i] = new
        return " ".join(words)
    sents = _sentences(text)
    if variant == "insert":
        at = rng.randrange(len(sents) + 1)
        return " ".join(sents[:at] + [rng.choice(spare)] + sents[at:])
    if variant == "delete":
        if len(sents) < 2:  # one sentence: drop its second half instead
            words = text.split(" ")
            return " ".join(words[: max(1, len(words) // 2)])
        del sents[rng.randrange(len(sents))]
        return " ".join(sents)
    raise ValueError(f"unknown variant {variant!r}")


def edited_item(item: Item, variant: str, seed: int, vocab: list[str], spare: list[str]) -> Item:
    docs = []
    for j, d in enumerate(item.documents):
        rng = random.Random(f"{seed}/{item.id}/{j}/{variant}")  # str seeds are deterministic (sha512)
        docs.append(Document(d.title, edit_text(d.text, variant, rng, vocab, spare)))
    return Item(item.id, item.question, tuple(docs), item.answers)


@dataclass
class Row:
    item: str
    variant: str
    method: str
    answer: str
    ttft_s: float
    agree: float  # answer equal to full prefill's (normalised)
    f1: float  # token F1 against full prefill's answer
    gold_f1: float
    kl: float
    top1: float
    semantic_docs: int  # edited passages served from a donor
    doc_tokens: int
    forced: int  # forced rows (semantic edits) over all documents
    recomputed: int  # document rows recomputed (forced + selected)
    aligned: float  # mean aligned fraction over semantic documents


def _forced_of(note: str) -> tuple[int, float]:
    m = re.search(r"aligned ([0-9.]+) .*forced (\d+)", note)
    return (int(m.group(2)), float(m.group(1))) if m else (0, 0.0)


def run_quality(engine, items: list[Item], args, vocab: list[str], spare: list[str]) -> list[Row]:

    ratio = args.ratio
    policies = {
        "full": ReusePolicy.one_pass(),
        "semantic": ReusePolicy.blend(ratio=ratio, semantic=True),
        "fresh": ReusePolicy.blend(ratio=ratio),
        "stale": ReusePolicy.blend(ratio=ratio),
    }
    rows: list[Row] = []
    for n_item, item in enumerate(items):
        texts = item.document_texts()
        engine.precompute_chunks(texts)
        orig = engine.build_prompt(item.question, texts)
        orig_keys = {canonical_key(engine.provenance, orig.preamble.token_ids, d.token_ids) for d in orig.documents}
        for d in orig.documents:  # the engine hook's job once it lands in precompute_chunks
            engine.segments.register_donor(orig.preamble.token_ids, d.token_ids)
        if n_item == 0:  # warm-up: every method's first call (the donor path's included) out of the timings
            warm = engine.build_prompt(item.question, edited_item(item, VARIANTS[0], args.seed, vocab, spare)
                                       .document_texts())
            warm_keys = {canonical_key(engine.provenance, warm.preamble.token_ids, d.token_ids)
                         for d in warm.documents}
            for m in METHODS:
                engine.generate(orig if m == "stale" else warm, policies[m], max_new_tokens=2)
                for key in warm_keys - orig_keys:  # the timed methods start with no edited KV stored
                    engine.store.delete(Namespace.CANONICAL, key)
        for n_var, variant in enumerate(VARIANTS):
            ed = edited_item(item, variant, args.seed, vocab, spare)
            prompt = engine.build_prompt(item.question, ed.document_texts())
            edited_keys = {canonical_key(engine.provenance, prompt.preamble.token_ids, d.token_ids)
                           for d in prompt.documents}
            order = list(METHODS[1:])
            k = (n_item + n_var) % len(order)
            order = ["full"] + order[k:] + order[:k]  # full first (reference), the rest rotated
            answers = {}
            for m in order:
                p = orig if m == "stale" else prompt
                ans = engine.generate(p, policies[m], max_new_tokens=args.max_new_tokens)
                for key in edited_keys - orig_keys:  # every method starts with no edited KV stored
                    engine.store.delete(Namespace.CANONICAL, key)
                answers[m] = ans
            ref = answers["full"]
            for m in METHODS:
                a = answers[m]
                docs = [s for s in a.report.segments if s.kind.value == "document"]
                sem = [s for s in docs if s.reuse_class is ReuseClass.SEMANTIC]
                fa = [_forced_of(s.note) for s in sem]
                rows.append(Row(
                    item.id, variant, m, a.text, a.ttft_s,
                    answers_agree(a.text, ref.text), token_f1(a.text, ref.text),
                    best_over(token_f1, a.text, item.answers),
                    kl_divergence(ref.first_logits, a.first_logits), top1_agree(ref.first_logits, a.first_logits),
                    len(sem), sum(s.tokens for s in docs), sum(f for f, _ in fa),
                    sum(s.recomputed for s in docs), statistics.mean(x for _, x in fa) if fa else 0.0,
                ))
        print(f"  item {n_item + 1}/{len(items)} done", flush=True)
    return rows


def quality_table(rows: list[Row]) -> str:
    def mean(xs):
        xs = list(xs)
        return sum(xs) / len(xs) if xs else float("nan")

    out = ["| variant | method | agree | F1 vs full | gold F1 | KL | top-1 | TTFT / full | donor docs | "
           "forced rows | recomputed rows | aligned |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ttft_full = {(r.item, r.variant): r.ttft_s for r in rows if r.method == "full"}
    for v in VARIANTS:
        for m in METHODS:
            rs = [r for r in rows if r.variant == v and r.method == m]
            if not rs:
                continue
            # stale answers from the unedited prompt: another length than the full prefill it would divide by
            ratio = "-" if m == "stale" else f"{mean(r.ttft_s / ttft_full[(r.item, r.variant)] for r in rs):.2f}"
            docs = sum(r.doc_tokens for r in rs)
            sem_docs = sum(r.semantic_docs for r in rs)
            donor = f"{sem_docs}" if m == "semantic" else "-"
            forced = f"{sum(r.forced for r in rs) / docs:.1%}" if m == "semantic" else "-"
            rec = f"{sum(r.recomputed for r in rs) / docs:.1%}" if m != "full" else "100%"
            al = mean(r.aligned for r in rs if r.semantic_docs) if m == "semantic" else float("nan")
            out.append(
                f"| {v} | {m} | {mean(r.agree for r in rs):.2f} | {mean(r.f1 for r in rs):.2f} | "
                f"{mean(r.gold_f1 for r in rs):.2f} | {mean(r.kl for r in rs):.3f} | {mean(r.top1 for r in rs):.2f} | "
                f"{ratio} | {donor} | {forced} | {rec} | {'-' if al != al else f'{al:.2f}'} |"
            )
    return "\n".join(out)


# ---- donor discovery ------------------------------------------------------------------------


def _word_grams(text: str, n: int = 8) -> set[tuple[str, ...]]:
    w = text.lower().split()
    return {tuple(w[i:i + n]) for i in range(max(1, len(w) - n + 1))}


def run_discovery(engine, all_items: list[Item], items: list[Item], args, vocab, spare) -> str:
    """MinHash vs MiniLM: does the best-scoring stored passage = the edited passage's original?"""
    from blend.minhash import minhash
    from blend.semantic import MIN_SIMILARITY

    tok = engine.tokenizer
    pool_items = all_items[: args.pool_items]
    pool = list(dict.fromkeys(t for it in pool_items for t in it.document_texts()))  # distinct texts
    for it in items:
        pool.extend(t for t in it.document_texts() if t not in pool)
    # MuSiQue passages here are overlapping windows of the same articles: a passage sharing text with
    # the original is a legitimate (partial) donor, so "wrong" and "no donor" only count passages that
    # share no 8-word run with it / with the whole pool
    grams = [_word_grams(t) for t in pool]
    pool_grams = set().union(*grams)
    negatives = [t for it in all_items[args.pool_items:] for t in it.document_texts()[:3]
                 if not (_word_grams(t) & pool_grams)]
    negatives = list(dict.fromkeys(negatives))[: args.negatives]
    queries = []  # (variant, text, index of the true original in pool or -1)
    for it in items:
        for v in VARIANTS:
            ed = edited_item(it, v, args.seed, vocab, spare)
            for o, e in zip(it.document_texts(), ed.document_texts()):
                queries.append((v, e, pool.index(o)))
    queries += [("no donor", t, -1) for t in negatives]

    t0 = time.perf_counter()
    pool_ids = [tokenize_segment(tok, document_text(t)) for t in pool]
    sig = np.stack([minhash(ids) for ids in pool_ids])  # (P, H)
    t_index = time.perf_counter() - t0
    t0 = time.perf_counter()
    mh = np.stack([(sig == minhash(tokenize_segment(tok, document_text(q)))[None, :]).mean(axis=1)
                   for _, q, _ in queries])  # (Q, P)
    t_query = (time.perf_counter() - t0) / len(queries)
    scores = {"minhash": (mh, MIN_SIMILARITY)}
    timing = {"minhash": (t_index, t_query)}
    if args.embed:
        from blend.retrieval.embedder import Embedder

        emb = Embedder.load()
        t0 = time.perf_counter()
        pe = emb.embed(pool)  # (P, 384) unit norm
        t_index = time.perf_counter() - t0
        t0 = time.perf_counter()
        qe = emb.embed([q for _, q, _ in queries])
        t_query = (time.perf_counter() - t0) / len(queries)
        scores["minilm"] = (qe @ pe.T, args.cos_threshold)
        timing["minilm"] = (t_index, t_query)

    out = [f"pool {len(pool)} passages; {len(negatives)} passages with no donor; "
           f"MinHash threshold {MIN_SIMILARITY}, MiniLM cosine threshold {args.cos_threshold}", "",
           "| finder | queries | top-1 is the original | found (top-1 right and >= threshold) | "
           "unrelated donor >= threshold | sim to original (mean / min) | best unrelated sim (mean / max) |",
           "|---|---|---|---|---|---|---|"]
    for name, (s, thr) in scores.items():
        for v in VARIANTS + ("no donor",):
            idx = [i for i, q in enumerate(queries) if q[0] == v]
            true = np.array([queries[i][2] for i in idx])
            ss = s[idx]  # (n, P)
            top = ss.argmax(axis=1)
            wrong = ss.copy()
            for r, t in enumerate(true):
                if t >= 0:  # mask the original and every passage sharing text with it
                    wrong[r, [p for p in range(len(pool)) if grams[p] & grams[t]]] = -np.inf
            best_wrong = wrong.max(axis=1)
            if v == "no donor":
                out.append(f"| {name} | {v} ({len(idx)}) | - | - | {np.mean(best_wrong >= thr):.0%} | - | "
                           f"{best_wrong.mean():.3f} / {best_wrong.max():.3f} |")
                continue
            st = ss[np.arange(len(idx)), true]
            ok = (top == true)
            out.append(f"| {name} | {v} ({len(idx)}) | {ok.mean():.0%} | {np.mean(ok & (st >= thr)):.0%} | "
                       f"{np.mean(best_wrong >= thr):.0%} | {st.mean():.3f} / {st.min():.3f} | "
                       f"{best_wrong.mean():.3f} / {best_wrong.max():.3f} |")
    out.append("")
    for name, (ti, tq) in timing.items():
        out.append(f"{name}: index {ti:.2f} s for {len(pool)} passages, {tq * 1e3:.2f} ms per query")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--data", default=DEFAULT_EVAL_DATA)
    ap.add_argument("--limit", type=int, default=8, help="questions")
    ap.add_argument("--passages", type=int, default=3, help="passages per question (all edited)")
    ap.add_argument("--ratio", type=float, default=DEFAULT_RATIO)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool-items", type=int, default=30, help="discovery: items whose passages form the pool")
    ap.add_argument("--negatives", type=int, default=60, help="discovery: passages with no donor in the pool")
    ap.add_argument("--cos-threshold", type=float, default=0.9)
    ap.add_argument("--no-embed", dest="embed", action="store_false", help="skip the MiniLM comparison")
    ap.add_argument("--no-quality", dest="quality", action="store_false", help="discovery only")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from blend.engine import Engine

    all_items = load_items(args.data, None, None)
    items = [Item(it.id, it.question, it.documents[: args.passages], it.answers) for it in all_items[: args.limit]]
    words = [w for it in all_items for d in it.documents for w in d.text.split(" ") if w.isalpha()]
    vocab = sorted(set(words))
    spare = [s for it in all_items[-20:] for d in it.documents for s in _sentences(d.text) if 40 < len(s) < 200]
    engine = Engine.load(args.model, quality_gate=False, experimental_semantic=True)
    print(f"model {args.model}, {args.limit} questions x {args.passages} passages (all edited), "
          f"ratio {args.ratio}, torch threads {torch.get_num_threads()}", flush=True)
    result = {"args": vars(args), "threads": torch.get_num_threads(), "environment": describe_environment()}
    if args.quality:
        rows = run_quality(engine, items, args, vocab, spare)
        table = quality_table(rows)
        print("\n" + table, flush=True)
        result["rows"] = [asdict(r) for r in rows]
        result["quality_table"] = table
    disc = run_discovery(engine, all_items, items, args, vocab, spare)
    print("\n" + disc, flush=True)
    result["discovery"] = disc
    if args.json:
        safeio.atomic_write_text(args.json, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
