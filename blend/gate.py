"""The per-model quality gate for blended reuse (``kvblend check``).

Four checks, each pass/fail with its figure:

1. reference: the engine's logits (no reuse) equal the transformers forward;
2. rope: layer-0 keys of re-positioned chunks equal those of a full prefill
   (layer-0 K depends only on tokens and positions, so this isolates RoPE);
3. ratio-1: blend at ratio 1.0 equals full prefill;
4. fidelity: blend at the default ratio against full prefill on the built-in
   calibration set: mean first-token KL and top-1 agreement.

The result is recorded under ``$KVBLEND_HOME/gate/<provenance digest>.json``.
The first blend request for a provenance without a record runs the gate; a
model that failed gets class ``fallback`` unless the policy forces blending.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from blend import safeio
from blend.calibration import QUESTIONS, calibration_items
from blend.divergence import kl_divergence, top1_agree
from blend.defaults import DEFAULT_GATE_ITEMS, DEFAULT_RATIO, GATE_KL_BOUND, GATE_TOP1_BOUND, kvblend_home
from blend.errors import InvalidRequestError
from blend.numeric import integral, shown
from blend.kernels.tolerances import TOL, Tol
from blend.policy import ReusePolicy
from blend.store.memory import MemoryStore

if TYPE_CHECKING:  # the engine receives a gate; the gate only calls the engine's public methods
    from blend.engine import Engine
    from blend.report import ReuseReport

log = logging.getLogger(__name__)

GATE_RATIO = DEFAULT_RATIO
# the RoPE check's full reuse: every document row re-positioned, none recomputed. Unguarded: under the default
# near-tie guard a near tie (nearly every prompt of a tiny random model) was blended again at 0.3, and the check
# compared that pass's cache, whose candidate rows (60% of the documents) were computed fresh, not re-positioned
ROPE_POLICY = ReusePolicy.blend(ratio=0.0, force=True, guard_margin=None)
KL_BOUND = GATE_KL_BOUND  # mean first-token KL(full || blend@GATE_RATIO) at most this
TOP1_BOUND = GATE_TOP1_BOUND  # first-token top-1 agreement at least this


class CheckName(Enum):
    REFERENCE = "reference"
    ROPE = "rope"
    RATIO_ONE = "ratio-1"
    FIDELITY_KL = "fidelity-kl"
    FIDELITY_TOP1 = "fidelity-top1"


AT_LEAST = frozenset({CheckName.FIDELITY_TOP1})  # checks whose figure must reach the bound; the others stay under it


def passes(name: CheckName, figure: float, bound: float) -> bool:
    """Whether a check's figure is within its bound (False for NaN).

    Args:
        name: the check (:data:`AT_LEAST` checks must reach their bound, the others stay under it).
        figure: what the check measured.
        bound: its bound (:func:`check_bounds`).

    Returns:
        Whether the check passed.
    """
    return figure >= bound if name in AT_LEAST else figure <= bound


def check_bounds(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> dict[CheckName, float]:
    """Each check's bound for an engine computing in ``dtype`` and keeping KV in ``kv_dtype``.

    Args:
        dtype: the engine's compute dtype.
        kv_dtype: the dtype its KV is kept in; None: ``dtype``.

    Returns:
        Each check's bound: the mechanical checks' from :func:`gate_tol`, the fidelity checks' fixed ones.
    """
    tol = gate_tol(dtype, kv_dtype)
    return {CheckName.REFERENCE: tol.logits, CheckName.ROPE: tol.rope, CheckName.RATIO_ONE: tol.logits,
            CheckName.FIDELITY_KL: KL_BOUND, CheckName.FIDELITY_TOP1: TOP1_BOUND}


@dataclass(frozen=True)
class CheckResult:
    name: CheckName
    passed: bool
    figure: float
    bound: float
    detail: str

    @classmethod
    def judged(cls, name: CheckName, figure: float, bound: float, detail: str) -> "CheckResult":
        """The check's result, passed as :func:`passes` judges its figure against its bound."""
        return cls(name, passes(name, figure, bound), figure, bound, detail)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "name": self.name.value}


