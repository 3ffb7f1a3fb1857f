"""Every default of the engine, the CLI and the API, in one place.

Nothing here imports the rest of kvblend: any module may read a default
without pulling the engine in (the CLI's ``--help`` stays light).
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"
# PyTorch's CPU allocator asks for transparent huge pages on buffers of 2 MiB and more when this is "1"
# (its own tuning knob, read once, at torch's first allocation); importing blend sets it unless the
# environment already does. A loaded exact hit's 140 MB of KV copies took ~half the time on huge pages
# (BENCHMARKS.md, "Exact entries after RoPE, and an XXH3 checksum").
TORCH_THP_ENV = ("THP_MEM_ALLOC_ENABLE", "1")
# the evaluations' and benches' questions (CacheBlend's musique_dev records), relative to the repository root
DEFAULT_EVAL_DATA = "../shared/data/musique_dev.json"
# the evaluations' percentile bootstrap CIs over items: resamples and the resampling seed (kvblend eval's
# --bootstrap and --seed; every CI of a run, results.md's answer survival included, uses the run's own)
DEFAULT_BOOTSTRAP_RESAMPLES = 1000
DEFAULT_BOOTSTRAP_SEED = 0
# a GGUF conversion's temporary (or discarded) folder under $KVBLEND_HOME/models that nothing has written for this
# long is a killed conversion's leftover (hundreds of MB to GBs): the next conversion removes it. A conversion in
# progress writes its files continuously (SmolLM2: about a minute here, the 0.5B Qwen a few)
CONVERSION_STALE_S = 6 * 3600.0
DEFAULT_DTYPE = "float32"
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEFAULT_DEVICE = "cpu"
# linear layers (blend/gemm.py): "auto" = oneDNN over weights packed once for a float32 engine on a CPU
# (GEMMs 1.1x-3.4x faster than F.linear's MKL path, decode rows most), torch's F.linear elsewhere;
# "torch" / "onednn" force one. Part of the KV's provenance. "auto" since 2026-12-04.
DEFAULT_GEMM = "auto"
GEMM_CHOICES = ("auto", "torch", "onednn")

# blended reuse
DEFAULT_RATIO = 0.15  # share of reused document tokens recomputed
DEFAULT_SELECTOR = "probe"  # query probe x V deviation (issue 14; was "combo")
DEFAULT_CHECK_LAYERS: tuple[int, ...] = (1,)
DEFAULT_MAX_RATIO = 0.5  # cap of threshold mode
DEFAULT_MIN_PROMPT_TOKENS = 0
# adaptive budget's stopping target: left-over probe-weighted V deviation over mean ||V||, times the
# probe's first-token entropy (calibrated on musique_dev items 0-29 only, SmolLM2; docs/results/issue14/).
# 0.007 since the near-tie guard became a default (0.0045 was chosen without it): with the guard on, of
# 0.006 / 0.007 / 0.008 the one whose tuning mean spent share (both passes of a guarded prompt) is the largest
# not above the unguarded 0.0045's (0.094 vs 0.098; mean KL 0.0397 vs 0.0354). Validation 30-99: mean KL
# 0.041, p90 0.082, max 0.176, top-1 0.971 at a spent share of 0.116 (0.0045 with the guard: 0.151 spent).
# BENCHMARKS.md, "The adaptive budget's target with the guard on".
DEFAULT_AUTO_TARGET = 0.007
# near-tie guard (issue 14): when a blend's first-token top-2 log-prob gap is under the margin, the
# request is blended again at DEFAULT_GUARD_RATIO (1.0: the exact path, as without reuse; a guard
# ratio at or below the request's own takes the exact path too). The margin, 0.7 nats, is the p90 of
# the blend@0.15's gap error |gap(blend) - gap(full)| on musique tuning items 0-29. On by default
# since 2026-12-04 (was opt-in): on validation 30-99 the unguarded default changed the first token on
# 5 of 70 (top-1 0.929, four near ties); re-blending those under the margin at 0.3 fixed three (0.971)
# for a mean share of 0.171 (BENCHMARKS.md, "The near-tie guard by default"). None: off.
DEFAULT_GUARD_MARGIN: float | None = 0.7
DEFAULT_GUARD_RATIO = 0.3
# how the guard's second pass runs (blend.policy.GuardMode): "restart" blends again from the start;
# "widen" goes on from the first pass's check layer (where its candidates cover the guard ratio), choosing
# among those candidates only. "restart" stays the default: on validation 30-99 "widen" made guarded prompts
# ~10% cheaper (TTFT 0.558x against 0.625x of full prefill, mean over the 10 guarded) at a lower top-1 (0.957
# against 0.971; mean KL 0.0297 against 0.0294); BENCHMARKS.md, "The guard's second pass ...".
DEFAULT_GUARD_MODE = "restart"
# inside vLLM (the KV connector) the guard is opt-in (a request's "guard_margin"): kvblend's blend there
# costs ~0.45x of vLLM's faster prefill, so a guarded prompt's second pass takes it past vLLM's own full
# prefill (1.24-1.47x of it). Validation items 30-49, reordered documents: with 0.7 it fired on 4 of 20, TTFT
# mean 0.709x against 0.429x without, top-1 0.95 both, mean KL 0.0255 against 0.0270 (BENCHMARKS.md, "The near-tie
# guard inside vLLM").
DEFAULT_VLLM_GUARD_MARGIN: float | None = None
# the query probe's GEMMs: "compute" (the engine's dtype), "bf16" (its numbers only rank rows), or "auto":
# bf16 for a float32 engine on a CPU with native bf16 (avx512_bf16 / amx_bf16), else compute. "auto" since
# 2026-12-03: on musique tuning 0-29, validation 30-99 and two-hop 0-29 the bf16 probe's mean, median, p90
# and max KL were within 0.0008 of the fp32 probe's (two-hop p90 at 0.30: 0.0019 lower), top-1 equal; the
# probe phase 17-36% cheaper (BENCHMARKS.md, "The query probe in bf16 by default ...")
DEFAULT_PROBE_PRECISION = "auto"
# the recomputed rows' attention and linear layers above a blend's last check layer
# (blend.policy.RecomputePrecision): "compute" (the engine's dtype), "bf16" or "auto" (bf16 for a float32 engine
# on a CPU with native bf16). Opt-in: on the 2-core AMX Xeon bf16 attention took blend@0.15 from 0.235x to 0.187x
# of a full prefill (median, validation 30-99) at mean KL 0.0298 against 0.0294, and bf16 linear layers on top
# take it further; but the answer's numbers move by bf16 rounding (issue 18 asks the default's KL to stay
# within 1e-6 of before); BENCHMARKS.md, "bf16 for the recomputed rows".
DEFAULT_ATTENTION_PRECISION = "compute"
DEFAULT_LINEAR_PRECISION = "compute"
# probe selectors: None = the layers up to the check for every document row; F = the probe runs first
# and only the F x budget rows the question attends to most are computed up to the check (candidates).
# 2: the smallest of 1.5 / 2 / 3 that keeps synthetic two-hop no worse than V deviation at 0.15 and
# 0.30 (1.5 did not: p90 0.118 vs 0.115); on musique tuning items 0-29 below None in every KL column
# at 0.218x vs 0.237x TTFT; validation 30-99 in BENCHMARKS.md (issue 14, "Candidate pre-selection")
DEFAULT_CANDIDATES: float | None = 2.0
# APE-style attention temperature on reused (not recomputed) document rows above the first check layer:
# their attention logits are divided by T for every query (1.0: off). 1.05 since 2026-12-03: of 1.05 / 1.1 /
# 1.15 on musique tuning items 0-29 at 0.15 the only one below T = 1 in every KL column (mean 0.0343 ->
# 0.0297, lower on 23 of 30), and lower at 0.05 and 0.30 too; then validation 30-99, two-hop and 10 passages
# (BENCHMARKS.md, "Reused rows' attention temperature")
DEFAULT_REUSED_TEMPERATURE = 1.05
# the temperatures a request may set: dividing K by T -> 0 overflows a half-precision cache (T = 1e-5 gave NaN
# logits in float16) and T -> inf flattens reused rows to uniform attention; APE's useful range is ~0.8-1.2
REUSED_TEMPERATURE_RANGE = (0.1, 10.0)

# answering
DEFAULT_MAX_NEW_TOKENS = 32
DEFAULT_TOP_K = 5  # chunks retrieved by `ask --index`
DEFAULT_DEMO_TOP_K = 2
DEFAULT_EMBED_MAX_LENGTH = 256  # wordpiece tokens per text the retrieval embedder reads (longer ones truncated)

# the quality gate (`kvblend check`)
# calibration prompts of the fidelity check: all six (4 until 2026-12-03, when one of Qwen2.5's four,
# KL 1.13 while the other three were <= 0.008, carried the mean over the bound on its own)
DEFAULT_GATE_ITEMS = 6


def kvblend_home() -> Path:
    """Cache root: ``$KVBLEND_HOME`` or ``~/.cache/kvblend``.

    Returns:
        The folder (``~`` expanded; it may not exist yet).
    """
    return Path(os.environ.get("KVBLEND_HOME") or Path.home() / ".cache" / "kvblend").expanduser()
# hot prefixes (blend.prefix_cache): bytes of assembled, rotated prefix KV an engine keeps in process so
# that a prefix found stored again is attached instead of loaded (issue 18's fixed overhead); 0: off
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30
# recycled KV buffers (blend.kvpool): bytes of a finished request's per-layer K/V buffers a model keeps
# for the next request's cache instead of returning them to the allocator (fresh buffers are faulted in
# page by page); 0: off. Capacities round up to the quantum (rows) and a buffer serves requests needing
# down to 1 / slack of its rows.
DEFAULT_KV_POOL_BYTES = 1 << 30
KV_POOL_ROW_QUANTUM = 256
KV_POOL_SLACK = 2
# the Redis tier (blend.store.redis_link): a dead host costs at most the connect timeout, each wait for bytes on
# an established connection at most the socket timeout, and after a failure calls skip the server this long
DEFAULT_REDIS_CONNECT_TIMEOUT_S = 0.2
DEFAULT_REDIS_SOCKET_TIMEOUT_S = 2.0
DEFAULT_REDIS_RETRY_AFTER_S = 5.0
# ... and a whole call at most the socket timeout plus its bytes at this rate (bytes/s): a server that answers
# slower (a reply dripped a few bytes at a time, each within the socket timeout) is down. A local server moves
# a 27.6 MB chunk at ~750 MB/s, 1 Gb Ethernet at ~110 MB/s; 8 MiB/s leaves a 100 Mb link (~12 MB/s) up, and
# still bounds a dripped 27.6 MB reply to ~5.5 s.
DEFAULT_REDIS_MIN_RATE = 8 << 20
# write-behind (blend.store.write_behind): a store chain writes its persistent tiers (disk, Redis) on a
# background thread, off the request's time to first token; requests wait for their writes before they
# finish. At most this many writes wait in the queue before a producer waits for room.
DEFAULT_WRITE_BEHIND = True
DEFAULT_WRITE_BEHIND_PENDING = 32
# semantic reuse's donor index (blend.donors): donors held in memory per engine (each keeps its token ids and
# a MinHash signature, ~5-20 KB); past it the oldest registration leaves memory (the donor log keeps it)
DEFAULT_MAX_DONORS = 1 << 14
# ... and their tokens held in memory at most (a token id kept in a tuple costs ~37 bytes: 2**23 tokens ~ 0.3 GB,
# 16,384 donors of 512 tokens); donors of a few thousand tokens each held GBs under the count alone
DEFAULT_MAX_DONOR_TOKENS = 1 << 23
# a donor whose KV the store definitely lacks is only skipped until it has lacked it this long (seconds, from the
# first such look): another process logs a registration before its write-behind put reaches the shared tiers, and
# a removal logged in between would cancel that donor for every process (blend.semantic.Donors)
DEFAULT_DONOR_ABSENT_GRACE_S = 60.0
# a donor-log purge (a deleted document's tokens leaving the log) rewrites it by compare-and-swap: this many
# tries while other processes keep appending
DEFAULT_PURGE_TRIES = 3
# disk tier byte budget (blend.store.disk_budget): a process's tally counts only its own puts between scans of the
# folder, so the folder (every process's files) is recounted at least this often (seconds) on a put
DEFAULT_DISK_RESCAN_S = 10.0
# an interrupted write's temp file (a writer killed mid-put) no byte has reached for this long is removed by the
# next budget scan or `kvblend store prune` (a write in progress touches its file with every block it writes)
DEFAULT_STALE_TEMP_S = 600.0
# a disk entry's recency (its mtime, the budget's LRU order) is updated at most this often per key (seconds)
DEFAULT_TOUCH_INTERVAL_S = 1.0
# sampling defaults (blend.sampling.GenerationConfig, the Python API's; `kvblend ask` / `chat` flags; the server
# where a request names none): greedy, no nucleus or top-k cut, no penalties. Only the server's temperature
# differs, by design: OpenAI's 1.0 where a request names none (clients written for OpenAI expect sampling), while
# the Python API and the command line answer greedily (the engine's historical, reproducible answers).
DEFAULT_TEMPERATURE = 0.0
DEFAULT_SERVE_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_SAMPLING_TOP_K = 0  # top-k sampling off (DEFAULT_TOP_K is `ask --index`'s retrieval depth)
DEFAULT_PENALTY = 0.0  # presence and frequency penalties
# sampling: a temperature below this decodes greedily (its limit as T -> 0). Dividing logits by a
# denormal temperature overflows float32 to inf, whose softmax is NaN (vLLM's _SAMPLING_EPS is the same).
MIN_SAMPLING_TEMPERATURE = 1e-5
MAX_SAMPLING_TEMPERATURE = 2.0  # OpenAI's range: [0, 2]
MAX_SEED = 2**63  # sampling and the random selector's seeds lie below it; the selector's from 0
MIN_SAMPLING_SEED = -(2**63)  # sampling seeds from here: OpenAI's seed is any signed 64-bit integer

# store: bytes of KV the in-process (memory) tier holds
DEFAULT_MEMORY_BUDGET = 2 << 30
# retrieval: chunk size, and the index size where an AUTO index becomes approximate (HNSW)
DEFAULT_CHUNK_TOKENS = 256
DEFAULT_APPROX_THRESHOLD = 20_000
# ingest: new chunks between commits of the index; chunk texts per KV-writer call
DEFAULT_COMMIT_EVERY = 512
DEFAULT_KV_BATCH = 16
# an index registered in a store's registry whose folder is not visible (deleted, or on another machine) and
# that no ingest registered again for this long leaves the registry (it pins no KV here in any case)
DEFAULT_REGISTRY_STALE_S = 30 * 24 * 3600.0
# the quality gate's bounds for blended reuse (per model): mean first-token KL(full || blend) at most, and
# first-token top-1 agreement at least
GATE_KL_BOUND = 0.25
GATE_TOP1_BOUND = 0.75
# semantic reuse (experimental): tokens recomputed on each side of every edit; the estimated shingle Jaccard
# a donor needs; the share of a document's rows it must lend unforced; donors aligned per miss
SEMANTIC_FORCE_WINDOW = 4
SEMANTIC_MIN_SIMILARITY = 0.3
SEMANTIC_MIN_ALIGNED = 0.5
SEMANTIC_MAX_CANDIDATES = 4

# kvblend serve
DEFAULT_LOG_LEVEL = "info"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# a stopping server (SIGTERM, Ctrl-C) refuses new and queued requests at once (503) and gives running ones
# this long to finish; those still running this much before it ends get a 503 or a stream's error event.
# Under `docker stop`'s 10 s before its SIGKILL (Kubernetes gives 30 s: --graceful-shutdown 25 there)
DEFAULT_GRACEFUL_SHUTDOWN_S = 8.0
DEFAULT_SHUTDOWN_MARGIN_S = 1.0
# the largest `--doc` file `ask`/`chat` read: far past any model's context in characters (read whole, then
# tokenized: a 3 GB file took the process to 23.7 GB before the kernel killed it)
MAX_DOCUMENT_BYTES = 16 << 20
