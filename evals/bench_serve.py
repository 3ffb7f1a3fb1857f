"""Serving benchmark: ``kvblend serve`` under 1, 4 and 16 concurrent clients, exact and blend@0.15.

Workload (the demo corpus, blend/data/demo): 18 requests; request j asks
question j mod 6 over its source document and two others, in an order that
rotates with j, so the same documents come back in different orders. Every
request is sent once per mode before timing (the warm-up: it stores every
chunk and warms the blend quality gate), and the timed clients send the same
18 prompts again (later timed requests repeat earlier ones), with one cache
salt per mode. So the two modes measure different things:

- exact: repeated prompts. Every timed request finds its whole document
  prefix stored (every document an exact hit; only the question is
  computed): the best case for exact prefix reuse, not a RAG workload where
  documents come back in new orders.
- blend: the first document is exact at its place after the preamble, the
  others are stored chunks reused at a new position and partly recomputed
  (every document exact only for an order refined while idle,
  ``--refine-after``).

The table's "documents all exact" column counts, for every mode, the requests
whose report says every document was exact (every exact request here).
Answers have a fixed length (``ignore_eos``).
Each client is closed-loop: it sends its next request when the previous one
finished (streamed; TTFT = first SSE chunk, which carries the first token).
Answers are 128 tokens by default (the usual output length of serving
benchmarks, a few sentences): long enough that batched decoding, which issue
16's tokens/s target measures, is most of a request. With ``--max-tokens 32``
a blend request is mostly its prefill, and 16 clients measure the prefill's
throughput on the machine's cores instead (BENCHMARKS.md, "Idle-time
refinement and 128-token answers").

Overhead of the server over the Python API for one request: the same
requests one at a time through the server (HTTP, streamed) and through
``blend.generation.generate`` in this process, interleaved, with the same
intra-op thread count; reported as the median of the paired differences
(e2e), on the benchmark's model and on a tiny model (where compute is small
and the difference is not lost in noise).

    python -m blend.evals.bench_serve [--model smollm2-135m] [--clients 1,4,16] [--modes exact,blend@0.15]
           [--requests-per-client 4] [--max-tokens 128] [--overhead-requests 20] [--out DIR]
           [--server-args '--share-decode-min-batch 0']
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch

from blend.defaults import DEFAULT_MODEL, DEFAULT_RATIO
from blend.engine import Engine
from blend.evals.decode_scaling import decode_scaling
from blend.evals.demo_requests import demo_requests
from blend.evals.metrics import percentile
from blend.evals.paths import ran_own_path
from blend.generation import generate
from blend.policy import ReuseMode, ReusePolicy
from blend.sampling import GenerationConfig
from blend.serve.config import default_torch_threads
from blend import safeio



@dataclass(frozen=True)
class Sample:
    ttft_s: float
    e2e_s: float
    tokens: int
    server_e2e_s: float  # inside the server: submission to the scheduler -> last token
    guarded: bool = False  # the near-tie guard blended this request again (its report says so)
    gaps_s: tuple[float, ...] = ()  # between consecutive text chunks of the stream (inter-token latency)
    exact_docs: bool = False  # the report says every document was exact (any mode; see the module docstring)
    applied: str = ""  # the path that produced the prompt's KV, as the report says (none: reuse refused)


@dataclass(frozen=True)
class Row:
    mode: str
    clients: int
    requests: int
    req_per_s: float
    out_tok_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float  # of ``requests`` samples: with under 100 it is near the max (see tail_cell)
    e2e_p50_ms: float
    e2e_p99_ms: float
    guarded: int = 0  # requests the near-tie guard blended again
    itl_p50_ms: float = 0.0  # inter-token gaps over every stream of the run
    itl_p99_ms: float = 0.0
    itl_max_ms: float = 0.0
    # requests whose documents were all exact: every exact request here (repeated prompts, the whole
    # document prefix stored: exact's best case); a blend only for an order refined while idle
    exact_docs: int = 0
    ttft_max_ms: float = 0.0  # the largest sample (what the table shows for a tail of under 100 samples)
    e2e_max_ms: float = 0.0
    # requests whose report says another path produced their KV than the mode's own (ran_own): a blend the
    # server's quality gate refused ran none, a full prefill, and was timed under the blend's name
    other_path: int = 0


# Under this many samples the table shows a tail as the max, not as p99. ``metrics.percentile`` is numpy's
# linear interpolation: p99 of n samples sits at rank 0.99 * (n - 1), which for n <= 100 lies between the
# two largest samples (at n = 4 it is 97% of the way to the max, at n = 16 85%): not a p99 at all, just
# an interpolated max.
TAIL_MIN_SAMPLES = 100


def tail_cell(p99: float, largest: float, n: int) -> str:
    """A table cell for a tail latency of ``n`` samples: the p99, or ``max X`` under TAIL_MIN_SAMPLES
    (the p99 itself, marked with n, for a row that recorded no max)."""
    if n >= TAIL_MIN_SAMPLES:
        return f"{p99:.0f}"
    return f"max {largest:.0f}" if largest else f"{p99:.0f} (n={n})"


def policy_body(mode: str) -> dict:
    if mode == "exact":
        return {"reuse": "exact"}
    ratio = float(mode.split("@", 1)[1]) if "@" in mode else DEFAULT_RATIO
    return {"reuse": "blend", "ratio": ratio}


def own_path(mode: str) -> str:
    """The path (a report's ``applied``) a mode's requests should run: ``exact`` or ``blend``."""
    return policy_body(mode)["reuse"]


def ran_own(mode: str, sample: Sample) -> bool:
    """Whether a request ran its mode's own path (:func:`blend.evals.paths.ran_own_path`: a blend that its
    near-tie guard recomputed on the exact path ran its own; a request without a report did not)."""
    try:
        applied = ReuseMode(sample.applied)
    except ValueError:
        return False
    return ran_own_path(ReuseMode(own_path(mode)), applied, sample.guarded)


def policy_of(mode: str) -> ReusePolicy:
    body = policy_body(mode)
    return ReusePolicy.exact() if body["reuse"] == "exact" else ReusePolicy.blend(ratio=body["ratio"])


def one_request(http: httpx.Client, model: str, question: str, docs: list[str], mode: str, max_tokens: int) -> Sample:
    """One streamed chat request; TTFT at the first chunk."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "documents": docs,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "kvblend": policy_body(mode),
            # one salt per mode: a blend must not find the exact mode's stored prefixes of the same
            # prompts (it would take them: an exact hit, not the blend being measured)
            "cache_salt": f"bench:{mode}"}
    t0 = time.perf_counter()
    ttft, tokens, inside, guarded, exact_docs, applied = None, 0, 0.0, False, False, ""
    text_at: list[float] = []
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            if line != "data: [DONE]":
                msg = json.loads(line[6:])
                if msg.get("usage"):
                    tokens = msg["usage"]["completion_tokens"]
                if msg.get("kvblend"):
                    inside = msg["kvblend"]["e2e_s"]
                    report = msg["kvblend"].get("report", {})
                    guarded = bool(report.get("guard"))
                    applied = str(report.get("applied", ""))
                    docs = [g for g in report.get("segments", ()) if g.get("kind") == "document"]
                    exact_docs = bool(docs) and all(g.get("class") == "exact" for g in docs)
                if any(c.get("delta", {}).get("content") for c in msg.get("choices", ())):
                    text_at.append(now)
    gaps = tuple(b - a for a, b in zip(text_at, text_at[1:]))
    return Sample(ttft, time.perf_counter() - t0, tokens, inside, guarded, gaps, exact_docs, applied)