class GateRecordError(ValueError):
    """A recorded gate result that cannot be trusted (treated as no record: the gate runs again)."""


_CHECK_FIELDS = frozenset({"name", "passed", "figure", "bound", "detail"})
MAX_RECORD_BYTES = 1 << 20  # a record is ~1 KB


@dataclass(frozen=True)
class GateResult:
    model: str
    provenance_sha256: str
    checks: tuple[CheckResult, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def summary(self) -> str:
        return ", ".join(f"{c.name.value} {'ok' if c.passed else 'FAIL'} {c.figure:.3g}" for c in self.checks)

    def to_dict(self) -> dict:
        return {"model": self.model, "provenance_sha256": self.provenance_sha256, "passed": self.passed,
                "checks": [c.to_dict() for c in self.checks]}

    @classmethod
    def from_dict(cls, d: object) -> "GateResult":
        """A recorded result, every field of its type and every check exactly once.

        Raises:
            GateRecordError: anything else (a record must never let blending on by what it lacks:
                ``"checks": []`` or ``"passed": "false"`` would pass ``all``).
        """
        if not isinstance(d, dict):
            raise GateRecordError("not a JSON object")
        model, digest, rows = d.get("model"), d.get("provenance_sha256"), d.get("checks")
        if not isinstance(model, str) or not isinstance(digest, str):
            raise GateRecordError("model and provenance_sha256 must be strings")
        if not isinstance(rows, list):
            raise GateRecordError("checks must be a list")
        checks = []
        for c in rows:
            if not isinstance(c, dict) or set(c) != _CHECK_FIELDS:
                raise GateRecordError(f"a check must be an object of {sorted(_CHECK_FIELDS)}")
            try:
                name = CheckName(c["name"])
            except ValueError:
                raise GateRecordError(f"unknown check {c['name']!r:.40}") from None
            if type(c["passed"]) is not bool:
                raise GateRecordError(f"check {name.value}: passed must be true or false, got {c['passed']!r:.20}")
            for f in ("figure", "bound"):
                if isinstance(c[f], bool) or not isinstance(c[f], (int, float)):
                    raise GateRecordError(f"check {name.value}: {f} must be a number")
            if not isinstance(c["detail"], str):
                raise GateRecordError(f"check {name.value}: detail must be a string")
            try:
                figure, bound = float(c["figure"]), float(c["bound"])
            except OverflowError:
                raise GateRecordError(f"check {name.value}: figure or bound out of range") from None
            if c["passed"] is not passes(name, figure, bound):  # "passed": true beside a failing (or NaN) figure
                raise GateRecordError(f"check {name.value}: passed {c['passed']} disagrees with its figure "
                                      f"{figure!r:.20} and bound {bound!r:.20}")
            checks.append(CheckResult(name, c["passed"], figure, bound, c["detail"]))
        names = [c.name for c in checks]
        if sorted(n.value for n in names) != sorted(n.value for n in CheckName):
            raise GateRecordError(f"checks {[n.value for n in names]} are not each of {[n.value for n in CheckName]} once")
        result = cls(model, digest, tuple(checks))
        if "passed" in d and d["passed"] is not result.passed:
            raise GateRecordError(f"passed {d['passed']!r:.20} disagrees with its checks")
        return result


def run_gate(engine: "Engine", items: int = DEFAULT_GATE_ITEMS, progress: bool = True) -> GateResult:
    """Run the four checks on ``engine``'s model.

    Args:
        engine: a :class:`blend.engine.Engine`.
        items: calibration prompts for the fidelity check (1-6).
        progress: print a line per step to stderr.

    Returns:
        The gate result (not yet recorded).
    """
    check_items(items)
    eng = engine.with_store(MemoryStore())  # same weights; the gate never touches the user's store
    try:
        return _run_checks(engine, eng, items, progress)
    finally:
        eng.close()


def check_items(items: object, name: str = "items") -> None:
    """Refuse a count of calibration prompts the fidelity check cannot run (1 to six).

    Args:
        items: the count as given (anything: it is checked here).
        name: what the count is called in the error.

    Raises:
        InvalidRequestError: naming ``name`` (the CLI passes its flag).
    """
    n = len(QUESTIONS)
    if not integral(items) or not 1 <= items <= n:
        raise InvalidRequestError(f"{name} must be 1 to {n} (calibration prompts), got {shown(items)}")


def gate_tol(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> Tol:
    """The mechanical bounds of an engine computing in ``dtype`` and keeping KV in ``kv_dtype``: those of
    the less precise (a float32 engine with bf16 KV rounds every stored row to bf16, which float32's
    absolute bounds refused: every blend fell back).

    Args:
        dtype: the engine's compute dtype.
        kv_dtype: the dtype its KV is kept in; None: ``dtype``.

    Returns:
        The :data:`~blend.kernels.tolerances.TOL` row of the coarser of the two.
    """
    coarse = max((dtype, kv_dtype or dtype), key=lambda d: _COARSENESS[d])
    return TOL[coarse]


_COARSENESS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # ulps of 2**-23, 2**-10, 2**-7


def _run_checks(engine: "Engine", eng: "Engine", items: int, progress: bool) -> GateResult:
    tol = gate_tol(engine.dtype, engine.kv_dtype)
    bound = check_bounds(engine.dtype, engine.kv_dtype)
    say = (lambda m: print(f"kvblend check [{engine.model_name}]: {m}", file=sys.stderr, flush=True)) \
        if progress else (lambda m: None)
    cal = calibration_items(items)
    first = eng.build_prompt(cal[0].question, cal[0].documents)
    checks = []

    say("reference equality with transformers")
    hf = engine.runner.loaded.model
    with torch.inference_mode(), engine.runner.rope.module_in_use():  # it shares the engine's rotary module
        ref = hf(torch.tensor([first.token_ids])).logits[0, -1].float()
    full = eng.generate(first, ReusePolicy.none(), max_new_tokens=1)
    diff = beyond(full.first_logits.cpu(), ref, tol.gate_rtol, per_row=True)
    checks.append(CheckResult.judged(CheckName.REFERENCE, diff, bound[CheckName.REFERENCE],
                                     "max |logits - transformers logits|" + _relative(tol, "max |logit|")))

    say("RoPE re-positioning")
    _, full_cache, _ = eng.prefill(first, ReusePolicy.none())
    _, reuse_cache, reuse = eng.prefill(first, ROPE_POLICY)
    n = len(first)
    rope_diff = beyond(reuse_cache.k[0][:, :n], full_cache.k[0][:, :n], tol.gate_rtol, per_row=True)
    checks.append(_measured(CheckName.ROPE, rope_diff, bound[CheckName.ROPE],
                            "max |layer-0 K re-positioned - K of full prefill|"
                            + _relative(tol, "max |K| of the head's row"), [reuse]))

    say("ratio 1.0 against full prefill")
    one = eng.generate(first, ReusePolicy.blend(ratio=1.0, force=True), max_new_tokens=1)
    d1 = beyond(one.first_logits, full.first_logits, tol.gate_rtol, per_row=True)
    checks.append(_measured(CheckName.RATIO_ONE, d1, bound[CheckName.RATIO_ONE],
                            "max |logits(blend@1.0) - logits(full)|" + _relative(tol, "max |logit|"), [one.report]))

    kls, agree, blends = [], [], []
    for i, item in enumerate(cal):
        say(f"fidelity {i + 1}/{len(cal)}")
        prompt = eng.build_prompt(item.question, item.documents)
        f = eng.generate(prompt, ReusePolicy.none(), max_new_tokens=1).first_logits
        blends.append(eng.generate(prompt, ReusePolicy.blend(ratio=GATE_RATIO, force=True), max_new_tokens=1))
        kls.append(kl_divergence(f, blends[-1].first_logits))  # what the evals measure the bounds with
        agree.append(top1_agree(f, blends[-1].first_logits))
    kl, top1, reports = sum(kls) / len(kls), sum(agree) / len(agree), [b.report for b in blends]
    checks.append(_measured(CheckName.FIDELITY_KL, kl, bound[CheckName.FIDELITY_KL],
                            f"mean first-token KL(full || blend@{GATE_RATIO}) over {len(cal)} prompts", reports))
    checks.append(_measured(CheckName.FIDELITY_TOP1, top1, bound[CheckName.FIDELITY_TOP1],
                            f"first-token top-1 agreement of blend@{GATE_RATIO} with full prefill", reports))
    return GateResult(engine.model_name, engine.provenance.digest().hex(), tuple(checks))


def _measured(name: CheckName, figure: float, bound: float, detail: str, blends: list["ReuseReport"]
              ) -> CheckResult:
    """A check's result over the reports of the blends it ran. A blend the engine refused (a dynamic-NTK
    model past its original length, where a calibration prompt is computed in one pass) measured nothing:
    the check fails, its figure NaN, rather than passing on full prefill compared with itself."""
    refused = next((r.gate for r in blends if r.gate), "")
    if refused:
        return CheckResult.judged(name, math.nan, bound, f"{detail}: not measured, the blend was refused ({refused})")
    return CheckResult.judged(name, figure, bound, detail)


def beyond(actual: torch.Tensor, expected: torch.Tensor, rtol: float, per_row: bool = False) -> float:
    """How far ``actual`` strays from ``expected`` past a relative allowance: max |actual - expected|
    - rtol x |expected| over the elements (rtol 0: the plain max absolute difference).

    Args:
        actual, expected: tensors of one shape.
        rtol: the allowance, a share of the expected magnitude.
        per_row: the magnitude is the largest |expected| of the element's last-dim row: RoPE rotates
            pairs of a head's dims into each other, so a K element carries its partner's rounding, and
            every logit carries the rounding of the hidden row they all read.

    Returns:
        The largest excess (<= 0 when every element is within the allowance).
    """
    a, e = actual.float(), expected.float()
    mag = e.abs().amax(dim=-1, keepdim=True) if per_row else e.abs()
    return float(((a - e).abs() - rtol * mag).max())


def _relative(tol: Tol, what: str) -> str:
    return f" - {tol.gate_rtol:.3g} x {what} (two ulps of the dtype)" if tol.gate_rtol else ""


def gate_fingerprint(items: int = DEFAULT_GATE_ITEMS, dtype: torch.dtype = torch.float32,
                     kv_dtype: torch.dtype | None = None) -> str:
    """What a recorded result was measured under: the blend policy its fidelity check runs (the
    defaults of the day: selector, temperature, ...), the calibration prompts and the bounds
    (the dtype's mechanical bounds included).

    A record is only valid for the same fingerprint, so a release that changes a default blend
    setting or a bound runs the gate again once instead of trusting a verdict measured otherwise.

    Args:
        items: how many calibration prompts the fidelity check runs.
        dtype: the engine's compute dtype.
        kv_dtype: the dtype its KV is kept in; None: ``dtype``.

    Returns:
        The first 16 hex digits of a sha256 over those settings.
    """
    tol = gate_tol(dtype, kv_dtype)
    prompts = [[c.question, list(c.documents)] for c in calibration_items(items)]  # the text, not only the count
    cfg = {"policy": ReusePolicy.blend(ratio=GATE_RATIO, force=True).describe(), "rope": ROPE_POLICY.describe(),
           "items": items, "prompts": prompts,
           "kl_bound": KL_BOUND, "top1_bound": TOP1_BOUND,
           "mechanical": [tol.logits, tol.rope, tol.gate_rtol]}
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


def gate_path(engine: "Engine", items: int = DEFAULT_GATE_ITEMS) -> Path:
    """Where the gate result of the engine's provenance (under :func:`gate_fingerprint`) is recorded.

    Args:
        engine: the engine (its provenance, dtype and KV dtype name the file).
        items: how many calibration prompts the result was measured over.

    Returns:
        ``$KVBLEND_HOME/gate/<provenance hex>-<fingerprint>.json`` (it may not exist).
    """
    fingerprint = gate_fingerprint(items, engine.dtype, engine.kv_dtype)
    return kvblend_home() / "gate" / f"{engine.provenance.digest().hex()}-{fingerprint}.json"


def load_record(engine: "Engine") -> GateResult | None:
    """The recorded gate result for the engine's provenance, if any.

    A record that is absent, unreadable (not a regular file, over :data:`MAX_RECORD_BYTES`), not
    JSON, malformed (see :meth:`GateResult.from_dict`) or for another provenance is no record:
    the gate runs again and rewrites it. Only an absent one goes without a warning.

    Args:
        engine: the engine whose gate result is looked up (default calibration prompts).

    Returns:
        The result, or None where there is no valid record.
    """
    path = gate_path(engine)
    try:
        data = safeio.read_regular(path, MAX_RECORD_BYTES, follow_symlinks=True)
    except FileNotFoundError:
        return None
    except OSError as e:  # safeio.UnsafeFileError too: a FIFO, a directory, an oversized file
        log.warning("quality gate: ignoring the record %s (%s); the gate runs again", path, e)
        return None
    try:
        result = GateResult.from_dict(json.loads(data))
        want = engine.provenance.digest().hex()
        if result.provenance_sha256 != want:
            raise GateRecordError(f"recorded for provenance {result.provenance_sha256[:16]!r}.., not {want[:16]}..")
        bounds = check_bounds(engine.dtype, engine.kv_dtype)
        for c in result.checks:  # a verdict against another bound is not this gate's verdict
            if c.bound != bounds[c.name]:
                raise GateRecordError(f"check {c.name.value} measured against {c.bound!r:.20}, not {bounds[c.name]!r}")
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, GateRecordError
        log.warning("quality gate: ignoring the malformed record %s (%s: %s); the gate runs again",
                    path, type(e).__name__, str(e)[:120])
        return None
    return result


def record(engine: "Engine", result: GateResult, items: int = DEFAULT_GATE_ITEMS) -> None:
    """Write the result (of a run over ``items`` calibration prompts) atomically.

    Args:
        engine: the engine the result was measured on (it names the file, :func:`gate_path`).
        result: the gate's result.
        items: how many calibration prompts it ran over.

    Raises:
        OSError: the file could not be written (nothing is left half-written).
    """
    path = gate_path(engine, items)
    path.parent.mkdir(parents=True, exist_ok=True)
    safeio.atomic_write_text(path, json.dumps(result.to_dict(), indent=1))


@dataclass(frozen=True)
class GateVerdict:
    """Whether blending is allowed for a model, and what consulting the gate cost."""

    refused: str  # why blending is refused ("" when allowed)
    ran_s: float  # seconds the gate ran for this verdict (0 when a recorded result was used)


class QualityGate:
    """The gate an engine consults before blending: the recorded result for its
    provenance, or (first blend request for a model with none) a run, recorded.

    Args:
        progress: print a line per step of a run to stderr.
    """

    def __init__(self, progress: bool = True) -> None:
        self.progress = progress
        self._results: dict[str, GateResult] = {}  # record name (provenance + gate fingerprint) -> result
        self._lock = threading.Lock()  # two first blend requests at once: one runs the gate, the other waits for it

    def verdict(self, engine: "Engine") -> GateVerdict:
        """Consult (or run once and record) the gate for ``engine``'s model.

        Returns:
            The verdict; ``ran_s`` > 0 when the gate ran now (its time is not the request's).
        """
        with self._lock:
            return self._verdict(engine)

    def _verdict(self, engine: "Engine") -> GateVerdict:
        """:meth:`verdict` with the lock held."""
        digest = gate_path(engine).name  # the same key as the record: provenance and what the gate measures
        result, ran_s = self._results.get(digest) or load_record(engine), 0.0
        if result is None:
            if self.progress:
                print(f"kvblend: first blend request for {engine.model_name}: running the quality gate "
                      "(kvblend check) once", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            result = run_gate(engine, progress=self.progress)  # raising (Ctrl-C, blend.cancel): kept nowhere
            try:
                record(engine, result)
            except OSError as e:  # a read-only home, a directory at the path: the verdict still holds here
                log.warning("quality gate: could not record the result at %s (%s); it holds for this process "
                            "and the gate runs again in the next one", gate_path(engine), e)
            ran_s = time.perf_counter() - t0
        self._results[digest] = result
        if result.passed:
            return GateVerdict("", ran_s)
        return GateVerdict(f"model failed the blend quality gate ({result.summary()}); computed fully; "
                           "force blending with --force-blend / ReusePolicy.blend(force=True)", ran_s)
