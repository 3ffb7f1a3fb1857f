"""The evaluation loop.

For each item::

    prompt = engine.build_prompt(question, documents)
    precompute KV every method would reuse            (not timed)
    [first item of the process: warm-up, every method once, untimed]
    round 0: every method answers (max_new_tokens)    order rotated per item
             once full has answered, each method's logits along full's answer are
             teacher-forced from that method's own prompt cache (kept by generate,
             so no second prefill; freed right after)
    rounds 1..repeats-1: every method, 1 token        TTFT samples only, order rotated
    metrics vs gold and vs full -> one row appended to rows.jsonl

``--resume`` continues from ``rows.jsonl``: items done are skipped, and
methods added to the list since are run on them beside a freshly timed
``full`` (their TTFT ratios are against it; quality rows are deterministic,
and full's answer must come out the same) and merged into the item's row.

Rotating the order per item and per round spreads machine drift (thermal,
caches, other processes) over all methods alike. ``full`` is always run: it
is the reference of KL, top-1, teacher-forced and answer agreement.

The harness only needs an engine-like object (duck-typed): ``build_prompt``,
``precompute``, ``generate`` (with ``keep_cache``), ``teacher_forced_logits``
(with ``answer``), ``provenance``,
``model_name`` with the signatures of :class:`blend.engine.Engine`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Sequence

from blend import safeio
from blend.evals import metrics as M
from blend.evals.aggregate import aggregate
from blend.evals.data import Item
from blend.evals.environment import describe_environment, provenance_dict
from blend.evals.eval_config import RESUME_FREE, EvalConfig
from blend.evals.methods import REFERENCE, Method, MethodKind
from blend.evals.rows import MAX_ROWS_BYTES, ItemRow, MethodRow, RowError, jsonl_lines
from blend.probe import top2_margin
from blend.progress import Progress

ROWS_FILE = "rows.jsonl"
RUN_FILE = "run.json"
MAX_RUN_FILE_BYTES = 1 << 20  # a run.json larger than this is not a run's settings
SCHEMA_VERSION = 1

class ResumeError(ValueError):
    """--resume over an output folder written with different settings or data."""


def rotated(seq: Sequence[Method], shift: int) -> list[Method]:
    """``seq`` rotated left by ``shift`` (mod its length)."""
    if not seq:
        return []
    k = shift % len(seq)
    return list(seq[k:]) + list(seq[:k])


def evaluate_item(
    engine: Any,
    item: Item,
    index: int,
    methods: Sequence[Method],
    policies: dict[str, Any],
    config: EvalConfig,
    warm_up: bool,
) -> ItemRow:
    """Run every method on one item and score it.

    Args:
        engine: engine-like object.
        item: the item.
        index: its index in the data (drives the rotation).
        methods: parsed methods, ``full`` among them.
        policies: ``{name: ReusePolicy}``.
        config: run config (max_new_tokens, repeats, warmup, system).
        warm_up: run untimed warm-up rounds first.

    Returns:
        The item's row, one :class:`MethodRow` per method; non-finite numbers are None (as its JSON holds them).
    """
    prompt = engine.build_prompt(item.question, item.document_texts(), config.system)
    for m in methods:
        if m.kind is not MethodKind.FULL:
            engine.precompute(prompt, policies[m.name])
    if warm_up:
        for w in range(config.warmup):
            for m in rotated(methods, w):
                engine.generate(prompt, policies[m.name], max_new_tokens=1)
    answers: dict[str, Any] = {}
    samples: dict[str, list[float]] = {m.name: [] for m in methods}
    cont: list[int] = []
    tf_rows: dict[str, Any] = {}  # name -> teacher-forced logits along full's answer
    pending: list[str] = []  # answered before full: their caches wait for full's answer
    for m in rotated(methods, index):
        ans = engine.generate(prompt, policies[m.name], max_new_tokens=config.max_new_tokens, keep_cache=True)
        answers[m.name] = ans
        samples[m.name].append(float(ans.ttft_s))
        pending.append(m.name)
        if REFERENCE not in answers:
            continue
        cont = [int(t) for t in answers[REFERENCE].token_ids]
        # Score along full's answer from each method's own prompt cache (no second
        # prefill), as soon as that answer exists, so few caches are held at once.
        for name in pending:
            if cont:
                tf_rows[name] = engine.teacher_forced_logits(prompt, policies[name], cont, answer=answers[name])
            _release(answers[name])
        pending.clear()
    for r in range(1, config.repeats):
        for m in rotated(methods, index + r):
            samples[m.name].append(float(engine.generate(prompt, policies[m.name], max_new_tokens=1).ttft_s))

    full = answers[REFERENCE]
    full_tf = tf_rows.get(REFERENCE)
    full_ttft = M.median(samples[REFERENCE])
    threads = timing_threads()
    rows: dict[str, MethodRow] = {}
    for m in methods:
        ans = answers[m.name]
        kl = M.kl_divergence(full.first_logits, ans.first_logits)
        top1 = M.top1_agree(full.first_logits, ans.first_logits)
        if cont:
            tf = tf_rows[m.name]
            tf_agree, tf_kl = M.teacher_forced_agreement(tf, cont), M.mean_kl_rows(full_tf, tf, len(cont))
        else:  # full answered nothing: the first token is all there is to compare
            tf_agree, tf_kl = top1, kl
        rep = ans.report
        ttft = M.median(samples[m.name])
        rows[m.name] = MethodRow(
            prediction=ans.text,
            answer_tokens=len(ans.token_ids),
            **_gold_scores(ans.text, item.answers),
            agreement=M.answers_agree(ans.text, full.text),
            # leading answer tokens that are full prefill's own (evals/answer_survival.py)
            same_tokens=M.common_prefix(cont, [int(t) for t in ans.token_ids]),  # cont: full's answer ids
            kl=kl,
            top1=top1,
            tf_agreement=tf_agree,
            tf_kl=tf_kl,
            ttft_s=ttft,
            ttft_samples=tuple(samples[m.name]),
            ttft_ratio=(ttft / full_ttft) if ttft is not None and full_ttft else None,
            ttft_ref_s=full_ttft,  # full prefill's TTFT beside it: what ttft_ratio divides by
            threads=threads,  # intra-op threads the times were measured with
            # the blend's own first-token top-2 gap (nats; before any guard) and whether the guard fired:
            # with a guarded method and the same blend unguarded, every smaller margin's outcome follows
            # (evals/guard_curve.py)
            first_token_margin=getattr(rep, "first_token_margin", None),  # engine-like objects may lack them
            guarded=bool(getattr(rep, "guard", "")),
            applied=_applied(rep),  # the path that ran: a refused blend's rows are not a blend's
            recomputed_tokens=int(rep.recomputed_tokens),
            reused_tokens=int(rep.reused_tokens),
            prompt_tokens=int(rep.prompt_tokens),
            recomputed_frac=int(rep.recomputed_tokens) / max(int(rep.prompt_tokens), 1),
            # rows with fresh KV above the check layer: computed (not reused) plus recomputed
            computed_frac=(int(rep.prompt_tokens) - int(rep.reused_tokens) + int(rep.recomputed_tokens))
            / max(int(rep.prompt_tokens), 1),
        )
    return ItemRow(
        index=index,
        id=item.id,
        question=item.question,
        item_sha256=item_digest(item),  # what --resume checks the data against
        answers=tuple(item.answers),
        prompt_tokens=len(prompt.token_ids),
        full_answer=full.text,
        ref_margin=top2_margin(full.first_logits),  # full's own first-token top-2 gap (nats)
        methods=rows,
    ).finite()  # JSON has no NaN or infinity: such a number is None, in memory as in rows.jsonl


def _applied(report: Any) -> str:
    """The report's ``applied`` mode by name ("" for an engine-like object's report without one)."""
    mode = getattr(report, "applied", None)
    return "" if mode is None else str(getattr(mode, "value", mode))


def item_digest(item: Item) -> str:
    """SHA-256 of what an item's rows are computed from: its question, the passages its prompt holds (in
    order) and its gold answers. ``--resume`` compares it, so a data file rewritten under the same path
    (same questions, other passages) cannot mix rows built on different passages."""
    text = json.dumps([item.question, item.document_texts(), list(item.answers)], ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def timing_threads() -> int | None:
    """Intra-op threads TTFTs are measured with (torch's setting; None without torch)."""
    try:
        import torch
    except ImportError:  # an engine-like stand-in without torch
        return None
    return int(torch.get_num_threads())


def _merge(old: ItemRow, new: ItemRow, index: int) -> ItemRow:
    """An item's row with the methods a resumed run added (their TTFT ratios are against the
    full prefill timed beside them; quality is deterministic, so full's answer must not change)."""
    if new.full_answer != old.full_answer:
        raise ResumeError(
            f"--resume: item {index}: full prefill now answers {new.full_answer!r}, before "
            f"{old.full_answer!r}; the quality rows would not be comparable (start a fresh --out)"
        )
    methods = dict(old.methods)
    for name, row in new.methods.items():
        if name not in old.methods:
            methods[name] = row
    return dataclasses.replace(old, methods=methods)


def _gold_scores(prediction: str, answers: tuple[str, ...]) -> dict[str, float | None]:
    """F1, EM, Rouge-L and contains against the gold answers (null each when the item has none), as
    :class:`MethodRow` arguments."""
    if not answers:
        return {"f1": None, "em": None, "rouge_l": None, "contains": None}
    return {"f1": M.best_over(M.token_f1, prediction, answers), "em": M.best_over(M.exact_match, prediction, answers),
            "rouge_l": M.best_over(M.rouge_l, prediction, answers),
            "contains": M.best_over(M.contains_answer, prediction, answers)}


def _release(answer: Any) -> None:
    """Free an answer's kept KV cache (engine-like answers may not have one)."""
    release = getattr(answer, "release_cache", None)
    if release is not None:
        release()


def _read_rows(path: Path) -> list[ItemRow]:
    """The rows of ``rows.jsonl``; a last line cut short by an interruption is dropped (that item is redone).

    Raises:
        ResumeError: any other line that is not a row (dropping it, and the file rewritten without it,
            would lose it).
    """
    if not path.exists() and not path.is_symlink():
        return []
    try:  # a regular file only (a link or FIFO planted in --out is refused, never followed or waited on)
        text = safeio.read_regular(path, MAX_ROWS_BYTES).decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ResumeError(f"--resume: cannot read {path} ({type(e).__name__}); start a fresh --out") from None
    lines = [ln for _, ln in jsonl_lines(text)]  # split at "\n" only (not at a U+2028 in a string)
    rows = []
    for n, line in enumerate(lines):
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            if n == len(lines) - 1 and not text.endswith("\n"):
                break  # torn by the interruption: the last write never finished
            raise ResumeError(f"--resume: line {n + 1} of {path} is not a row (not JSON); "
                              "repair or remove it, or start a fresh --out") from None
        try:
            rows.append(ItemRow.from_json(row))
        except RowError as e:
            raise ResumeError(f"--resume: line {n + 1} of {path} is not a row ({e}); "
                              "repair or remove it, or start a fresh --out") from None
    return rows


def _ranges(indices: Sequence[int]) -> str:
    """Sorted indices as ranges: [1, 2, 3, 7] -> "1-3, 7"."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans)


def prepare_out(out: Path, config: EvalConfig, items: Sequence[Item], resume: bool,
                first_index: int = 0) -> dict[int, ItemRow]:
    """Create the output folder; on --resume, load the rows already done.

    Args:
        out: output folder.
        config: this run's config.
        items: this run's items.
        resume: continue from ``rows.jsonl`` instead of starting over.
        first_index: data index of ``items[0]`` (an ``--items A-B`` range starts at A).

    Returns:
        ``{index: row}`` of items already done (empty unless resuming).

    Raises:
        ResumeError: the folder was written with other settings or data (other questions, or the same
            questions over other passages), or holds items outside this run's range.
    """
    out.mkdir(parents=True, exist_ok=True)
    run_path, rows_path = out / RUN_FILE, out / ROWS_FILE
    done: dict[int, ItemRow] = {}
    if resume and run_path.exists():
        try:
            done = _resumed_rows(out, config, items, first_index)
        except ResumeError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as e:
            raise ResumeError(f"--resume: {out} holds a damaged {RUN_FILE} or {ROWS_FILE} "
                              f"({type(e).__name__}: {str(e)[:80]}); start a fresh --out") from None
        # Rewrite without a cut-off last line, so appends start on a fresh line.
        safeio.atomic_write_bytes(rows_path,
                                  "".join(json.dumps(done[i].to_json()) + "\n" for i in sorted(done)).encode())
    else:
        if resume and rows_path.is_file() and rows_path.stat().st_size:  # nothing says what they were run with
            raise ResumeError(f"--resume: {out} holds {ROWS_FILE} but no {RUN_FILE} (its settings); "
                              "move the rows away or start a fresh --out")
        if not resume and safeio.is_regular(rows_path, follow_symlinks=False) and rows_path.lstat().st_size:
            # a run's rows are never wiped unasked (a link or FIFO planted there is not a run: it is replaced)
            raise ResumeError(f"{out} holds the rows of an earlier run: --resume continues it; to start over, "
                              "give another --out or remove that folder")
        safeio.atomic_write_bytes(rows_path, b"")  # replaces a link or FIFO there, never writes through it
    safeio.atomic_write_bytes(run_path, (json.dumps({"identity": config.identity()}, indent=1) + "\n").encode())
    return done


def _resumed_rows(out: Path, config: EvalConfig, items: Sequence[Item], first_index: int) -> dict[int, ItemRow]:
    """The rows a resumed run keeps (see :func:`prepare_out`); a malformed field raises whatever parsing it
    raised (the caller names the damage)."""
    run_path, rows_path = out / RUN_FILE, out / ROWS_FILE
    done: dict[int, ItemRow] = {}
    old = json.loads(safeio.read_regular(run_path, MAX_RUN_FILE_BYTES).decode("utf-8"))
    # fields free to differ are ignored on both sides (folders written before a field became free)
    old_id = {k: v for k, v in old.get("identity", {}).items() if k not in RESUME_FREE}
    if old_id != config.identity():
        diff = sorted(
            k for k in set(old_id) | set(config.identity()) if old_id.get(k) != config.identity().get(k)
        )
        raise ResumeError(f"--resume: {out} was written with different settings ({', '.join(diff)})")
    outside = set()
    for row in _read_rows(rows_path):
        i = row.index
        if not first_index <= i < first_index + len(items):
            outside.add(i)
            continue
        it = items[i - first_index]
        if row.id != it.id or row.question != it.question:
            raise ResumeError(f"--resume: item {i} in {rows_path} does not match the data (id {row.id!r})")
        if row.item_sha256 is not None and row.item_sha256 != item_digest(it):  # rows from before it: unchecked
            raise ResumeError(f"--resume: item {i} in {rows_path} was computed on other passages or answers "
                              "than the data now holds (start a fresh --out)")
        done[i] = row  # a later line for the same item (methods added) supersedes an earlier one
    if outside:  # rewriting the file below without them would lose them
        raise ResumeError(f"--resume: {rows_path} holds items outside this run's range "
                          f"({_ranges(sorted(outside))}); resume with a range that covers them, "
                          "or use another --out")
    dropped = sorted({n for r in done.values() for n in r.methods} - set(config.methods))
    if dropped:
        raise ResumeError(f"--resume: {out} holds methods this run does not list ({', '.join(dropped)}); "
                          "a resumed run may add methods, not drop them")
    return done


def run_harness(
    engine: Any,
    items: Sequence[Item],
    methods: Sequence[Method],
    config: EvalConfig,
    out: Path,
    resume: bool = False,
    progress: Progress | None = None,
    policy_of: Callable[[Method], Any] | None = None,
    first_index: int = 0,
) -> dict[str, Any]:
    """Evaluate every method on every item and build the results object.

    Args:
        engine: engine-like object (see module docstring).
        items: items to evaluate.
        methods: parsed methods; must include ``full``.
        config: run config.
        out: output folder (rows.jsonl and run.json are written as items finish).
        resume: continue from rows already in ``out``.
        progress: progress bar (None: silent).
        policy_of: method -> policy (default :meth:`Method.policy`); tests inject fakes.
        first_index: data index of ``items[0]`` (rows record data indices, so the tuning
            split 0-29 and the validation split 30-99 keep their item numbers).

    Returns:
        The results object (see :mod:`blend.evals.report`), not yet written.
    """
    if REFERENCE not in [m.name for m in methods]:
        raise ValueError("methods must include 'full' (the reference)")
    policy_of = policy_of or (lambda m: m.policy())
    policies = {m.name: policy_of(m) for m in methods}
    done = prepare_out(out, config, items, resume, first_index)
    missing = {i: [m for m in methods if m.name not in row.methods] for i, row in done.items()}
    if progress is not None:
        progress.skip(sum(not todo for todo in missing.values()))  # items with nothing to add
    warm = False
    with safeio.append_text(out / ROWS_FILE) as f:
        for i, item in enumerate(items, start=first_index):
            todo = list(methods)
            if i in done:
                if not missing[i]:
                    continue
                todo = [m for m in methods if m.name == REFERENCE] + missing[i]  # full: the reference, timed again
            row = evaluate_item(engine, item, i, todo, policies, config, warm_up=not warm)
            warm = True
            if i in done:
                row = _merge(done[i], row, i)
            f.write(json.dumps(row.to_json()) + "\n")
            f.flush()
            done[i] = row
            if progress is not None:
                progress.update(1)
    if progress is not None:
        progress.close()
    rows = [done[i] for i in sorted(done)]
    return {
        "schema_version": SCHEMA_VERSION,
        "config": config.to_dict(),
        "model": {
            "name": str(engine.model_name),
            "dtype": config.dtype,
            "provenance": provenance_dict(engine.provenance),
        },
        **describe_environment(engine_device=getattr(engine, "device", None)),
        "reference": REFERENCE,
        "methods": aggregate(rows, methods, n_boot=config.bootstrap, seed=config.seed),
        "items": [r.to_json() for r in rows],
    }
