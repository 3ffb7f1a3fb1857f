"""Benchmark of the blend kernels at SmolLM2 shapes (3 KV heads, 9 query heads, head dim 64).

    python -m blend.evals.bench_kernels [--device cpu|cuda] [--json OUT] [--tokens 4096 16384] [--vllm]

For each kernel: max error against the torch reference, and time of the
dispatched path against plain-torch formulations, at T tokens with 15% of the
rows selected (recomputed). Then the blended layer step "mix + attention":
rope_mix + sparse_query_attention (the kernels path) against the unfused torch
path (scatter, HF-style rotate_half over the whole K, repeat K/V for GQA, SDPA
with an explicit mask), with dense causal attention over all T rows as the
full-prefill yardstick.

On CPU the dispatched path is the torch reference, so the times compare torch
formulations (the reference against SDPA with an explicit mask is the ratio the
kernels issue asks for) and the error column comes from the Triton kernels run
by the interpreter at a reduced shape (T=256). On CUDA, Triton is timed
against torch with CUDA events and errors are taken at the full shapes.
Each dispatched row is labelled with the implementation the dispatcher picks
for its tensors (``dispatch: triton|torch|vllm-cpu``), and a kernel that does
not run the claimed one (Triton on CUDA, vLLM's kernel under ``--vllm``) is
printed as a warning and listed under ``fallbacks`` in the JSON.

``--vllm`` (CPU, where vLLM is installed) loads vLLM's compiled ops and adds
vLLM's CPU attention kernel as kvblend's connector runs it
(``kernels/vllm_cpu.py``): to the sparse-query rows, and, as one causal request,
beside dense causal SDPA.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from blend.defaults import DEFAULT_RATIO
from blend.evals.environment import describe_environment
from blend.kernels.dispatch import KernelBackend
from blend import safeio

HKV, HQ, HEAD_DIM, ROPE_THETA = 3, 9, 64, 1e5  # SmolLM2-135M
SMALL_T = 256  # interpreter error check on CPU


@dataclass(frozen=True)
class Timing:
    kernel: str
    tokens: int
    selected: int
    impl: str
    ms: float
    ratio: float  # ms / ms of the first (baseline) row of the group


@dataclass(frozen=True)
class ErrorRow:
    kernel: str
    tokens: int
    selected: int
    impl: str
    max_abs_err: float
    within_tol: bool


def _timer(device: torch.device, repeats: int) -> Callable[[Callable[[], object]], float]:
    """Best milliseconds of ``fn`` over at least ``repeats`` calls after a warm-up (robust on a shared machine)."""

    def run(fn: Callable[[], object]) -> float:
        fn()
        times: list[float] = []
        deadline = time.perf_counter() + 0.3  # small kernels: keep going for 0.3 s (up to 200 calls)
        while len(times) < repeats or (time.perf_counter() < deadline and len(times) < 200):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return min(times)

    return run


@dataclass(frozen=True)
class Problem:
    """One layer's blend inputs at T tokens with S selected rows."""

    cached_k: torch.Tensor  # (Hkv, T, D) pre-RoPE
    cached_v: torch.Tensor  # (Hkv, T, D)
    cos: torch.Tensor  # (T, D)
    sin: torch.Tensor  # (T, D)
    fresh_idx: torch.Tensor  # (S,) sorted selected rows
    fresh_k: torch.Tensor  # (Hkv, S, D) pre-RoPE
    fresh_v: torch.Tensor  # (Hkv, S, D)
    q: torch.Tensor  # (Hq, S, D) after RoPE
    pos: torch.Tensor  # (T,) absolute positions

    @property
    def mix_args(self) -> tuple[torch.Tensor, ...]:
        return (self.cached_k, self.cached_v, self.cos, self.sin, self.fresh_idx, self.fresh_k, self.fresh_v)


