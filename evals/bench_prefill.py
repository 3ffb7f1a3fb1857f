"""Foundation benchmarks (issue 2), measured in one process on the same inputs.

1. Prefill time of the engine's own forward against transformers' forward on
   the same tokens, at 1k and 4k tokens, fp32 and bf16 (target ratio <= 1.10).
2. TTFT of an exact hit (a ~3.5k-token cached prefix plus a ~100-token
   question) against a one-pass full prefill of the same prompt (since 2026-12-07;
   before, against the same request cold, the slower segment schedule), and of the
   request after it, whose prefix is hot (attached, not loaded: blend.prefix_cache).
   ``rag-hit``: the same for musique prompts (6 passages, ~3.6k tokens, their own
   ~20-token questions), the shape a RAG pipeline that repeats a retrieval sends.
3. Exact reuse on reordered documents after ingest (musique prompts, chunks
   precomputed, each request in a new document order): only the preamble is an
   identical prefix (what a prefix cache gets, ``exact(prefix_limit=1)``), but
   the first document sits at its canonical position, so the default exact
   mode loads it too. TTFT of both against full prefill, interleaved.
4. A conversation's third turn (musique prompts, documents ingested): turn 1
   asks the item's question over its documents, turn 2 a follow-up, each
   answered under exact reuse (which stores their turns); turn 3 asks another
   follow-up. Over the same documents its preamble, documents and both earlier
   turns are an exact hit (``exact``; bit-identical to its full prefill, checked),
   against the same with the question segment computed whole (documents only,
   as before turns were stored); over the documents in another order they are
   blended (the default ratio, KL to that prompt's full prefill). TTFT of each
   against the third turn's full prefill, interleaved.

Repeats are interleaved (engine, transformers, engine, ...) so machine drift
hits both alike; the median is reported.

    python -m blend.evals.bench_prefill [--model smollm2-135m] [--repeats 3] [--cases prefill,hit,rag-hit,first-doc,follow-up]
        [--json OUT] [--profile ROWS]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from blend.defaults import DEFAULT_EVAL_DATA, DEFAULT_MODEL, DEFAULT_RATIO
from blend.engine import Engine
from blend.evals.data import load_item_range
from blend.evals.environment import describe_environment
from blend.evals.follow_up import bench_follow_up
from blend.evals.splits import item_range_arg, parse_item_range
from blend.policy import ReusePolicy
from blend.prompt import Prompt
from blend.report import ReuseClass
from blend.store.memory import MemoryStore
from blend import safeio


@dataclass(frozen=True)
class PrefillRow:
    dtype: str
    tokens: int
    engine_s: float
    transformers_s: float

    @property
    def ratio(self) -> float:
        return self.engine_s / self.transformers_s


@dataclass(frozen=True)
class HitRow:
    prompt_tokens: int
    cached_tokens: int
    cold_s: float
    warm_s: float  # the first warm request: every segment loaded from the store
    hot_s: float = 0.0  # the next one: the prefix found stored again is attached (blend.prefix_cache)
    warm_ratios: tuple[float, ...] = ()  # each repeat's warm / its one-pass full prefill
    hot_ratios: tuple[float, ...] = ()
    full_s: float = 0.0  # the one-pass full prefill (the ratios' reference; cold is the exact path's schedule)

    @property
    def ratio(self) -> float:
        """Median over repeats of warm / the same repeat's cold (as ``rag-hit``); medians' ratio without them."""
        return statistics.median(self.warm_ratios) if self.warm_ratios else self.warm_s / self.cold_s

    @property
    def hot_ratio(self) -> float:
        return statistics.median(self.hot_ratios) if self.hot_ratios else self.hot_s / self.cold_s


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_prefill(model: str, dtype: str, tokens: int, repeats: int) -> PrefillRow:
    """Median prefill seconds of the engine and of transformers on the same ids."""
    eng = Engine.load(model, dtype=dtype, quality_gate=False)
    hf = eng.runner.loaded.model.to(eng.dtype)
    ids = torch.randint(100, eng.dims.vocab - 100, (tokens,), generator=torch.Generator().manual_seed(0))

    def ours():
        h, _ = eng.runner.prefill(eng.runner.new_cache(tokens), ids, keep_kv=False)
        eng.runner.logits(h[-1:])

    def theirs():
        hf(ids[None], use_cache=False, logits_to_keep=1)

    e, t = [], []
    with torch.inference_mode():
        ours(), theirs()  # warm-up
        for _ in range(repeats):
            e.append(_timed(ours))
            t.append(_timed(theirs))
    hf.to(torch.float32)
    return PrefillRow(dtype, tokens, statistics.median(e), statistics.median(t))


def _filler(i: int) -> str:
    return (f"Section {i}. The committee met on a grey morning to review the annual report on roads, "
            "bridges and the harbour wall. Members noted that repairs had run over budget, that the "
            "ferry timetable would change in spring, and that the library roof still leaked. ") * 3


def _cold_warm_hot(eng: Engine, prompt: Prompt) -> tuple[float, float, float, float]:
    """TTFTs of one prompt: a one-pass full prefill (the ratios' reference), then under exact reuse in a
    fresh store: cold (computed segment by segment and stored), warm (every segment loaded) and hot (the
    prefix found stored again is attached).

    Raises:
        RuntimeError: the warm or hot request did not reuse every segment before the question, or its
            first-token logits differ from cold's in any bit.
    """
    full = eng.generate(prompt, ReusePolicy.one_pass(), max_new_tokens=1).ttft_s
    fresh = eng.with_store(MemoryStore())
    try:
        answers = [fresh.generate(prompt, ReusePolicy.exact(), max_new_tokens=1) for _ in range(3)]
    finally:
        fresh.close()
    for name, a in zip(("warm", "hot"), answers[1:]):
        if any(r.reuse_class is not ReuseClass.EXACT for r in a.report.segments[:-1]):
            raise RuntimeError(f"the {name} request was not an exact hit")
        if not torch.equal(a.first_logits, answers[0].first_logits):
            raise RuntimeError(f"the {name} request's first-token logits differ from cold's")
    return full, answers[0].ttft_s, answers[1].ttft_s, answers[2].ttft_s


def bench_exact_hit(model: str, repeats: int, prefix_tokens: int = 3500, profile_rows: int = 0) -> HitRow:
    """TTFT of a request whose documents are an exact cached prefix, against the same request cold.

    Args:
        model: model name or path.
        repeats: cold/warm pairs, interleaved.
        prefix_tokens: length of the cached prefix.
        profile_rows: > 0 prints the torch profiler's top operators (by self CPU time) of three
            more hot requests, after the timed ones.

    Returns:
        Medians of the cold and warm TTFTs.
    """
    eng = Engine.load(model, quality_gate=False)
    docs: list[str] = []
    while len(eng.build_prompt("q", docs)) < prefix_tokens:
        docs.append(_filler(len(docs)))
    question = ("Considering every section above, which repairs ran over budget, what changes to the ferry "
                "timetable were announced, and what is still wrong with the library roof? Please answer "
                "in one short sentence that names each of the three items clearly and briefly. If a section "
                "does not mention one of them, say which section would be the right place to look for it next.")
    prompt = eng.build_prompt(question, docs)
    for policy in (ReusePolicy.exact(), ReusePolicy.one_pass()):  # warm-up: no first call is a ratio's sample
        eng.generate(prompt, policy, max_new_tokens=1)
    full, cold, warm, hot = zip(*(_cold_warm_hot(eng, prompt) for _ in range(repeats)))
    if profile_rows:
        fresh = eng.with_store(MemoryStore())
        for _ in range(3):  # cold, warm, then hot from here on
            fresh.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                fresh.generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
        print("hot exact hits (3 requests), by self CPU time:\n"
              + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=profile_rows), flush=True)
        fresh.close()
    return HitRow(len(prompt), len(prompt) - len(prompt.question), statistics.median(cold), statistics.median(warm),
                  statistics.median(hot), tuple(w / f for w, f in zip(warm, full)),
                  tuple(h / f for h, f in zip(hot, full)), statistics.median(full))


@dataclass(frozen=True)
class RagHitRow:
    """Exact hits of RAG prompts: medians over items and repeats of each ratio to the same prompt's one-pass
    full prefill (``cold_s``: the exact path's cold request, computed segment by segment and stored)."""

    items: int
    passages: int
    prompt_tokens: int  # median
    question_tokens: int  # median
    cold_s: float  # median
    warm_ratio: float
    hot_ratio: float
    full_s: float = 0.0  # median of the one-pass full prefills the ratios divide by


def bench_rag_hit(model: str, data: str, items: range, repeats: int, passages: int = 6) -> RagHitRow:
    """Exact hits of musique prompts (their own short questions, ``passages`` documents: ~3.6k tokens at 6)
    against the same prompt cold: what a RAG pipeline that repeats a retrieval gets. Per item and
    repeat, a fresh store: cold, warm (every segment loaded), hot (attached)."""
    eng = Engine.load(model, quality_gate=False)
    chosen = load_item_range(data, items, passages)
    prompts = [eng.build_prompt(it.question, it.document_texts()) for it in chosen]
    for policy in (ReusePolicy.exact(), ReusePolicy.one_pass()):  # warm-up: no first call is a ratio's sample
        eng.generate(prompts[0], policy, max_new_tokens=1)
    cold, warm, hot, full = [], [], [], []
    for p in prompts:
        for _ in range(repeats):
            f, c, w, h = _cold_warm_hot(eng, p)
            cold.append(c)
            full.append(f)
            warm.append(w / f)  # against the one-pass full prefill, not the cold exact request
            hot.append(h / f)
    return RagHitRow(len(prompts), passages, int(statistics.median(len(p) for p in prompts)),
                     int(statistics.median(len(p.question) for p in prompts)), statistics.median(cold),
                     statistics.median(warm), statistics.median(hot), statistics.median(full))


@dataclass(frozen=True)
class FirstDocRow:
    """Medians over items and orders: seconds, and ratios to full prefill of the same prompt."""

    items: int
    prompt_tokens: int
    full_s: float
    preamble_only_ratio: float  # exact(prefix_limit=1): the preamble loaded, the rest computed
    exact_ratio: float  # exact (default): preamble and first document loaded
    first_doc_tokens: int


def bench_first_document(model: str, data: str, items: range, repeats: int, passages: int = 5) -> FirstDocRow:
    """Exact reuse of reordered documents whose chunks were precomputed (see the module docstring)."""
    eng = Engine.load(model, quality_gate=False).with_store(MemoryStore())
    chosen = load_item_range(data, items, passages)
    full, pre, exact, tokens, first = [], [], [], [], []
    policies = {"none": ReusePolicy.one_pass(), "pre": ReusePolicy.exact(prefix_limit=1), "exact": ReusePolicy.exact()}
    names = list(policies)
    # warm-up on copies of the first item's documents (other tokens, so nothing the timed prompts could hit):
    # every policy's first call, the first document's load included, is no sample
    spare = [f"{t}\n(warm-up copy)" for t in chosen[0].document_texts()] if chosen else []
    eng.precompute_chunks(spare)
    for name in names:
        eng.generate(eng.build_prompt(chosen[0].question, spare), policies[name], max_new_tokens=1)
    for it in chosen:
        texts = it.document_texts()
        eng.precompute_chunks(texts)  # ingest
        for r in range(repeats):
            order = texts[r + 1:] + texts[: r + 1]  # a new first document each repeat
            prompt = eng.build_prompt(it.question, order)
            t = {}
            for name in names[r % len(names):] + names[: r % len(names)]:  # rotated per repeat
                ans = eng.generate(prompt, policies[name], max_new_tokens=1)
                t[name] = ans.ttft_s
                _check_first_document(name, ans.report.segments)
            full.append(t["none"])
            pre.append(t["pre"] / t["none"])
            exact.append(t["exact"] / t["none"])
            tokens.append(len(prompt))
            first.append(len(prompt.documents[0]))
    return FirstDocRow(len(chosen), int(statistics.median(tokens)), statistics.median(full),
                       statistics.median(pre), statistics.median(exact), int(statistics.median(first)))


def _check_first_document(name: str, segments) -> None:
    """What each arm of :func:`bench_first_document` claims to time: ``exact`` loads the preamble and the first
    document and computes the rest; ``pre`` loads the preamble only.

    Raises:
        RuntimeError: the first document was not loaded, or a later one was (an order seen before, e.g. more
            repeats than documents: the whole prefix stored, an exact hit timed as the first document's).
    """
    if name == "none":
        return
    docs = [s.reuse_class is ReuseClass.EXACT for s in segments[1:-1]]
    if name == "exact" and not docs[0]:
        raise RuntimeError("the first document was not reused")
    if any(docs[1:]) or (name == "pre" and docs[0]):
        raise RuntimeError(f"{name}: documents after the ones it claims were loaded (an order seen before)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prefix-tokens", type=int, default=3500, help="cached prefix of the exact-hit case")
    ap.add_argument("--cases", default="prefill,hit,first-doc",
                    help="which of prefill, hit, rag-hit, first-doc, follow-up")
    ap.add_argument("--data", default=DEFAULT_EVAL_DATA, help="rag-hit, first-doc, follow-up: the questions")
    ap.add_argument("--items", type=item_range_arg, default="30-39", help="rag-hit, first-doc, follow-up: item range A-B")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS",
                    help="hit: print the torch profiler's top ROWS operators of three hot requests")
    args = ap.parse_args(argv)
    cases = set(args.cases.split(","))
    out: dict = {"threads": torch.get_num_threads(), "torch": torch.__version__, "environment": describe_environment()}
    lo, hi = parse_item_range(args.items)
    items = range(lo, hi + 1)
    if "first-doc" in cases:
        fd = bench_first_document(args.model, args.data, items, args.repeats)
        out["first_doc"] = asdict(fd)
        print(f"reordered documents after ingest, {fd.items} items x {args.repeats} orders, {fd.prompt_tokens} "
              f"tokens (first document {fd.first_doc_tokens}): full prefill {fd.full_s:.3f} s; preamble only "
              f"{fd.preamble_only_ratio:.3f}x; exact (preamble + first document) {fd.exact_ratio:.3f}x", flush=True)
    if "follow-up" in cases:
        fu = bench_follow_up(args.model, args.data, items, args.repeats)
        out["follow_up"] = asdict(fu)
        print(f"third turns, {fu.items} items x {args.repeats}, {fu.prompt_tokens} tokens ({fu.history_tokens} of "
              f"history and question, {fu.computed_tokens} computed under exact reuse): full prefill {fu.full_s:.3f} s; "
              f"same documents (exact, earlier turns reused) {fu.exact_ratio:.3f}x, (documents only) "
              f"{fu.exact_documents_only_ratio:.3f}x; "
              f"reordered documents (blend@{DEFAULT_RATIO:g}) {fu.blend_ratio:.3f}x, KL mean {fu.blend_kl_mean:.4f}, "
              f"max {fu.blend_kl_max:.4f}", flush=True)
    if "prefill" in cases:
        rows = []
        print("| dtype | tokens | engine s | transformers s | ratio |\n|---|---|---|---|---|", flush=True)
        for dtype in args.dtypes.split(","):
            for n in map(int, args.tokens.split(",")):
                r = bench_prefill(args.model, dtype, n, args.repeats)
                rows.append(r)
                print(f"| {r.dtype} | {r.tokens} | {r.engine_s:.3f} | {r.transformers_s:.3f} | {r.ratio:.2f} |",
                      flush=True)
        out["prefill"] = [{**asdict(r), "ratio": r.ratio} for r in rows]
    if "hit" in cases:
        hit = bench_exact_hit(args.model, args.repeats, args.prefix_tokens, args.profile)
        print(f"\nexact hit: prompt {hit.prompt_tokens} tokens, {hit.cached_tokens} cached; "
              f"one-pass full prefill {hit.full_s:.3f} s, cold TTFT {hit.cold_s:.3f} s, warm TTFT {hit.warm_s:.3f} s, "
              f"ratio {hit.ratio:.3f}; "
              f"again (hot prefix attached) {hit.hot_s:.3f} s, ratio {hit.hot_ratio:.3f}")
        out["exact_hit"] = {**asdict(hit), "ratio": hit.ratio, "hot_ratio": hit.hot_ratio}
    if "rag-hit" in cases:
        rh = bench_rag_hit(args.model, args.data, items, args.repeats)
        print(f"\nexact hits of RAG prompts: {rh.items} items x {args.repeats}, {rh.passages} passages, "
              f"{rh.prompt_tokens} tokens ({rh.question_tokens} in the question); cold TTFT {rh.cold_s:.3f} s, "
              f"one-pass full prefill {rh.full_s:.3f} s; "
              f"against a one-pass full prefill: warm ratio {rh.warm_ratio:.4f}, hot ratio {rh.hot_ratio:.4f}",
              flush=True)
        out["rag_hit"] = asdict(rh)
    if args.json:
        safeio.atomic_write_text(args.json, json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
