"""The settings that define an evaluation run (:class:`EvalConfig`): apart from the harness, so that
``kvblend eval``'s parser takes its defaults from here without importing torch or the metrics."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from blend.defaults import DEFAULT_BOOTSTRAP_RESAMPLES

# Config fields that may differ between an interrupted run and its --resume
# (they change timings or the amount of work, never an item's quality row).
# ``methods`` may grow: a resumed run adds the new methods to the items done.
RESUME_FREE = ("limit", "items", "store", "repeats", "warmup", "bootstrap", "methods")


@dataclass(frozen=True)
class EvalConfig:
    """Everything that defines a run (recorded in results.json and run.json)."""

    data: str
    limit: int
    passages: int
    methods: tuple[str, ...]
    model: str
    dtype: str
    store: str | None = None
    max_new_tokens: int = 32
    repeats: int = 3
    warmup: int = 1
    seed: int = 0
    system: str | None = None
    bootstrap: int = DEFAULT_BOOTSTRAP_RESAMPLES
    items: str | None = None  # item range "A-B" of the data (overrides limit), e.g. the validation split

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        d = dataclasses.asdict(self)
        d["methods"] = list(self.methods)
        return d

    def identity(self) -> dict[str, Any]:
        """The fields that must match for --resume."""
        return {k: v for k, v in self.to_dict().items() if k not in RESUME_FREE}
