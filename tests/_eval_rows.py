"""Complete eval rows (blend.evals.rows) for tests that set a few fields; the rest are plausible values."""

from __future__ import annotations

from typing import Any

from blend.evals.rows import ItemRow, MethodRow

METHOD_DEFAULTS: dict[str, Any] = dict(
    prediction="x", answer_tokens=1, f1=0.0, em=0.0, rouge_l=0.0, contains=0.0, agreement=1.0, same_tokens=1,
    kl=0.0, top1=1.0, tf_agreement=1.0, tf_kl=0.0, ttft_s=0.1, ttft_samples=(0.1,), ttft_ratio=1.0, ttft_ref_s=0.1,
    threads=1, first_token_margin=None, guarded=False, applied="blend", recomputed_tokens=0, reused_tokens=0, prompt_tokens=10,
    recomputed_frac=0.0, computed_frac=1.0,
)


def method_row(**fields: Any) -> MethodRow:
    """A method row: :data:`METHOD_DEFAULTS` with ``fields`` over them."""
    return MethodRow(**{**METHOD_DEFAULTS, **fields})


def item_row(index: int, methods: dict[str, MethodRow], **fields: Any) -> ItemRow:
    """An item row holding ``methods``, its other fields plausible (``fields`` over them)."""
    base: dict[str, Any] = dict(index=index, id=str(index), question=f"q{index}?", item_sha256="0" * 64,
                                answers=("a",), prompt_tokens=10, full_answer="x", ref_margin=1.0)
    return ItemRow(**{**base, **fields, "methods": methods})


def item_json(index: int, methods: dict[str, dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """:func:`item_row`'s JSON, each method ``{field: value}`` over :data:`METHOD_DEFAULTS`."""
    return item_row(index, {n: method_row(**m) for n, m in methods.items()}, **fields).to_json()
