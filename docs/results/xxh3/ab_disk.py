"""In-process A/B of the store blobs' integrity check: sha256 (written until 2026-12-06) against
XXH3-128, on what a disk-tier hit costs.

1. The codec alone: decode (every check, the checksum included) of one 600-row SmolLM2 chunk
   (30 layers x 3 KV heads x 64, fp32: 27.6 MB), from bytes already in memory.
2. An exact hit served by a disk store (no memory tier in front; the hot-prefix cache off, so every
   request reads and checks every segment's file, from the page cache): the same prompts, one store
   per kind, interleaved, alternating order, paired medians; first logits compared bit for bit, and a
   full prefill of each prompt times the ratios.

    OMP_NUM_THREADS=2 .venv/bin/python docs/results/xxh3/ab_disk.py > docs/results/xxh3/ab.txt
"""

import statistics
import sys
import tempfile
import time

import torch

from blend.defaults import DEFAULT_EVAL_DATA
from blend.engine import Engine
from blend.evals.bench_phases import SIZES, size_prompts
from blend.keys import Namespace, StoreKey
from blend.kvcache import KVEntry
from blend.policy import ReusePolicy
from blend.report import ReuseClass
from blend.store import codec
from blend.store.disk import DiskStore

KINDS = (codec.ChecksumKind.SHA256, codec.ChecksumKind.XXH3_128)
ROUNDS = 6  # the first warms up


def codec_alone() -> None:
    g = torch.Generator().manual_seed(0)
    entry = KVEntry(torch.randn(30, 3, 600, 64, generator=g), torch.randn(30, 3, 600, 64, generator=g), "{}")
    key = StoreKey(bytes(32))
    for kind in KINDS:
        codec.WRITE_CHECKSUM = kind
        blob = bytearray(codec.encode(Namespace.CANONICAL, key, entry))
        t_enc, t_dec = [], []
        for _ in range(10):
            t0 = time.perf_counter()
            codec.encode(Namespace.CANONICAL, key, entry)
            t1 = time.perf_counter()
            codec.decode(blob, Namespace.CANONICAL, key)
            t_dec.append(time.perf_counter() - t1)
            t_enc.append(t1 - t0)
        mb = len(blob) / 1e6
        print(f"codec, one 600-row chunk ({mb:.1f} MB), {kind.value:>8}: decode {statistics.median(t_dec) * 1e3:6.2f} ms "
              f"({mb / 1e3 / statistics.median(t_dec):.1f} GB/s), encode {statistics.median(t_enc) * 1e3:6.2f} ms", flush=True)
    codec.WRITE_CHECKSUM = codec.ChecksumKind.XXH3_128


def main() -> None:
    print(f"threads {torch.get_num_threads()}", flush=True)
    codec_alone()
    base = Engine.load("smollm2-135m", quality_gate=False)
    dirs = {kind: tempfile.mkdtemp(prefix=f"kvb-{kind.value}-") for kind in KINDS}
    arms = {kind: base.with_store(DiskStore(dirs[kind])) for kind in KINDS}
    for eng in arms.values():
        eng.segments.hot.budget_bytes = 0  # every request reads its segments from disk
    policy = ReusePolicy.exact()
    for size in ("3k", "6k"):
        prompts = size_prompts(base, DEFAULT_EVAL_DATA, range(0, 3), SIZES[size])
        t = {kind: [] for kind in KINDS}
        waits = {kind: [] for kind in KINDS}
        full = []
        for p in prompts:
            for kind, eng in arms.items():
                codec.WRITE_CHECKSUM = kind
                eng.generate(p, policy, max_new_tokens=1)  # written under this kind
            firsts = {}
            for rep in range(ROUNDS):
                for kind in (KINDS if rep % 2 == 0 else KINDS[::-1]):
                    ans = arms[kind].generate(p, policy, max_new_tokens=1)
                    if any(s.reuse_class is not ReuseClass.EXACT for s in ans.report.segments[:-1]):
                        raise RuntimeError(f"{kind.value}: not every segment was a disk hit")
                    firsts.setdefault(kind, ans.first_logits)
                    if rep:
                        t[kind].append(ans.ttft_s)
                        waits[kind].append(ans.report.timings.lookup_s)
                if rep:
                    full.append(base.generate(p, ReusePolicy.none(), max_new_tokens=1).ttft_s)
            assert torch.equal(firsts[KINDS[0]], firsts[KINDS[1]])
        f = statistics.median(full)
        old, new = (t[k] for k in KINDS)
        paired = statistics.median(n / o for n, o in zip(new, old))
        print(f"{size:>3} tokens ~{len(prompts[0])} (items 0-2, {len(full)} rounds each), full prefill {f * 1e3:.0f} ms; "
              f"exact hit from disk:", flush=True)
        for kind in KINDS:
            m = statistics.median(t[kind])
            print(f"  {kind.value:>8}: TTFT {m * 1e3:6.1f} ms ({m / f:.4f}x), of it the store "
                  f"{statistics.median(waits[kind]) * 1e3:6.1f} ms", flush=True)
        print(f"  paired xxh3 / sha256 {paired:.3f}; first logits identical", flush=True)


if __name__ == "__main__":
    sys.exit(main())
