"""bench_serve's table: the exact mode's all-exact count is printed, and a tail of few samples is a max."""

from blend.evals.bench_serve import TAIL_MIN_SAMPLES, Row, markdown, tail_cell
from blend.evals.metrics import percentile


def _row(mode: str, clients: int, requests: int, exact_docs: int, ttft_p99: float = 370.6, ttft_max: float = 371.0,
         e2e_p99: float = 2044.2, e2e_max: float = 2050.0) -> Row:
    return Row(mode, clients, requests, 1.0, 10.0, 300.0, ttft_p99, 1500.0, e2e_p99, itl_p50_ms=10.0,
               itl_p99_ms=20.0, itl_max_ms=30.0, exact_docs=exact_docs, ttft_max_ms=ttft_max, e2e_max_ms=e2e_max)


def _cells(table: str, mode: str, clients: int) -> list[str]:
    line = next(ln for ln in table.splitlines() if ln.startswith(f"| {mode} | {clients} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_the_exact_mode_prints_its_all_exact_count_and_the_table_says_what_it_measures():
    table = markdown([_row("exact", 1, 4, 4), _row("blend@0.15", 1, 4, 1)], [], "cmd")
    header = [c.strip() for c in table.splitlines()[4].strip("|").split("|")]
    col = header.index("documents all exact")
    assert _cells(table, "exact", 1)[col] == "4"  # not '-': exact requests repeat the warm-up's prompts
    assert _cells(table, "blend@0.15", 1)[col] == "1"
    assert "best case for exact reuse" in table and "whole document prefix" in table


def test_a_tail_of_fewer_than_100_samples_is_labelled_max():
    table = markdown([_row("exact", 1, 4, 4), _row("exact", 16, 128, 128, ttft_p99=512.4, e2e_p99=3001.0)],
                     [], "cmd")
    header = [c.strip() for c in table.splitlines()[4].strip("|").split("|")]
    ttft, e2e = header.index("TTFT p99 (or max) ms"), header.index("e2e p99 (or max) ms")
    few, many = _cells(table, "exact", 1), _cells(table, "exact", 16)
    assert (few[ttft], few[e2e]) == ("max 371", "max 2050")  # 4 samples: the max, not a "p99"
    assert (many[ttft], many[e2e]) == ("512", "3001")  # 128 samples: a p99
    assert tail_cell(370.6, 0.0, 4) == "371 (n=4)"  # a row without a recorded max says how few it had


def test_percentile_of_few_samples_is_an_interpolated_max():
    """Why the table says max: numpy's linear p99 of n <= 100 samples lies between the two largest."""
    for n in (4, 16, TAIL_MIN_SAMPLES):
        vals = [float(i) for i in range(n)]
        assert n - 2 < percentile(vals, 99) <= n - 1
    vals = [float(i) for i in range(TAIL_MIN_SAMPLES + 1)]
    assert percentile(vals, 99) == TAIL_MIN_SAMPLES - 1  # from 101 samples p99 is below the max