def make_problem(t: int, ratio: float, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Problem:
    from blend.kernels.testing import rotary_tables

    gen = torch.Generator().manual_seed(seed)
    s = max(1, round(ratio * t))
    idx = torch.sort(torch.randperm(t, generator=gen)[:s]).values  # (S,)
    pos = torch.arange(t) + 10  # (T,) after a 10-token preamble
    cos, sin = rotary_tables(pos, HEAD_DIM, base=ROPE_THETA)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    return Problem(rnd(HKV, t, HEAD_DIM), rnd(HKV, t, HEAD_DIM), cos.to(device), sin.to(device), idx.to(device),
                   rnd(HKV, s, HEAD_DIM), rnd(HKV, s, HEAD_DIM), rnd(HQ, s, HEAD_DIM), pos.to(device))


# ---- plain-torch formulations the kernels are measured against ---------------------------

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def unfused_mix(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter, then HF apply_rotary_pos_emb over the whole K (in fp32)."""
    k = p.cached_k.clone()
    k[:, p.fresh_idx] = p.fresh_k
    v = p.cached_v.clone()
    v[:, p.fresh_idx] = p.fresh_v
    kf = k.float()
    return (kf * p.cos + rotate_half(kf) * p.sin).to(k.dtype), v


def sdpa_explicit_mask(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       k_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA with K/V repeated for GQA and an explicit boolean (S, T) mask."""
    group = q.shape[0] // k.shape[0]
    mask = k_pos[None, :] <= q_pos[:, None]  # (S, T)
    kr, vr = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # (Hq, T, D)
    return F.scaled_dot_product_attention(q[None], kr[None], vr[None], attn_mask=mask, scale=scale)[0]


def sdpa_additive_mask(q, q_pos, k, v, k_pos, scale):
    """SDPA, native GQA, float additive (S, T) mask."""
    bias = torch.zeros(q_pos.shape[0], k_pos.shape[0], dtype=q.dtype, device=q.device)
    bias.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=bias, scale=scale, enable_gqa=True)[0]


def matmul_softmax(q, q_pos, k, v, k_pos, scale):
    """Explicit scores: GQA folded into rows, masked_fill, softmax, matmul."""
    hkv, group = k.shape[0], q.shape[0] // k.shape[0]
    s = q.shape[1]
    scores = torch.matmul(q.reshape(hkv, group * s, -1), k.transpose(1, 2)) * scale  # (Hkv, G*S, T)
    scores = scores.view(hkv, group, s, -1).masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return torch.matmul(scores.softmax(-1).view(hkv, group * s, -1), v).view(q.shape)


def deviation_naive(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    return (fresh.float() - cached.float()).pow(2).sum(dim=(0, 2)).sqrt()


# ---- the benchmark ----------------------------------------------------------------------

def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def error_rows(t: int, ratio: float, dtype: torch.dtype, device: torch.device) -> list[ErrorRow]:
    """Triton kernels against the torch references (interpreted at SMALL_T on CPU)."""
    from blend.kernels import TOL, kv_deviation_ref, rope_mix_ref, sparse_query_attention_ref
    from blend.kernels.attention_kernel import sparse_query_attention_triton
    from blend.kernels.deviation_kernel import kv_deviation_triton
    from blend.kernels.rope_mix_kernel import rope_mix_triton

    tol = TOL[dtype]
    impl = "triton" if device.type == "cuda" else "triton-interpreter"
    p = make_problem(t, ratio, dtype, device, seed=1)
    s = p.fresh_idx.numel()
    k_ref, v_ref = rope_mix_ref(*p.mix_args)
    k_tri, v_tri = rope_mix_triton(*p.mix_args)
    q_pos = p.pos[p.fresh_idx]
    a_ref = sparse_query_attention_ref(p.q, q_pos, k_ref, v_ref, p.pos, HEAD_DIM ** -0.5)
    a_tri = sparse_query_attention_triton(p.q, q_pos, k_ref, v_ref, p.pos, HEAD_DIM ** -0.5)
    fresh_all = p.cached_k + 0.1 * torch.randn_like(p.cached_k)
    d_ref, d_tri = kv_deviation_ref(fresh_all, p.cached_k), kv_deviation_triton(fresh_all, p.cached_k)
    rows = []
    for name, got, want, tl_ in (("rope_mix.k", k_tri, k_ref, tol), ("rope_mix.v", v_tri, v_ref, tol),
                                 ("kv_deviation", d_tri, d_ref, TOL[torch.float32]),
                                 ("sparse_query_attention", a_tri, a_ref, tol)):
        ok = torch.allclose(got.float(), want.float(), atol=tl_.atol, rtol=tl_.rtol)
        rows.append(ErrorRow(name, t, s, impl, _err(got, want), ok))
    return rows


def dispatched_backends(p: Problem) -> dict[str, KernelBackend]:
    """The implementation each dispatched kernel runs on ``p``'s tensors, asked of the dispatcher itself (the
    same calls :mod:`blend.kernels.dispatch` makes), so a row is labelled with what it timed."""
    from blend.kernels.dispatch import attention_backend, kernel_backend

    return {"rope_mix": kernel_backend(p.cached_k), "kv_deviation": kernel_backend(p.cached_k),
            "sparse_query_attention": attention_backend(p.q, p.pos[p.fresh_idx], p.pos)}


def expected_backend(kernel: str, device: torch.device, vllm: bool) -> KernelBackend:
    """What the benchmark claims to time for a dispatched kernel: Triton on CUDA, vLLM's CPU kernel for
    attention under ``--vllm``, torch elsewhere."""
    if device.type == "cuda":
        return KernelBackend.TRITON
    return KernelBackend.VLLM_CPU if vllm and kernel == "sparse_query_attention" else KernelBackend.TORCH


def fallbacks(backends: dict[str, KernelBackend], device: torch.device, vllm: bool) -> list[str]:
    """One line per dispatched kernel that runs another implementation than the benchmark claims (e.g. Triton
    missing on a GPU machine, ``KVBLEND_KERNELS=torch``, vLLM's ops not registered or failing their
    self-check): its rows time that other implementation, and are labelled so."""
    return [f"{kernel}: dispatched to {got.value}, not {expected_backend(kernel, device, vllm).value}"
            for kernel, got in backends.items() if got is not expected_backend(kernel, device, vllm)]


def timing_rows(t: int, ratio: float, dtype: torch.dtype, device: torch.device, repeats: int,
                full_prefill: bool, vllm: bool = False) -> list[Timing]:
    from blend.kernels import kv_deviation, rope_mix, sparse_query_attention
    from blend.kernels.reference import kv_deviation_ref, rope_mix_ref, sparse_query_attention_ref

    timer = _timer(device, repeats)
    p = make_problem(t, ratio, dtype, device)
    s = p.fresh_idx.numel()
    scale = HEAD_DIM ** -0.5
    k_rot, v_mix = rope_mix_ref(*p.mix_args)
    q_pos = p.pos[p.fresh_idx]
    fresh_all = p.cached_k + 0.1 * torch.randn_like(p.cached_k)
    # each row labelled with the implementation the dispatcher picks for these tensors (not the one it
    # would pick if everything were installed): a fallback to torch is timed as, and called, torch
    ran = {k: f"dispatch: {b.value}" for k, b in dispatched_backends(p).items()}
    att = (p.q, q_pos, k_rot, v_mix, p.pos, scale)

    groups: dict[str, list[tuple[str, Callable[[], object]]]] = {
        "rope_mix": [("torch reference", lambda: rope_mix_ref(*p.mix_args)),
                     (ran["rope_mix"], lambda: rope_mix(*p.mix_args)),
                     ("unfused: scatter + HF rotate_half", lambda: unfused_mix(p))],
        "kv_deviation": [("torch reference", lambda: kv_deviation_ref(fresh_all, p.cached_k)),
                         (ran["kv_deviation"], lambda: kv_deviation(fresh_all, p.cached_k)),
                         ("naive pow/sum/sqrt", lambda: deviation_naive(fresh_all, p.cached_k))],
        "sparse_query_attention": [
            ("SDPA, repeat K/V, explicit bool mask", lambda: sdpa_explicit_mask(*att)),
            ("torch reference (SDPA gqa, bool mask)", lambda: sparse_query_attention_ref(*att)),
            (ran["sparse_query_attention"], lambda: sparse_query_attention(*att)),
            ("SDPA gqa, additive float mask", lambda: sdpa_additive_mask(*att)),
        ],
        "mix+attention (blend layer step)": [
            ("unfused torch: scatter+rotate_half+repeat+SDPA mask",
             lambda: sdpa_explicit_mask(p.q, q_pos, *unfused_mix(p), p.pos, scale)),
            (f"kernels path (rope_mix + attention: {ran['rope_mix'][10:]} + {ran['sparse_query_attention'][10:]})",
             lambda: sparse_query_attention(p.q, q_pos, *rope_mix(*p.mix_args), p.pos, scale)),
        ],
    }
    # chunked prefill: the last S = 7T/8 rows computed after T/8 cached rows (the exact path's
    # segments, prefix mode's tail, a blend check layer before selection)
    from blend.kernels.suffix_attention import causal_suffix_attention

    n_pre = t // 8
    suf = torch.arange(n_pre, t, device=device)
    q_suf = torch.randn(HQ, t - n_pre, HEAD_DIM, dtype=dtype, device=device)
    groups["chunked prefill (7T/8 rows after T/8)"] = [
        ("SDPA gqa, bool (S, T) mask", lambda: sparse_query_attention_ref(q_suf, p.pos[suf], k_rot, v_mix, p.pos, scale)),
        ("prefix pass + causal square, LSE merge", lambda: causal_suffix_attention(q_suf, k_rot, v_mix, scale)),
    ]
    if t <= 8192:  # explicit (Hq, S, T) scores: 1.5 GB at 16k
        groups["sparse_query_attention"].append(("matmul + masked softmax", lambda: matmul_softmax(*att)))
    if vllm:
        from blend.kernels.query_blocks import sparse_query_attention_blocked
        from blend.kernels.vllm_cpu import sparse_query_attention_vllm

        groups["sparse_query_attention"] += [
            ("torch blocked (the CPU path without vLLM)", lambda: sparse_query_attention_blocked(*att)),
            ("vLLM CPU kernel, one request per run", lambda: sparse_query_attention_vllm(*att))]
    if full_prefill:
        q_all = torch.randn(HQ, t, HEAD_DIM, dtype=dtype, device=device)
        groups["mix+attention (blend layer step)"].append(
            ("dense causal SDPA over all T (full prefill)", lambda: F.scaled_dot_product_attention(
                q_all[None], k_rot[None], v_mix[None], is_causal=True, scale=scale, enable_gqa=True)))
        if vllm:
            groups["mix+attention (blend layer step)"].append(
                ("vLLM CPU causal over all T (one request)", lambda: sparse_query_attention_vllm(
                    q_all, p.pos, k_rot, v_mix, p.pos, scale)))
    rows = []
    for kernel, impls in groups.items():
        base = None
        for impl, fn in impls:
            ms = timer(fn)
            base = base or ms
            rows.append(Timing(kernel, t, s, impl, ms, ms / base))
    return rows


def print_tables(errors: list[ErrorRow], timings: list[Timing]) -> None:
    print(f"{'kernel':<34}{'T':>7}{'S':>6}  {'impl':<22}{'max |err|':>12}  within TOL")
    for e in errors:
        print(f"{e.kernel:<34}{e.tokens:>7}{e.selected:>6}  {e.impl:<22}{e.max_abs_err:>12.3e}  {e.within_tol}")
    print()
    print(f"{'kernel':<34}{'T':>7}{'S':>6}  {'impl':<54}{'ms':>10}{'x first':>9}")
    for r in timings:
        print(f"{r.kernel:<34}{r.tokens:>7}{r.selected:>6}  {r.impl:<54}{r.ms:>10.2f}{r.ratio:>9.2f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                    help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--ratio", type=float, default=DEFAULT_RATIO)
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per row (default 5 CPU, 20 CUDA)")
    ap.add_argument("--no-full-prefill", action="store_true", help="skip the dense causal attention row")
    ap.add_argument("--json", metavar="OUT", default=None)
    ap.add_argument("--vllm", action="store_true", help="add vLLM's CPU attention kernel (needs vLLM installed)")
    args = ap.parse_args(argv)
    if args.vllm:
        import vllm._custom_ops  # noqa: F401  registers vLLM's compiled ops with torch
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is defined
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    repeats = args.repeats or (5 if device.type == "cpu" else 20)

    # (the Triton interpreter's error rows need this repository's Triton; vLLM's environment pins another)
    errors = error_rows(SMALL_T, args.ratio, dtype, device) if device.type == "cpu" and not args.vllm else []
    timings: list[Timing] = []
    for t in args.tokens:
        if device.type == "cuda":
            errors += error_rows(t, args.ratio, dtype, device)
        timings += timing_rows(t, args.ratio, dtype, device, repeats, not args.no_full_prefill, args.vllm)
    backends = dispatched_backends(make_problem(64, args.ratio, dtype, device))
    fell_back = fallbacks(backends, device, args.vllm)
    print(f"device={device} dtype={dtype} threads={torch.get_num_threads()} "
          f"Hkv={HKV} Hq={HQ} D={HEAD_DIM} ratio={args.ratio} best of {repeats}, ms\n")
    for line in fell_back:
        print(f"WARNING: {line}: the dispatched rows time that implementation")
    print_tables(errors, timings)
    if args.json:
        safeio.atomic_write_text(args.json, json.dumps({"device": str(device), "dtype": str(dtype),
                       "threads": torch.get_num_threads(), "environment": describe_environment(device),
                       "dispatched": {k: b.value for k, b in backends.items()}, "fallbacks": fell_back,
                       "errors": [asdict(e) for e in errors], "timings": [asdict(r) for r in timings]}, indent=2))


if __name__ == "__main__":
    main()
