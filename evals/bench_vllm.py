"""vLLM with and without kvblend's connector on reordered documents (issue 17).

Every request carries an item's five musique passages in a new order, which is
the case prefix caching cannot serve: only the blocks of an identical prefix
(the chat preamble) can be reused. Two processes, each with its own full
prefill as the reference (ratios and KL are taken inside one process):

- ``--engine vllm``: vLLM alone, its prefix cache on. ``full`` has a fresh
  ``cache_salt`` (nothing to reuse); ``prefix-cache`` is the reordered prompt
  after the item was served once in its original order.
- ``--engine kvblend``: vLLM with ``KVBlendConnector`` (memory store, vLLM's
  prefix cache off, so every reuse comes through the connector). ``full`` as
  above; ``kvblend-exact``: the reordered prompt after the original order was
  served and saved; ``kvblend-blend@R``: the reordered prompt blended by the
  connector (chunks precomputed by the warm-up request) under the connector's
  default policy (no near-tie guard: opt-in inside vLLM); ``kvblend-blend@R:guard=M``:
  the same with kvblend's own guard margin (``--guard on|off`` runs only one of the two);
  ``--attention both`` adds ``kvblend-blend@R:torch-attention``, the blend with its sparse-query
  attention on torch's kernels (``KVBLEND_KERNELS=torch``, set per request: vLLM's worker runs in
  this process) instead of vLLM's CPU attention kernel, which the connector uses by default;
  ``--precision both`` adds ``kvblend-blend@R:attn=bf16:lin=bf16``, the blend with the opt-in bf16
  attention and linear layers for its recomputed rows (``attention_precision`` / ``linear_precision``
  in the request's ``kvblend`` entry).

Per mode: TTFT median (one request of one output token, no log-probs: its end-to-end time),
ratio to ``full`` per item and repeat (median), first-token KL to ``full``
(full-vocabulary log-probs, from a second, untimed request) and top-1 agreement. ``--concurrent 4`` also sends
4 reordered items at once per mode and reports the batch's wall time (the
slowest request's TTFT) against 4 concurrent full prefills.

    .venv-vllm/bin/python -m blend.evals.bench_vllm --engine vllm --items 0-4 --out DIR
    .venv-vllm/bin/python -m blend.evals.bench_vllm --engine kvblend --items 0-4 --out DIR

Writes DIR/<engine>.json, DIR/<engine>.md and DIR/vllm.png (the ratios of both runs, as far as
they exist; ``--replot`` redraws it without running anything).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from blend.defaults import DEFAULT_EVAL_DATA, DEFAULT_GUARD_MARGIN, DEFAULT_RATIO
from blend.evals.metrics import kl_cells
from blend.evals.splits import item_range_arg
from blend.kernels import ENV_VAR as KERNELS_ENV
from blend import safeio



def _orders(n_docs: int, k: int, seed: int) -> list[list[int]]:
    """``k`` document orders, none of them the original one."""
    rng = random.Random(seed)
    out = []
    while len(out) < k:
        o = list(range(n_docs))
        rng.shuffle(o)
        if o != list(range(n_docs)):
            out.append(o)
    return out


P90_MIN_SAMPLES = 10  # under this many, numpy's linearly interpolated p90 lies between the two largest samples


def ran_as(report: dict | None) -> str:
    """What served a request's context, from its connector report: ``vllm`` (nothing claimed: vLLM computed
    it all), ``error`` (a refused blend or a failed load: vLLM computed what it could not load), ``exact``
    (vLLM's own stored blocks), or a blend's path as kvblend's report says (``blend``; ``none`` where
    kvblend refused the blend and computed the context in full; ``exact`` where nothing was re-positioned)."""
    if not report or "claim" not in report:
        return "error" if report and "error" in report else "vllm"
    if "error" in report:
        return "error"
    if report["claim"] == "blend":
        return str(report.get("applied") or "blend")
    return str(report["claim"])


def mode_table(rows: list[dict], modes: list[str]) -> list[str]:
    """The per-mode table of a run (``full`` first), with what served each mode's timed requests ("ran as"),
    and a warning for a blend mode whose timed requests were not all blended (a refused or failed blend is
    vLLM's own prefill, timed under the blend's name)."""
    lines = ["| mode | tokens (median) | TTFT median s | ratio to full (median) | ratio mean | KL mean | KL p90 "
             "| KL max | top-1 | guarded | ran as |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    warnings, few = [], False
    for mode in ["full", *modes]:
        rs = [x for x in rows if x["mode"] == mode]
        kls = [x["kl"] for x in rs]
        few = few or len(rs) < P90_MIN_SAMPLES
        guarded = sum(1 for x in rs if (x.get("report") or {}).get("guard"))
        served = Counter(ran_as(x.get("report")) for x in rs) if mode != "full" else Counter()
        lines.append(f"| {mode} | {statistics.median(x['tokens'] for x in rs):.0f} "
                     f"| {statistics.median(x['ttft_s'] for x in rs):.2f} | {statistics.median(x['ratio'] for x in rs):.3f} "
                     f"| {statistics.mean(x['ratio'] for x in rs):.3f} "
                     f"| {kl_cells(kls, ('mean', 'p90', 'max'))} "
                     f"| {statistics.mean(x['top1'] for x in rs):.3f} | {guarded} of {len(rs)} "
                     f"| {', '.join(f'{k} {v}' for k, v in sorted(served.items())) or '-'} |")
        if mode.startswith("kvblend-blend") and set(served) - {"blend"}:
            warnings.append(f"{mode}: {sum(v for k, v in served.items() if k != 'blend')} of {len(rs)} timed "
                            "requests were not blended (see 'ran as'): their TTFT is another path's")
    if few:
        lines += ["", f"KL p90 over fewer than {P90_MIN_SAMPLES} requests is interpolated between the two largest "
                  "KLs: read it as a max."]
    return lines + ([""] + [f"WARNING: {w}" for w in warnings] if warnings else [])


def plot(out: Path) -> Path | None:
    """Bar chart of the TTFT ratio to full prefill per mode, one and N concurrent requests, from
    every ``<engine>.json`` in ``out`` (either run may be missing). Returns the PNG's path.

    The concurrent bars and their legend take N from the runs' own ``clients``; a mode without a
    concurrent round (``--concurrent 0``) gets no second bar. The title names the runs' items and
    their median prompt length.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars: list[tuple[str, float, float | None]] = []  # label, ratio at 1, ratio at N
    clients: set[int] = set()
    items: set[str] = set()
    data: set[str] = set()
    tokens: list[int] = []
    for engine, label in (("vllm", "vLLM"), ("kvblend", "vLLM + kvblend")):
        f = out / f"{engine}.json"
        if not f.exists():
            continue
        d = json.loads(f.read_text())
        conc = {c["mode"]: c["ratio"] for c in d.get("concurrent", [])}
        clients.update(int(c["clients"]) for c in d.get("concurrent", []) if "clients" in c)
        items.add(str(d.get("env", {}).get("items", "?")))
        data.add(Path(str(d.get("env", {}).get("data", DEFAULT_EVAL_DATA))).stem)  # older runs: the default
        tokens += [r["tokens"] for r in d["rows"] if "tokens" in r]
        for mode in dict.fromkeys(r["mode"] for r in d["rows"] if r["mode"] != "full"):
            one = statistics.median(r["ratio"] for r in d["rows"] if r["mode"] == mode)
            bars.append((f"{label}\n{mode}", one, conc.get(mode)))
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = range(len(bars))
    ax.bar([i - 0.2 for i in x], [b[1] for b in bars], 0.4, label="1 request (median)")
    both = [(i + 0.2, b[2]) for i, b in zip(x, bars) if b[2] is not None]
    if both:
        n = "/".join(str(c) for c in sorted(clients)) or "N"
        ax.bar([p for p, _ in both], [r for _, r in both], 0.4, label=f"{n} concurrent (the batch's wall time)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(0.35, color="red", lw=0.8, ls="--", label="target 0.35x")
    ax.set_xticks(list(x), [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("TTFT / vLLM full prefill")
    size = f", median {statistics.median(tokens):.0f} tokens" if tokens else ""
    ax.set_title(f"Reordered documents ({', '.join(sorted(data))}, 5 passages, items {', '.join(sorted(items))}{size})",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "vllm.png"
    safeio.save_figure(fig, path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blend.evals.bench_vllm", description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("vllm", "kvblend"), default="kvblend")
    ap.add_argument("--data", default=DEFAULT_EVAL_DATA)
    ap.add_argument("--items", type=item_range_arg, default="0-4")
    ap.add_argument("--repeats", type=int, default=2, help="reordered requests per item and mode")
    ap.add_argument("--ratio", type=float, default=DEFAULT_RATIO)
    ap.add_argument("--guard", choices=("both", "on", "off"), default="both",
                    help="blend with kvblend's near-tie guard margin, without the guard (the connector's "
                         "default), or both (interleaved)")
    ap.add_argument("--attention", choices=("auto", "both"), default="auto",
                    help="both: also blend with torch's attention kernels (interleaved) instead of vLLM's")
    ap.add_argument("--precision", choices=("compute", "both"), default="compute",
                    help="both: also blend with bf16 attention and linear layers for the recomputed rows (interleaved)")
    ap.add_argument("--concurrent", type=int, default=4, help="0: skip the concurrent round")
    ap.add_argument("--out", required=True)
    ap.add_argument("--replot", action="store_true", help="only redraw DIR/vllm.png")
    args = ap.parse_args(argv)
    if args.replot:
        print(plot(Path(args.out)))
        return 0
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from blend.engine import Engine
    from blend.evals.data import load_items
    from blend.evals.metrics import kl_divergence, top1_agree
    from blend.evals.splits import parse_item_range
    from blend.integrations.vllm import blend_request, prompt_spans
    from blend.integrations.vllm.engines import loaded_engines
    from blend.integrations.vllm.plan import BLEND_SALT_MARK
    from blend.models import SMOLLM2, convert_gguf

    model = str(convert_gguf(SMOLLM2))
    kw = dict(model=model, dtype="float32", enforce_eager=True, max_model_len=8192, max_logprobs=-1)
    if args.engine == "kvblend":
        llm = LLM(**kw, enable_prefix_caching=False, kv_transfer_config={
            "kv_connector": "KVBlendConnector", "kv_connector_module_path": "blend.integrations.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"store": "memory", "memory_budget_bytes": 12 << 30}})
        (shared,) = loaded_engines()
        kvb = shared.engine
    else:
        llm = LLM(**kw, enable_prefix_caching=True)
        kvb = Engine.load(SMOLLM2)  # only to build the same prompts as kvblend
    lo, hi = parse_item_range(args.items)
    items = load_items(args.data, None, 5)[lo:hi + 1]
    vocab = kvb.dims.vocab

    def ask(batch: list[tuple[list[int], dict | None, str | None]], dist: bool = True
            ) -> tuple[list[torch.Tensor], float, list]:
        """Send a batch; ``dist``: full-vocabulary log-probs (costly to build: timed runs go without)."""
        prompts, params = [], []
        for ids, kv, salt in batch:
            p = TokensPrompt(prompt_token_ids=ids)
            if salt:
                p["cache_salt"] = salt
            prompts.append(p)
            params.append(SamplingParams(max_tokens=1, temperature=0, logprobs=-1 if dist else None,
                                         extra_args={"kv_transfer_params": kv} if kv else None))
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        dists = []
        for o in outs if dist else ():
            d = torch.full((vocab,), -float("inf"), dtype=torch.float64)
            for tok, v in o.outputs[0].logprobs[0].items():
                d[tok] = v.logprob
            dists.append(d)
        return dists, wall, [o.kv_transfer_params for o in outs]

    blend_mode = f"kvblend-blend@{args.ratio:g}"
    guarded = f"{blend_mode}:guard={DEFAULT_GUARD_MARGIN:g}"
    blends = {"both": [blend_mode, guarded], "on": [guarded], "off": [blend_mode]}[args.guard]
    torch_attention = f"{blend_mode}:torch-attention"
    if args.attention == "both":
        blends.append(torch_attention)
    bf16 = f"{blend_mode}:attn=bf16:lin=bf16"
    if args.precision == "both":
        blends.append(bf16)
    modes = ["prefix-cache"] if args.engine == "vllm" else ["kvblend-exact", *blends]
    rows: list[dict] = []
    salt_n = 0

    def fresh_salt() -> str:
        # a salt no earlier request used (vLLM's prefix cache and the store miss), marked as a blend's so that
        # the connector saves none of its blocks: the blends it is the denominator of save nothing either
        nonlocal salt_n
        salt_n += 1
        return f"bench-full-{salt_n}|{BLEND_SALT_MARK}"

    def request(mode: str, prompt) -> tuple[list[int], dict | None, str | None]:
        ids = prompt.token_ids
        os.environ[KERNELS_ENV] = "torch" if mode == torch_attention else "auto"  # read per kernel call
        if mode == "full":
            return ids, None, fresh_salt()
        if mode.startswith("kvblend-blend"):
            extra = {"guard_margin": DEFAULT_GUARD_MARGIN} if mode == guarded else {}  # else the connector's default
            if mode == bf16:
                extra = {"attention_precision": "bf16", "linear_precision": "bf16"}
            spans = prompt_spans([len(s) for s in prompt.segments])
            return ids, blend_request(ids, spans, ratio=args.ratio, **extra), None
        return ids, None, None

    for n, it in enumerate(items):
        texts = it.document_texts()
        original = kvb.build_prompt(it.question, texts)
        ask([request("kvblend-exact" if args.engine == "kvblend" else "prefix-cache", original)])  # warm-up: served once
        if args.engine == "kvblend":
            ask([request(blends[0], original)])  # stores the canonical chunks
        for r, order in enumerate(_orders(len(texts), args.repeats, seed=lo + n)):
            prompt = kvb.build_prompt(it.question, [texts[i] for i in order])
            _, t_full, _ = ask([request("full", prompt)], dist=False)  # timed
            ref, _, _ = ask([request("full", prompt)])  # the reference distribution (another cold run)
            rows.append(dict(item=lo + n, repeat=r, mode="full", tokens=len(prompt), ttft_s=t_full, ratio=1.0,
                             kl=0.0, top1=1.0))
            for mode in modes:
                _, t, rep = ask([request(mode, prompt)], dist=False)  # the timed request's own report
                got, _, _ = ask([request(mode, prompt)])
                rows.append(dict(item=lo + n, repeat=r, mode=mode, tokens=len(prompt), ttft_s=t, ratio=t / t_full,
                                 kl=kl_divergence(ref[0], got[0]), top1=top1_agree(ref[0], got[0]),
                                 report=(rep[0] or {}).get("kvblend")))
        print(f"item {lo + n}: " + " ".join(f"{x['mode']}={x['ttft_s']:.2f}s" for x in rows[-(1 + len(modes)):]),
              file=sys.stderr, flush=True)

    conc = []
    if args.concurrent > 1:
        batch_items = [items[i % len(items)] for i in range(args.concurrent)]
        prompts = []
        for j, it in enumerate(batch_items):
            texts = it.document_texts()
            order = _orders(len(texts), 1, seed=1000 + j)[0]
            prompts.append(kvb.build_prompt(it.question, [texts[i] for i in order]))
        _, t_full, _ = ask([request("full", p) for p in prompts], dist=False)
        conc.append(dict(mode="full", clients=args.concurrent, wall_s=t_full, ratio=1.0))
        for mode in modes:
            if mode.startswith("kvblend-blend"):  # untimed: stores the chunks again where the exact mode's
                ask([request(mode, p) for p in prompts], dist=False)  # saves evicted them (memory budget)
            _, t, reps = ask([request(mode, p) for p in prompts], dist=False)
            conc.append(dict(mode=mode, clients=args.concurrent, wall_s=t, ratio=t / t_full,
                             reports=[(x or {}).get("kvblend") for x in reps]))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(torch_threads=torch.get_num_threads(), engine=args.engine, data=args.data, items=args.items,
               repeats=args.repeats,
               omp_bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"))
    safeio.atomic_write_text(out / f"{args.engine}.json",
                             json.dumps(dict(env=env, rows=rows, concurrent=conc), indent=1))
    lines = [f"{args.engine}: items {args.items}, {args.repeats} reordered requests per item and mode, "
             f"{env['torch_threads']} torch threads", "", *mode_table(rows, modes)]
    if conc:
        lines += ["", f"{args.concurrent} concurrent requests (wall time of the batch = the slowest TTFT):", "",
                  "| mode | wall s | ratio to full | ran as |", "|---|---|---|---|"]
        lines += [f"| {c['mode']} | {c['wall_s']:.2f} | {c['ratio']:.3f} | "
                  + (", ".join(f"{k} {v}" for k, v in sorted(Counter(map(ran_as, c.get("reports", []))).items()))
                     or "-") + " |" for c in conc]
    text = "\n".join(lines)
    safeio.atomic_write_text(out / f"{args.engine}.md", text + "\n")
    print(text)
    plot(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
