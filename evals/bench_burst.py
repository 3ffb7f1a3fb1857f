"""Burst into an idle server (in process, no HTTP): N requests submitted at once to a fresh scheduler
(one prefill worker, one intra-op thread per thread), with and without the decode loop taking
prefills while it has nothing to decode; TTFT p50 / max and the burst's wall time, medians over
repeats, interleaved.

    python -m blend.evals.bench_burst exact|blend [--requests 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

from blend.evals.demo_requests import demo_requests
from blend.evals.environment import describe_environment
from blend.evals.paths import ran_own_path
from blend.defaults import DEFAULT_MODEL, DEFAULT_RATIO
from blend.engine import Engine
from blend.policy import ReusePolicy
from blend.sampling import GenerationConfig
from blend.serve.config import SchedulerConfig
from blend.serve.jobs import EventKind
from blend.serve.scheduler import Scheduler


def burst(engine: Engine, prompts: list, policy: ReusePolicy, allowed: bool, n: int
          ) -> tuple[float, float, float, int]:
    """One burst of ``n`` requests into a fresh scheduler: (TTFT p50 s, TTFT max s, wall s, requests whose
    report says another path than the policy's mode produced their KV: a refused blend ran none)."""
    sched = Scheduler(engine, SchedulerConfig(torch_threads=1, decode_loop_prefills=allowed))
    sched.start()
    time.sleep(0.2)  # every thread waiting
    lock, ttft, done, other = threading.Lock(), [], threading.Semaphore(0), [0]

    def sink(ev) -> None:
        if ev.kind is EventKind.STARTED:
            with lock:
                ttft.append(ev.ttft_s)
                other[0] += ev.report is not None and not ran_own_path(policy.mode, ev.report.applied,
                                                                      bool(ev.report.guard))
        if ev.kind in (EventKind.DONE, EventKind.FAILED):
            done.release()

    t0 = time.perf_counter()
    for i in range(n):
        sched.submit(prompts[i % len(prompts)], policy,
                     GenerationConfig(max_tokens=16, ignore_eos=True, temperature=0), sink)
    for _ in range(n):
        done.acquire()
    wall = time.perf_counter() - t0
    sched.close()
    return statistics.median(ttft), max(ttft), wall, other[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m blend.evals.bench_burst", description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("exact", "blend"))
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    engine = Engine.load(args.model, quality_gate=False)
    prompts = [engine.build_prompt(q, d) for q, d in demo_requests()]
    policy = ReusePolicy.exact() if args.mode == "exact" else ReusePolicy.blend(ratio=DEFAULT_RATIO)
    for _ in range(2):  # warm every chunk, then every prompt's hot prefix: each timed burst starts the same
        for p in prompts:
            engine.prefill(p, policy, 1)
    res: dict[bool, list[tuple[float, float, float, int]]] = {True: [], False: []}
    for r in range(args.repeats):
        for allowed in ((True, False) if r % 2 == 0 else (False, True)):  # alternated per repeat
            res[allowed].append(burst(engine, prompts, policy, allowed, args.requests))
    machine = describe_environment(engine.device)["machine"]
    print(f"{machine['platform']}, {machine['cpu_count']} CPUs, load average {machine['load_average']}; "
          f"{engine.dtype}, one intra-op thread per scheduler thread; medians of {args.repeats} bursts")
    for allowed, rows in res.items():
        p50, mx, wall = (statistics.median(r[i] for r in rows) for i in range(3))
        name = "decode loop prefills too" if allowed else "worker only"
        other = sum(r[3] for r in rows)
        print(f"{args.mode}, {args.requests} requests, {name}: TTFT p50 {p50:.2f} s, max {mx:.2f} s, wall {wall:.2f} s"
              + (f" (WARNING: {other} of {len(rows) * args.requests} requests ran another path than {args.mode})"
                 if other else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
