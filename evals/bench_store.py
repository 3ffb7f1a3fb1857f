"""Load throughput of each store tier, and what overlapped loading hides.

Entry: one SmolLM2-135M chunk (30 layers, 3 KV heads, head dim 64, ~600
tokens, fp32: 27.6 MB of k+v), five chunks per request.

    python evals/bench_store.py [--redis redis://HOST:PORT/DB] [--repeats 3] [--json out.json]

Tiers: memory (in-process LRU: a dict lookup), disk warm (files in the page
cache), disk cold (pages dropped with posix_fadvise(DONTNEED) before each
read), redis (a local redis-server, started here if --redis is not given and
the binary exists). Every load but memory decodes and verifies the checksum.
The overlap rows load the five chunks while a synthetic per-chunk compute
(GEMMs sized to take about as long as one load) runs in the main thread:
sequential = load then compute, chunk by chunk; prefetched = Prefetcher.stream.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from blend.keys import Namespace, Provenance, StoreKey, canonical_key
from blend.store.base import KVEntry, KVStore, LookupStatus
from blend.store.disk import DiskStore
from blend.store.memory import MemoryStore
from blend.store.prefetch import FetchRequest, Prefetcher
from blend.store.redis_store import RedisStore
from blend import safeio

L, HKV, D, T, CHUNKS = 30, 3, 64, 600, 5
NS = Namespace.CANONICAL


@dataclass(frozen=True)
class Row:
    tier: str
    kv_dtype: str
    mb_per_chunk: float
    load_ms_per_chunk: float  # median over repeats
    gb_per_s: float
    write_ms_per_chunk: float


def _prov(kv_dtype: str) -> Provenance:
    return Provenance("llama:smollm2-135m", "bench", "bench", "float32", kv_dtype, "cpu", "torch", '{"theta":1e5}')


def _entries(kv_dtype: str) -> list[tuple[StoreKey, KVEntry]]:
    prov = _prov(kv_dtype)
    out = []
    for i in range(CHUNKS):
        g = torch.Generator().manual_seed(i)
        k = torch.randn(L, HKV, T, D, generator=g).to(getattr(torch, kv_dtype))  # (L, Hkv, T, D)
        v = torch.randn(L, HKV, T, D, generator=g).to(getattr(torch, kv_dtype))  # (L, Hkv, T, D)
        out.append((canonical_key(prov, [1], [i]), KVEntry(k, v, prov.canonical_json())))
    return out


def _drop_cache(store: DiskStore, keys: list[StoreKey]) -> None:
    for key in keys:
        fd = os.open(store.path(NS, key), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(tier: str, store: KVStore, kv_dtype: str, repeats: int, before: Callable[[], None] = lambda: None) -> Row:
    entries = _entries(kv_dtype)
    prov = entries[0][1].provenance
    t0 = time.perf_counter()
    for key, e in entries:
        store.put(NS, key, e)
    write_s = (time.perf_counter() - t0) / CHUNKS
    times = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        for key, _e in entries:
            got = store.get(NS, key, prov)
            assert got.status is LookupStatus.HIT, got.reason
        times.append((time.perf_counter() - t0) / CHUNKS)
    per = statistics.median(times)
    mb = entries[0][1].nbytes / 1e6
    return Row(tier, kv_dtype, round(mb, 1), round(per * 1e3, 2), round(mb / 1e3 / per, 2), round(write_s * 1e3, 1))


def _compute(n: int, a: torch.Tensor, b: torch.Tensor) -> None:
    for _ in range(n):
        a @ b  # (600, 576) @ (576, 1536): one MLP GEMM of a 600-token chunk


def overlap(store: KVStore, kv_dtype: str, load_ms: float) -> dict[str, float]:
    """Sequential load+compute vs prefetched, with compute per chunk ~ one load."""
    entries = _entries(kv_dtype)
    prov = entries[0][1].provenance
    a, b = torch.randn(T, 576), torch.randn(576, 1536)
    t0 = time.perf_counter()
    _compute(5, a, b)
    gemm_ms = (time.perf_counter() - t0) / 5 * 1e3
    n = max(1, round(load_ms / gemm_ms))
    reqs = [FetchRequest(NS, key, prov) for key, _ in entries]
    t0 = time.perf_counter()
    for r in reqs:
        assert store.get(r.ns, r.key, r.provenance).status is LookupStatus.HIT
        _compute(n, a, b)
    seq = time.perf_counter() - t0
    with Prefetcher(store, max_workers=1) as pf:
        t0 = time.perf_counter()
        for got in pf.stream(reqs, depth=1):
            assert got.status is LookupStatus.HIT
            _compute(n, a, b)
        pre = time.perf_counter() - t0
    return {"compute_ms_per_chunk": round(n * gemm_ms, 1), "sequential_ms": round(seq * 1e3, 1),
            "prefetched_ms": round(pre * 1e3, 1), "speedup": round(seq / pre, 2)}


def _redis(url: str | None) -> tuple[str | None, object]:
    if url:
        return url, None
    if shutil.which("redis-server") is None:
        return None, None
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from _store_util import RedisServer, free_port  # a test helper: start a private server

    server = RedisServer(free_port())
    server.start()
    return server.url, server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--redis", default=None, help="redis URL (default: start a local redis-server)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows: list[Row] = []
    overlaps: dict[str, dict[str, float]] = {}
    url, server = _redis(args.redis)
    with tempfile.TemporaryDirectory() as tmp:
        for kv_dtype in ("float32", "float16"):
            rows.append(measure("memory", MemoryStore(), kv_dtype, args.repeats))
            disk = DiskStore(Path(tmp) / kv_dtype)
            rows.append(measure("disk (warm)", disk, kv_dtype, args.repeats))
            keys = [k for k, _ in _entries(kv_dtype)]
            rows.append(measure("disk (cold)", disk, kv_dtype, args.repeats, lambda d=disk, ks=keys: _drop_cache(d, ks)))
            if kv_dtype == "float32":
                overlaps["disk (warm)"] = overlap(disk, kv_dtype, rows[-2].load_ms_per_chunk)
            if url:
                rs = RedisStore(url, prefix=f"bench-{os.getpid()}", socket_timeout_s=10)
                rows.append(measure("redis", rs, kv_dtype, args.repeats))
                if kv_dtype == "float32":
                    overlaps["redis"] = overlap(rs, kv_dtype, rows[-1].load_ms_per_chunk)
                rs.clear()
    if server is not None:
        server.stop()  # type: ignore[attr-defined]
    load = os.getloadavg()[0]
    print(f"\nload average {load:.1f} on {os.cpu_count()} cores (contention skews the overlap rows)")
    print(f"entry: L={L} Hkv={HKV} T={T} D={D}, {CHUNKS} chunks; per-chunk load incl. checksum verify; torch threads=1\n")
    print(f"| tier | kv dtype | MB/chunk | load ms/chunk | load GB/s | write ms/chunk |\n|---|---|---|---|---|---|")
    for r in rows:
        gbs = "n/a (no copy)" if r.tier == "memory" else r.gb_per_s
        print(f"| {r.tier} | {r.kv_dtype} | {r.mb_per_chunk} | {r.load_ms_per_chunk} | {gbs} | {r.write_ms_per_chunk} |")
    print("\n| overlap (fp32, 5 chunks) | compute ms/chunk | sequential ms | prefetched ms | speedup |\n|---|---|---|---|---|")
    for name, o in overlaps.items():
        print(f"| {name} | {o['compute_ms_per_chunk']} | {o['sequential_ms']} | {o['prefetched_ms']} | {o['speedup']}x |")
    if args.json:
        safeio.atomic_write_text(Path(args.json),
                                 json.dumps({"rows": [asdict(r) for r in rows], "overlap": overlaps}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
