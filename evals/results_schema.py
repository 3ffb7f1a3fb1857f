"""results.json: the fields ``kvblend eval`` writes, the validator every reader runs it through, and the
atomic write.

A results object is ``{schema_version, config, model, versions, machine, reference, methods: {name:
aggregate}, items: [item row]}`` (:data:`TOP_LEVEL`); its items are :class:`~blend.evals.rows.ItemRow`
JSON. :func:`validate_results` names the first fault by its path; a file that is not a results object
raises only :class:`SchemaError`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from blend import safeio
from blend.evals.methods import REFERENCE, MethodKind
from blend.evals.rows import (
    FieldTypes, ItemRow, RowError, brief, brief_list, check_fields, is_count, is_number, is_str, list_of, or_null,
)
from blend.numeric import finite_real

AGG_NUMBERS = (
    "f1", "em", "rouge_l", "contains", "agreement", "kl", "top1", "tf_agreement", "tf_kl", "ttft_median_s",
    "ttft_p90_s", "ttft_ratio", "ttft_ratio_mean", "recomputed_frac", "computed_frac", "recomputed_tokens",
    "prompt_tokens",
)
# Written since issue 14 (absent from older results.json; checked when present).
TAIL_NUMBERS = ("kl_median", "kl_p90", "kl_max")
TAIL_CIS = ("kl_ci", "kl_median_ci", "top1_ci", "tf_agreement_ci")
ROW_NUMBERS = (
    "f1", "em", "rouge_l", "contains", "agreement", "kl", "top1", "tf_agreement", "tf_kl", "ttft_s", "ttft_ratio",
    "recomputed_frac", "computed_frac",
)
ROW_INTS = ("answer_tokens", "recomputed_tokens", "reused_tokens", "prompt_tokens")
ROW_INTS_SINCE = ("same_tokens",)  # written since 2026-12-06 (17); checked when present
TOP_LEVEL = {
    "schema_version": int, "config": dict, "model": dict, "versions": dict, "machine": dict,
    "reference": str, "methods": dict, "items": list,
}
_KINDS = frozenset(k.value for k in MethodKind)
_NUMBER_OR_NULL = (or_null(is_number), "a finite number or null")
_STR_OR_NULL = (or_null(is_str), "a string or null")
# a method's ``spec`` (evals.methods.Method.to_dict), as far as the readers of results.json use it (compare's
# plot and table, research_summary); a spec written before an option existed lacks it, and fields written since
# are kept unchecked
SPEC_TYPES: FieldTypes = {
    "kind": (lambda x: isinstance(x, str) and x in _KINDS, f"one of {sorted(_KINDS)}"),
    "ratio": _NUMBER_OR_NULL, "selector": _STR_OR_NULL,
    "check_layers": (or_null(list_of(is_count)), "a list of layer numbers or null"),
    "auto": (or_null(lambda x: isinstance(x, bool)), "true, false or null"), "auto_target": _NUMBER_OR_NULL,
    "probe_precision": _STR_OR_NULL,
    "guard": (or_null(lambda x: isinstance(x, list) and len(x) == 2 and all(or_null(is_number)(v) for v in x)),
              "[margin, ratio] (numbers or null) or null"),
    "candidates": (or_null(lambda x: x == "off" or is_number(x)), "a finite number, \"off\" or null"),
    "temperature": _NUMBER_OR_NULL, "guard_mode": _STR_OR_NULL, "attention_precision": _STR_OR_NULL,
    "linear_precision": _STR_OR_NULL,
}
# Metrics in [0, 1].
UNIT = ("f1", "em", "rouge_l", "contains", "agreement", "top1", "tf_agreement", "recomputed_frac", "computed_frac")


class SchemaError(ValueError):
    """results.json does not follow the documented schema."""


def _num(x: Any) -> bool:
    return x is None or (isinstance(x, (int, float)) and finite_real(x))  # (10**400 is no float)


def _ci_ok(x: Any) -> bool:
    return x is None or (isinstance(x, list) and len(x) == 2 and all(_num(v) and v is not None for v in x)
                         and x[0] <= x[1])


def validate_results(obj: Any) -> None:
    """Check a results object against the schema (:mod:`blend.evals.report`'s docstring lays it out).

    Args:
        obj: the decoded results.json.

    Raises:
        SchemaError: naming the first offending path.
    """
    if not isinstance(obj, dict):
        raise SchemaError("results: must be an object")
    for key, typ in TOP_LEVEL.items():
        if key not in obj:
            raise SchemaError(f"results.{key}: missing")
        if not isinstance(obj[key], typ) or isinstance(obj[key], bool):
            raise SchemaError(f"results.{key}: must be {typ.__name__}, got {type(obj[key]).__name__}")
    if obj["schema_version"] != 1:
        raise SchemaError(f"results.schema_version: unknown version {obj['schema_version']}")
    for key in ("name", "dtype", "provenance"):
        if key not in obj["model"]:
            raise SchemaError(f"results.model.{key}: missing")
    for key in ("name", "dtype"):
        if not is_str(obj["model"][key]):
            raise SchemaError(f"results.model.{key}: must be a string (of valid Unicode)")
    if not or_null(is_str)(obj["config"].get("data")):
        raise SchemaError("results.config.data: must be a string (of valid Unicode) or null")
    names = list(obj["methods"])
    if not all(is_str(n) for n in names):
        raise SchemaError("results.methods: a method name is not valid Unicode (a lone surrogate)")
    if REFERENCE not in names:
        raise SchemaError("results.methods: the reference 'full' is missing")
    for name, agg in obj["methods"].items():
        where = f"results.methods[{brief(name)}]"  # names come from the file: shown briefly
        if not isinstance(agg, dict):
            raise SchemaError(f"{where}: must be an object")
        for f in AGG_NUMBERS:
            if f not in agg or not _num(agg[f]):
                raise SchemaError(f"{where}.{f}: missing or not a finite number/null")
        for f in UNIT:
            if agg[f] is not None and not 0.0 <= agg[f] <= 1.0:
                raise SchemaError(f"{where}.{f}: {agg[f]} outside [0, 1]")
        if agg["kl"] is not None and agg["kl"] < 0:
            raise SchemaError(f"{where}.kl: negative")
        for f in ("f1_ci", "ttft_ratio_ci"):
            if f not in agg or not _ci_ok(agg[f]):
                raise SchemaError(f"{where}.{f}: must be [low, high] or null")
        for f in TAIL_NUMBERS:
            if f in agg and not _num(agg[f]):
                raise SchemaError(f"{where}.{f}: not a finite number/null")
        for f in TAIL_CIS:
            if f in agg and not _ci_ok(agg[f]):
                raise SchemaError(f"{where}.{f}: must be [low, high] or null")
        if not isinstance(agg.get("n"), int) or agg["n"] < 0:
            raise SchemaError(f"{where}.n: must be a non-negative integer")
        _check_spec(agg.get("spec"), f"{where}.spec")
    for i, row in enumerate(obj["items"]):
        where = f"results.items[{i}]"
        if not isinstance(row, dict):
            raise SchemaError(f"{where}: must be an object")
        for f, typ in (("index", int), ("id", str), ("question", str), ("answers", list), ("methods", dict)):
            if not isinstance(row.get(f), typ):
                raise SchemaError(f"{where}.{f}: missing or not {typ.__name__}")
        if "ref_margin" in row and not _num(row["ref_margin"]):
            raise SchemaError(f"{where}.ref_margin: not a finite number/null")
        if set(row["methods"]) != set(names):
            lacks, extra = sorted(set(names) - set(row["methods"])), sorted(set(row["methods"]) - set(names))
            raise SchemaError(f"{where}.methods: lacks [{brief_list(lacks)}], has unexpected [{brief_list(extra)}]")
        for name, r in row["methods"].items():
            w = f"{where}.methods[{brief(name)}]"
            if not isinstance(r, dict):
                raise SchemaError(f"{w}: must be an object")
            if not isinstance(r.get("prediction"), str):
                raise SchemaError(f"{w}.prediction: missing or not a string")
            for f in ROW_NUMBERS:
                if f not in r or not _num(r[f]):
                    raise SchemaError(f"{w}.{f}: missing or not a finite number/null")
            for f in ROW_INTS:
                if not isinstance(r.get(f), int):
                    raise SchemaError(f"{w}.{f}: missing or not an integer")
            for f in ROW_INTS_SINCE:
                if f in r and (not isinstance(r[f], int) or isinstance(r[f], bool) or r[f] < 0):
                    raise SchemaError(f"{w}.{f}: not a non-negative integer")
            if not isinstance(r.get("ttft_samples"), list) or not all(_num(v) for v in r["ttft_samples"]):
                raise SchemaError(f"{w}.ttft_samples: must be a list of numbers")
            if "ttft_ref_s" in r and not _num(r["ttft_ref_s"]):
                raise SchemaError(f"{w}.ttft_ref_s: not a finite number/null")
            if r.get("threads") is not None and (not isinstance(r["threads"], int) or r["threads"] < 1):
                raise SchemaError(f"{w}.threads: must be a positive integer or null")
        try:  # what the readers of results.md parse it as (the checks above name the common faults)
            ItemRow.from_json(row)
        except RowError as e:
            raise SchemaError(f"results.items[{i}]: {e}") from None
    for name, agg in obj["methods"].items():
        if agg["n"] != sum(1 for row in obj["items"] if name in row["methods"]):
            raise SchemaError(f"results.methods[{brief(name)}].n: does not match the item rows")


def _check_spec(spec: Any, where: str) -> None:
    """A method's ``spec``: absent (None here), or an object of :data:`SPEC_TYPES`, a blend's with its ratio.

    Raises:
        SchemaError: naming the field under ``where``.
    """
    if spec is None:
        return
    try:
        check_fields(spec, SPEC_TYPES, where, optional=frozenset(SPEC_TYPES) - {"kind"}, others=True)
    except RowError as e:
        raise SchemaError(str(e)) from None
    if spec["kind"] == MethodKind.BLEND.value and not (is_number(spec.get("ratio")) and 0 <= spec["ratio"] <= 1):
        raise SchemaError(f"{where}.ratio: a blend's must be a number in [0, 1]")


def write_json(results: dict[str, Any], path: Path) -> None:
    """Validate and write results.json (atomically).

    Args:
        results: the results object.
        path: where it goes.

    Raises:
        SchemaError: the object is not a valid results object (nothing is written).
        OSError: the write failed.
    """
    validate_results(results)
    safeio.atomic_write_text(path, json.dumps(results, indent=1, sort_keys=False) + "\n")
