"""The answer text's cost per token: :class:`~blend.detokenize.IncrementalText` against decoding the
whole answer at every step (what ``TokenStream`` did before), on the real tokenizer, one process.

    python -m blend.evals.bench_detokenize [--tokens 4000] [--model smollm2-135m]

The answer is README.md's tokens (prose, code, non-ASCII); both ways must give the same text at the
end. Prints the total and per-token time of each and their ratio.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from blend.defaults import DEFAULT_MODEL
from blend.detokenize import IncrementalText


def measure(tokenizer, ids: list[int]) -> tuple[float, float]:
    """Seconds to keep the text of ``ids`` current token by token: (incremental, whole decode per step).

    Raises:
        RuntimeError: the two texts differ.
    """
    t0 = time.perf_counter()
    inc = IncrementalText(tokenizer)
    for i in ids:
        inc.push(i)
    t_inc = time.perf_counter() - t0
    t0 = time.perf_counter()
    full = ""
    for n in range(1, len(ids) + 1):
        full = tokenizer.decode(ids[:n], skip_special_tokens=True)
    t_full = time.perf_counter() - t0
    if inc.text != full:
        raise RuntimeError("the incremental text differs from the whole decode")
    return t_inc, t_full


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blend.evals.bench_detokenize", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    args = ap.parse_args(argv)
    from blend.models import load_model

    tok = load_model(args.model).tokenizer
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    ids = tok(text)["input_ids"][: args.tokens]
    t_inc, t_full = measure(tok, ids)
    n = len(ids)
    print(f"{n} tokens: incremental {t_inc * 1e3:.0f} ms ({t_inc / n * 1e6:.1f} us/token); whole decode per step "
          f"{t_full * 1e3:.0f} ms ({t_full / n * 1e6:.0f} us/token); {t_full / t_inc:.0f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
