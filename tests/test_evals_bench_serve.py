"""bench_serve's decode-step measurement: one thread, pooled caches, and the split a decode share makes."""

import pytest
import torch

from blend.evals.decode_scaling import decode_scaling


@pytest.fixture
def keeps_torch_threads():
    """bench_burst's schedulers set torch's thread count for the process: the test's is restored after."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_decode_scaling_times_the_step_alone_pooled_and_split_in_halves():
    threads = torch.get_num_threads()
    rows = decode_scaling("tiny-llama", [1, 3], steps=2)
    assert torch.get_num_threads() == threads  # it runs at the decode loop's one thread, then restores
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["step_ms"] > 0 and r["split_step_ms"] > 0 and r["pool_step_ms"] > 0
        assert abs(r["pool_tok_per_s"] - r["batch"] / (r["pool_step_ms"] / 1000)) < 1e-6 * r["pool_tok_per_s"]
        assert abs(r["tok_per_s"] - r["batch"] / (r["step_ms"] / 1000)) < 1e-6 * r["tok_per_s"]
    assert rows[0]["split_step_ms"] == rows[0]["step_ms"]  # one sequence is never split


def test_bench_burst_times_a_burst_with_and_without_decode_loop_prefills(capsys, keeps_torch_threads):
    from blend.evals.bench_burst import main

    assert main(["exact", "--model", "tiny-llama", "--requests", "3", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "decode loop prefills too: TTFT p50" in out and "worker only: TTFT p50" in out
    assert "load average" in out and "WARNING" not in out


def test_bench_burst_warns_of_requests_that_ran_another_path(capsys, monkeypatch, keeps_torch_threads):
    """A refused blend (a full prefill) was timed as the burst's blend request without a word."""
    import blend.engine
    import blend.serve.scheduler
    from blend.evals.bench_burst import main
    from blend.refusals import Refusal

    real = blend.engine.refusal_for

    def refusing(engine, prompt, policy, *lock):
        return Refusal("refused for the test") if policy.mode.value == "blend" else real(engine, prompt, policy, *lock)

    # the warm-up's direct prefills decide in the engine, the burst's requests in the scheduler (once, ahead)
    monkeypatch.setattr(blend.engine, "refusal_for", refusing)
    monkeypatch.setattr(blend.serve.scheduler, "refusal_for", refusing)
    assert main(["blend", "--model", "tiny-llama", "--requests", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "(WARNING: 2 of 2 requests ran another path than blend)" in out


def test_bench_clients_count_the_requests_the_near_tie_guard_blended_again():
    """run_clients reports how many answers the guard re-blended (a tiny model's first tokens are near
    ties, so every default blend is guarded there); exact answers never are; the table has the column."""
    from _serve_util import TINY, running_server, tiny_serve_engine
    from blend.evals.bench_serve import demo_requests, markdown, run_clients

    reqs = demo_requests()[:2]
    with running_server(tiny_serve_engine()) as srv:
        blend = run_clients(srv.url, TINY, "blend@0.15", 2, 1, 6, reqs)
        exact = run_clients(srv.url, TINY, "exact", 2, 1, 6, reqs)
    assert (blend.requests, blend.guarded) == (2, 2) and (exact.requests, exact.guarded) == (2, 0)
    for row in (blend, exact):  # six-token answers: gaps between a stream's text chunks
        assert 0 < row.itl_p50_ms <= row.itl_p99_ms <= row.itl_max_ms
    assert blend.other_path == 0 and exact.other_path == 0  # each ran its own path
    table = markdown([blend, exact], [], "cmd")
    assert "| guarded | documents all exact | other path |" in table and " | 2 | 0 | 0 |\n" in table
    assert "inter-token" in table and "WARNING" not in table


def test_bench_clients_count_requests_that_ran_another_path_than_their_mode():
    """A blend request the server refused (its quality gate, or here dynamic-NTK RoPE past its trained length,
    which refuses any reuse) runs none, a full prefill; bench_serve timed it as the mode's request without a
    word. The row now counts them and the table warns."""
    from _serve_util import running_server, tiny_serve_engine
    from blend.evals.bench_serve import markdown, run_clients
    from blend.serve.config import ServeConfig
    from blend.tiny import make_docs

    model = "tiny-llama-rope-dynamic"  # dynamic NTK past 512 positions (its context: 2048)
    reqs = [("Which word comes first?", make_docs(3, words=40))]  # ~800 byte tokens
    with running_server(tiny_serve_engine(model), ServeConfig(model=model)) as srv:
        blend = run_clients(srv.url, model, "blend@0.15", 2, 1, 2, reqs)
    assert (blend.requests, blend.other_path) == (2, 2)
    assert "- WARNING: blend@0.15 at 2 clients: 2 of 2 requests ran another path than blend" in markdown([blend], [], "c")