def run_clients(url: str, model: str, mode: str, clients: int, per_client: int, max_tokens: int,
                reqs: list[tuple[str, list[str]]]) -> Row:
    """``clients`` closed-loop clients, ``per_client`` requests each."""
    samples: list[Sample] = []
    lock = threading.Lock()
    errors: list[str] = []

    def client(c: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            for k in range(per_client):
                question, docs = reqs[(c * per_client + k) % len(reqs)]
                try:
                    s = one_request(http, model, question, docs, mode, max_tokens)
                except Exception as e:  # noqa: BLE001 - reported, and the run fails below
                    errors.append(str(e))
                    return
                with lock:
                    samples.append(s)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    ttft = [s.ttft_s * 1000 for s in samples]
    e2e = [s.e2e_s * 1000 for s in samples]
    gaps = [g * 1000 for s in samples for g in s.gaps_s] or [0.0]
    return Row(mode, clients, len(samples), len(samples) / wall, sum(s.tokens for s in samples) / wall,
               percentile(ttft, 50), percentile(ttft, 99), percentile(e2e, 50), percentile(e2e, 99),
               sum(s.guarded for s in samples), percentile(gaps, 50), percentile(gaps, 99), max(gaps),
               sum(s.exact_docs for s in samples), max(ttft), max(e2e),
               sum(not ran_own(mode, s) for s in samples))


def start_server(model: str, port: int, max_concurrency: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "blend.cli", "serve", "--model", model, "--store", "memory", "--port", str(port),
           "--max-concurrency", str(max_concurrency), "--max-queue", "256", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not come up")


def overhead(url: str, model: str, engine: Engine, mode: str, n: int, max_tokens: int,
             reqs: list[tuple[str, list[str]]]) -> dict:
    """One request at a time, server and Python API interleaved.

    Returns the paired e2e difference (server over HTTP minus Python API; compute
    noise of a busy machine lands in it) and the server's own layers: client e2e
    minus the time inside the scheduler minus prompt building (which the Python
    API does too) = HTTP, validation, event delivery and thread hand-offs.
    """
    cfg = GenerationConfig(max_tokens=max_tokens, ignore_eos=True)
    policy = policy_of(mode)
    diffs, layers, server, api = [], [], [], []
    with httpx.Client(base_url=url, timeout=600) as http:
        for i in range(n):
            question, docs = reqs[i % len(reqs)]
            s = one_request(http, model, question, docs, mode, max_tokens)
            t0 = time.perf_counter()
            prompt = engine.build_prompt(question, docs)
            t_prompt = time.perf_counter() - t0
            generate(engine, prompt, policy, cfg)
            a = time.perf_counter() - t0
            server.append(s.e2e_s * 1000)
            api.append(a * 1000)
            diffs.append((s.e2e_s - a) * 1000)
            layers.append((s.e2e_s - s.server_e2e_s - t_prompt) * 1000)
    return {"model": model, "mode": mode, "requests": n, "max_tokens": max_tokens,
            "server_e2e_p50_ms": statistics.median(server), "api_e2e_p50_ms": statistics.median(api),
            "paired_diff_p50_ms": statistics.median(diffs), "server_layers_p50_ms": statistics.median(layers)}


def measure_overhead(model: str, mode: str, n: int, max_tokens: int, port: int,
                     reqs: list[tuple[str, list[str]]]) -> dict:
    proc = start_server(model, port, 16, [])
    try:
        url = f"http://127.0.0.1:{port}"
        engine = Engine.load(model)
        with httpx.Client(base_url=url, timeout=600) as http:  # warm both sides alike
            for question, docs in reqs:
                one_request(http, model, question, docs, mode, 2)
                generate(engine, engine.build_prompt(question, docs), policy_of(mode), GenerationConfig(max_tokens=2))
        return overhead(url, model, engine, mode, n, max_tokens, reqs)
    finally:
        proc.terminate()
        proc.wait(30)


def markdown(rows: list[Row], overheads: list[dict], command: str, scaling: list[dict] | None = None,
             load: tuple[float, float] = (0.0, 0.0)) -> str:
    lines = [f"Command: `{command}`", "",
             f"Machine: {os.cpu_count()} cores; 1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} "
             "at the end (other jobs share the cores).", "",
             "| mode | clients | requests | req/s | out tok/s | TTFT p50 ms | TTFT p99 (or max) ms | e2e p50 ms "
             "| e2e p99 (or max) ms "
             "| inter-token p50 / p99 / max ms | guarded | documents all exact | other path |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.mode} | {r.clients} | {r.requests} | {r.req_per_s:.2f} | {r.out_tok_per_s:.1f} | "
                     f"{r.ttft_p50_ms:.0f} | {tail_cell(r.ttft_p99_ms, r.ttft_max_ms, r.requests)} | "
                     f"{r.e2e_p50_ms:.0f} | {tail_cell(r.e2e_p99_ms, r.e2e_max_ms, r.requests)} | "
                     f"{r.itl_p50_ms:.0f} / {r.itl_p99_ms:.0f} / {r.itl_max_ms:.0f} | {r.guarded} | "
                     f"{r.exact_docs} | {r.other_path} |")
    lines += ["",
              "exact rows repeat the warm-up's prompts: every timed exact request finds its whole document "
              "prefix stored (all documents exact, only the question computed), the best case for exact reuse; "
              "blend rows reuse every document after the first at a new position (all exact only for orders "
              "refined while idle).",
              "\"other path\": requests whose report says their KV came from another path than the mode's (a blend "
              "refused by the server's quality gate ran none, a full prefill).",
              f"TTFT and e2e tails from fewer than {TAIL_MIN_SAMPLES} requests are shown as `max N` (the largest "
              "sample; a p99 of so few is an interpolated max); the JSON keeps the p99 and the max.",
              "", "Targets:"]
    lines += [f"- WARNING: {r.mode} at {r.clients} clients: {r.other_path} of {r.requests} requests ran another "
              f"path than {own_path(r.mode)} (their TTFT is not this mode's)" for r in rows if r.other_path]
    for mode in sorted({r.mode for r in rows}):
        by = {r.clients: r for r in rows if r.mode == mode}
        if 1 in by and 16 in by:
            lines.append(f"- {mode}: out tok/s at 16 clients / 1 client = "
                         f"{by[16].out_tok_per_s / by[1].out_tok_per_s:.2f}x (target >= 4x)")
        if 1 in by and 4 in by:
            lines.append(f"- {mode}: TTFT p50 at 4 clients / 1 client = "
                         f"{by[4].ttft_p50_ms / by[1].ttft_p50_ms:.2f}x (target <= 2x for blend)")
    if scaling:
        base = scaling[0]["tok_per_s"]
        lines.append("- decode steps alone (batched forward, one thread, no prefill beside): " + ", ".join(
            f"batch {x['batch']}: {x['step_ms']:.0f} ms/step, {x['tok_per_s']:.1f} tok/s ({x['tok_per_s'] / base:.1f}x)"
            for x in scaling))
        lines.append("- the same steps over slots of a decode pool (the server's default): " + ", ".join(
            f"batch {x['batch']}: {x['pool_step_ms']:.0f} ms/step, {x['pool_tok_per_s']:.1f} tok/s "
            f"({x['pool_tok_per_s'] / base:.1f}x)" for x in scaling))
        lines.append("- the same steps split in halves over two threads (a decode share on an idle prefill "
                     "worker): " + ", ".join(
                         f"batch {x['batch']}: {x['split_step_ms']:.0f} ms/step, {x['split_tok_per_s']:.1f} tok/s "
                         f"({x['split_tok_per_s'] / base:.1f}x)" for x in scaling if x["batch"] >= 2))
    for o in overheads:
        lines.append(f"- server over Python API, one request ({o['model']}, {o['mode']}, {o['max_tokens']} tokens, "
                     f"{o['requests']} paired): e2e p50 {o['server_e2e_p50_ms']:.1f} ms vs {o['api_e2e_p50_ms']:.1f} ms, "
                     f"paired difference p50 {o['paired_diff_p50_ms']:.1f} ms; the server's own layers (HTTP, "
                     f"events, hand-offs) p50 {o['server_layers_p50_ms']:.1f} ms (target <= 5 ms)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--modes", default="exact,blend@0.15")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--overhead-requests", type=int, default=20)
    p.add_argument("--overhead-tiny-model", default="tiny-llama")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--out", default="bench_serve_out")
    p.add_argument("--server-args", default="", help="extra `kvblend serve` arguments, e.g. "
                   "'--share-decode-min-batch 0' to measure without decode shares")
    args = p.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]
    modes = args.modes.split(",")
    reqs = demo_requests()
    torch.set_num_threads(default_torch_threads(1))  # the server's per-thread count, for the Python API side
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    load_start = os.getloadavg()[0]
    proc = start_server(args.model, args.port, max(clients), args.server_args.split())
    try:
        url = f"http://127.0.0.1:{args.port}"
        with httpx.Client(base_url=url, timeout=600) as http:
            for mode in modes:  # warm every chunk (and the blend quality gate) before timing; twice, so that an
                for _ in range(2):  # exact prompt's prefix is hot for its every timed request, at any client count
                    for question, docs in reqs:
                        one_request(http, args.model, question, docs, mode, 2)
        for mode in modes:
            for c in clients:
                row = run_clients(url, args.model, mode, c, args.requests_per_client, args.max_tokens, reqs)
                rows.append(row)
                print(json.dumps(asdict(row)), flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    overheads = []
    for model in [args.overhead_tiny_model, args.model]:
        if model and args.overhead_requests:
            o = measure_overhead(model, "exact", args.overhead_requests, 8 if model != args.model else 4,
                                 args.port + 1, reqs)
            overheads.append(o)
            print(json.dumps(o), flush=True)
    scaling = decode_scaling(args.model, clients)
    print(json.dumps(scaling), flush=True)
    command = "python -m blend.evals.bench_serve " + " ".join(argv if argv is not None else sys.argv[1:])
    md = markdown(rows, overheads, command.strip(), scaling, (load_start, os.getloadavg()[0]))
    safeio.atomic_write_text(out / "bench_serve.json", json.dumps({
                                                      "rows": [asdict(r) for r in rows], "overhead": overheads,
                                                      "decode_scaling": scaling, "cpu_count": os.cpu_count(),
                                                      "load_avg": os.getloadavg()}, indent=2))
    safeio.atomic_write_text(out / "bench_serve.md", md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
