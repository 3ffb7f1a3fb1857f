"""sparse_query_attention: Triton kernel (interpreted) vs torch reference.

Three phases per case: reference, kernel, compare with TOL[dtype].
"""

import pytest
import torch

from blend.kernels import ENV_VAR, sparse_query_attention, sparse_query_attention_ref
from blend.gemm import onednn_available
from blend.kernels.testing import Layout, assert_close_tol, make_attention_inputs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
T = 70  # not a multiple of BLOCK_N (32 interpreted, 32/64 on GPU)


def _rows(kind: str, t: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    if kind == "empty":
        return torch.empty(0, dtype=torch.int64)
    if kind == "all":
        return torch.arange(t)
    return torch.randperm(t, generator=gen)[:19]  # 19 unsorted rows: not a multiple of BLOCK_M


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")


def _check(inp, dtype):
    # reference
    expected = sparse_query_attention_ref(*inp.args())
    # kernel
    actual = sparse_query_attention(*inp.args())
    # compare
    assert actual.shape == inp.q.shape and actual.dtype == dtype
    assert torch.isfinite(actual).all()
    assert_close_tol(actual, expected)
    return actual


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("d", [64, 128, 40])
def test_attention_kernel_matches_reference(triton_backend, dtype, group, d):
    inp = make_attention_inputs(hkv=2 if group < 4 else 1, group=group, t=T, d=d,
                                q_rows=_rows("unsorted", T), dtype=dtype)
    _check(inp, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ["empty", "all"])
def test_attention_kernel_empty_and_all_rows(triton_backend, dtype, rows):
    inp = make_attention_inputs(hkv=1, group=3, t=37, d=72, q_rows=_rows(rows, 37), dtype=dtype)
    _check(inp, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", [Layout.TOKEN_MAJOR, Layout.DIM_STRIDED], ids=lambda l: l.value)
def test_attention_kernel_non_contiguous(triton_backend, dtype, layout):
    inp = make_attention_inputs(hkv=2, group=3, t=T, d=80, q_rows=_rows("unsorted", T), dtype=dtype, layout=layout)
    assert not inp.q.is_contiguous() and not inp.k.is_contiguous()
    actual = _check(inp, dtype)
    contiguous = sparse_query_attention_ref(inp.q.contiguous(), inp.q_pos, inp.k.contiguous(),
                                            inp.v.contiguous(), inp.k_pos, inp.scale)
    assert_close_tol(actual, contiguous)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_kernel_query_without_visible_key_is_zero(triton_backend, dtype):
    k_pos = torch.arange(T) + 10
    inp = make_attention_inputs(hkv=1, group=4, t=T, d=64, q_rows=torch.tensor([5, 0, 40]), dtype=dtype, k_pos=k_pos)
    q_pos = torch.tensor([15, 3, 50])  # position 3 precedes every key
    out = _check(type(inp)(inp.q, q_pos, inp.k, inp.v, inp.k_pos, inp.scale), dtype)
    assert torch.equal(out[:, 1], torch.zeros_like(out[:, 1]))
    assert out[:, 0].abs().sum() > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_kernel_unsorted_and_repeated_key_positions(triton_backend, dtype):
    """Causality is by absolute position, not by row: shuffled and equal positions are fine."""
    gen = torch.Generator().manual_seed(5)
    k_pos = torch.randperm(T, generator=gen) // 2 + 3  # every position twice, shuffled
    inp = make_attention_inputs(hkv=2, group=2, t=T, d=64, q_rows=_rows("unsorted", T), dtype=dtype, k_pos=k_pos)
    _check(inp, dtype)


# ---- the CPU path: query blocks over key prefixes ------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("blocks", [1, 3, 8])
def test_blocked_cpu_path_matches_reference(dtype, group, blocks):
    from blend.kernels import sparse_query_attention_blocked

    gen = torch.Generator().manual_seed(5)
    t = 300
    rows = torch.sort(torch.randperm(t, generator=gen)[:61]).values  # sorted, spread out
    inp = make_attention_inputs(2, group, t, 64, rows, dtype)
    expected = sparse_query_attention_ref(*inp.args())
    actual = sparse_query_attention_blocked(*inp.args(), blocks=blocks)
    assert actual.dtype == dtype and actual.shape == inp.q.shape
    assert_close_tol(actual, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_blocked_cpu_path_runs_the_flash_op_in_the_inputs_dtype(dtype, monkeypatch, attention_route):
    """A bf16 / fp16 engine's blend attends as its prefill does: the flash op on its own K/V (no float32
    copy of them per layer), both parts of a block with a long shared prefix, merged in float32."""
    import blend.kernels.query_blocks as Q
    import blend.kernels.suffix_attention as S

    attention_route("flash")
    seen = []
    real = S.flash

    def spy(q, k, v, **kw):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, **kw)

    monkeypatch.setattr(S, "flash", spy)
    monkeypatch.setattr(Q, "flash", spy)
    t = Q.SPLIT_MIN_PREFIX + 400
    gen = torch.Generator().manual_seed(12)
    rows = torch.sort(torch.randperm(t - 64, generator=gen)[:150] + 64).values
    inp = make_attention_inputs(2, 3, t, 64, rows, dtype)
    # four blocks: some with a long shared prefix
    plan = Q.plan_query_blocks(inp.q_pos, inp.k_pos, inp.q.shape[0], inp.k.shape[0], blocks=4)
    assert plan.route is Q.AttentionRoute.BLOCKS and any(b.lo >= Q.SPLIT_MIN_PREFIX for b in plan.blocks)
    got = Q.sparse_query_attention_blocked(*inp.args(), plan=plan)
    assert seen and all(d == (dtype,) * 3 for d in seen)
    assert len(seen) > len(plan.blocks)  # two parts for some block
    assert got.dtype == dtype and got.shape == inp.q.shape
    assert_close_tol(got, sparse_query_attention_ref(*inp.args()))


def test_blocked_cpu_path_edge_cases():
    from blend.kernels import sparse_query_attention_blocked

    t = 200
    # queries before every key see nothing -> zeros, the rest still right
    k_pos = torch.arange(t) + 50
    rows = torch.arange(0, 200, 5)
    inp = make_attention_inputs(1, 2, t, 32, rows, torch.float32, k_pos=k_pos)
    q_pos = torch.cat([torch.arange(10, 20), inp.q_pos[10:]])  # the first ten sit before key 0
    args = (inp.q, q_pos, inp.k, inp.v, inp.k_pos, inp.scale)
    got = sparse_query_attention_blocked(*args, blocks=4)
    assert torch.equal(got[:, :10], torch.zeros_like(got[:, :10]))
    assert_close_tol(got, sparse_query_attention_ref(*args))
    # unsorted queries or keys: the reference answers (same numbers)
    perm = torch.randperm(rows.numel(), generator=torch.Generator().manual_seed(1))
    args = (inp.q[:, perm], inp.q_pos[perm], inp.k, inp.v, inp.k_pos, inp.scale)
    assert torch.equal(sparse_query_attention_blocked(*args), sparse_query_attention_ref(*args))


def test_cpu_dispatch_uses_the_blocked_path(monkeypatch):
    import blend.kernels.dispatch as D

    calls = []
    real = D.sparse_query_attention_blocked
    monkeypatch.setattr(D, "sparse_query_attention_blocked", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setenv(ENV_VAR, "torch")
    x = torch.randn(1, 40, 16)
    sparse_query_attention(x, torch.arange(40), x, x, torch.arange(40), 0.25)
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("prefix", [0, 1, 37])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("s", [45, 300])  # 3 x 300 rows: past GROUPED_PREFIX_MAX_ROWS, K/V repeated per head
def test_causal_suffix_attention_matches_masked_reference(dtype, prefix, group, s):
    from blend.kernels.suffix_attention import GROUPED_PREFIX_MAX_ROWS, causal_suffix_attention

    assert 3 * 45 < GROUPED_PREFIX_MAX_ROWS <= 3 * 300
    t = prefix + s
    inp = make_attention_inputs(2, group, t, 64, torch.arange(prefix, t), dtype)
    expected = sparse_query_attention_ref(*inp.args())
    assert_close_tol(causal_suffix_attention(inp.q, inp.k, inp.v, inp.scale), expected)


def test_blocked_path_takes_the_suffix_route_when_every_row_is_active(monkeypatch):
    import blend.kernels.query_blocks as Q

    seen = []
    real = Q.causal_suffix_attention
    monkeypatch.setattr(Q, "causal_suffix_attention", lambda *a: seen.append(1) or real(*a))
    t = 300
    inp = make_attention_inputs(3, 3, t, 64, torch.arange(100, t), torch.float32)
    got = Q.sparse_query_attention_blocked(*inp.args())
    assert seen == [1]
    assert_close_tol(got, sparse_query_attention_ref(*inp.args()))


@pytest.mark.parametrize("where", ["end", "middle", "unsorted keys"])
def test_attention_probs_masks_only_what_some_query_cannot_see(where):
    """The probe's attention with probabilities: bit-identical to masking every column, and the
    probabilities agree with the reference attention's output."""
    from blend.kernels.probabilities import attention_probs

    gen = torch.Generator().manual_seed(3)
    t, s, hkv, g, d = 120, 9, 2, 3, 16
    q = torch.randn(hkv * g, s, d, generator=gen)
    k, v = torch.randn(hkv, t, d, generator=gen), torch.randn(hkv, t, d, generator=gen)
    k_pos = torch.arange(t)
    q_pos = {"end": torch.arange(t - s, t), "middle": torch.arange(50, 50 + s)}.get(where, torch.arange(t - s, t))
    if where == "unsorted keys":
        k_pos = torch.randperm(t, generator=gen)
    out, probs = attention_probs(q, q_pos, k, v, k_pos, 0.25)
    qg = q.reshape(hkv, g * s, d)
    scores = torch.matmul(qg, k.transpose(1, 2)).view(hkv * g, s, -1) * 0.25
    want = torch.softmax(scores.masked_fill(~(k_pos[None, :] <= q_pos[:, None]), float("-inf")), dim=-1)
    assert torch.equal(probs, want)
    assert_close_tol(out, sparse_query_attention_ref(q, q_pos, k, v, k_pos, 0.25))


@pytest.mark.parametrize("case", ["blocks", "short prefix", "blind queries", "suffix"])
def test_a_plan_made_once_gives_the_same_bits_at_every_call(case):
    """A blend makes the blocked attention's plan once per active row set and reuses it layer after
    layer: with new q, K and V at the same positions, the planned call equals the unplanned one."""
    from blend.kernels import plan_query_blocks, sparse_query_attention_blocked
    from blend.kernels.query_blocks import SPLIT_MIN_PREFIX, AttentionRoute

    t = {"short prefix": 300}.get(case, SPLIT_MIN_PREFIX + 400)
    gen = torch.Generator().manual_seed(7)
    rows = torch.sort(torch.randperm(t - 64, generator=gen)[:150] + 64).values  # sorted, past key 64
    k_pos = torch.arange(t) + 50
    if case == "suffix":
        rows = torch.arange(t - 150, t)
    plan = None
    for layer in range(3):  # new numbers each "layer", the same positions
        inp = make_attention_inputs(2, 3, t, 32, rows, torch.float32, k_pos=k_pos, seed=layer)
        q_pos = inp.q_pos
        if case == "blind queries":  # the first ten queries sit before every key
            q_pos = torch.cat([torch.arange(10, 20), q_pos[10:]])
        args = (inp.q, q_pos, inp.k, inp.v, inp.k_pos, inp.scale)
        if plan is None:  # four blocks: some with a long unmasked prefix
            plan = plan_query_blocks(q_pos, inp.k_pos, inp.q.shape[0], inp.k.shape[0], blocks=4)
        planned = sparse_query_attention_blocked(*args, plan=plan)
        assert torch.equal(planned, sparse_query_attention_blocked(*args, blocks=4))
        assert_close_tol(planned, sparse_query_attention_ref(*args))
    want = AttentionRoute.SUFFIX if case == "suffix" else AttentionRoute.BLOCKS
    assert plan.route is want
    if case == "blocks":
        assert any(b.lo >= SPLIT_MIN_PREFIX for b in plan.blocks)  # some block's shared prefix is unmasked
    if case == "blind queries":
        assert plan.blind == 10


def test_default_blocks_grow_with_the_keys_on_the_flash_route():
    """Larger query tiles run the flash op faster per pair; longer keys make them worth their larger masked
    spans. The shapes of a default blend's attention after its check layer (SmolLM2, 5 and 10 passages)."""
    from blend.kernels.query_blocks import default_blocks

    assert default_blocks(949, 6227, onednn=False) == 3  # ~6k tokens: was 14
    assert default_blocks(1875, 6227, onednn=False) == 6
    assert default_blocks(937, 3097, onednn=False) == 6  # ~3k
    assert default_blocks(205, 660, onednn=False) == 3  # ~600
    assert default_blocks(10, 100, onednn=False) == 2 and default_blocks(10**6, 1000, onednn=False) == 16
    assert default_blocks(949, 6227, onednn=True) == 14  # oneDNN's GEMMs mask only each span: one per 64 queries


def test_a_plan_for_other_positions_or_heads_is_refused():
    from blend.kernels import plan_query_blocks, sparse_query_attention_blocked

    inp = make_attention_inputs(1, 3, 200, 16, torch.arange(100, 200, 2), torch.float32)
    for plan in (plan_query_blocks(inp.q_pos[1:], inp.k_pos, 3, 1),  # one query fewer
                 plan_query_blocks(inp.q_pos + 1, inp.k_pos, 3, 1),  # the same sizes, other positions
                 plan_query_blocks(inp.q_pos, inp.k_pos, 6, 2)):  # other heads
        with pytest.raises(ValueError, match="plan made for other positions"):
            sparse_query_attention_blocked(*inp.args(), plan=plan)
    equal = plan_query_blocks(inp.q_pos.clone(), inp.k_pos.clone(), 3, 1)  # equal positions, other tensors
    assert torch.equal(sparse_query_attention_blocked(*inp.args(), plan=equal), sparse_query_attention_blocked(*inp.args()))


def test_the_probe_mask_made_once_gives_the_same_bits():
    from blend.kernels import attention_probs, hidden_keys

    gen = torch.Generator().manual_seed(4)
    t, s, d = 150, 12, 16
    q_pos, k_pos = torch.arange(t - s, t), torch.arange(t)
    hidden = hidden_keys(q_pos, k_pos)
    assert hidden.seen == t - s + 1 and tuple(hidden.hide.shape) == (s, s - 1)
    for _ in range(2):
        q, k, v = torch.randn(6, s, d, generator=gen), torch.randn(2, t, d, generator=gen), torch.randn(2, t, d, generator=gen)
        planned, unplanned = attention_probs(q, q_pos, k, v, k_pos, 0.25, hidden), attention_probs(q, q_pos, k, v, k_pos, 0.25)
        assert all(torch.equal(a, b) for a, b in zip(planned, unplanned))
    with pytest.raises(ValueError, match="hidden keys made for other positions"):
        attention_probs(q[:, 1:], q_pos[1:], k, v, k_pos, 0.25, hidden)
    with pytest.raises(ValueError, match="hidden keys made for other positions"):
        attention_probs(q, q_pos - 1, k, v, k_pos, 0.25, hidden)


needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear op")


@needs_onednn
@pytest.mark.parametrize("case", ["long shared prefix", "short prefix", "blind queries", "no GQA", "token-major",
                                  "dim-strided", "bf16"])
def test_onednn_blocks_match_the_flash_route_and_the_reference(case, attention_route):
    """The same blocks as oneDNN GEMMs: within float32 rounding of the flash route (another summation
    order), every query of every block written, blind queries zero, any K/V layout."""
    from blend.kernels import plan_query_blocks, sparse_query_attention_blocked
    from blend.kernels.query_blocks import SPLIT_MIN_PREFIX

    attention_route("onednn", ONEDNN_MIN_KEYS=256)
    t = 300 if case == "short prefix" else SPLIT_MIN_PREFIX + 400
    gen = torch.Generator().manual_seed(11)
    rows = torch.sort(torch.randperm(t - 64, generator=gen)[:150] + 64).values
    layout = {"token-major": Layout.TOKEN_MAJOR, "dim-strided": Layout.DIM_STRIDED}.get(case, Layout.CONTIGUOUS)
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    inp = make_attention_inputs(2, 1 if case == "no GQA" else 3, t, 32, rows, dtype, layout=layout,
                                k_pos=torch.arange(t) + 50)
    q_pos = inp.q_pos
    if case == "blind queries":  # the first ten queries sit before every key
        q_pos = torch.cat([torch.arange(10, 20), q_pos[10:]])
    args = (inp.q, q_pos, inp.k, inp.v, inp.k_pos, inp.scale)
    plan = plan_query_blocks(q_pos, inp.k_pos, inp.q.shape[0], inp.k.shape[0], blocks=4)  # the same blocks on
    assert plan.onednn
    got = sparse_query_attention_blocked(*args, plan=plan)
    attention_route("flash")
    flash_plan = plan_query_blocks(q_pos, inp.k_pos, inp.q.shape[0], inp.k.shape[0], blocks=4)  # both routes
    assert not flash_plan.onednn
    assert [(b.a, b.b, b.tb) for b in plan.blocks] == [(b.a, b.b, b.tb) for b in flash_plan.blocks]
    assert all(b.lo == int((inp.k_pos <= q_pos[b.a]).sum()) for b in plan.blocks)  # the mask only on the span
    assert all(b.none is None for b in plan.blocks)  # only the flash route's merge reads it: not built
    assert all((b.none is None) == (b.mask is None) for b in flash_plan.blocks)
    flash = sparse_query_attention_blocked(*args, plan=flash_plan)
    assert got.dtype == dtype and not torch.isnan(got).any()
    assert_close_tol(got, flash)
    assert_close_tol(got, sparse_query_attention_ref(*args))
    if case == "long shared prefix":
        assert any(b.lo >= SPLIT_MIN_PREFIX for b in plan.blocks)
    if case == "blind queries":
        assert plan.blind == 10 and torch.equal(got[:, :10], torch.zeros_like(got[:, :10]))


@needs_onednn
def test_the_onednn_route_is_decided_by_policy_keys_and_cpu(attention_route):
    import blend.kernels.onednn_attention as O
    from blend.kernels import plan_query_blocks

    def planned(t: int) -> bool:
        k_pos = torch.arange(t)
        return plan_query_blocks(k_pos[t // 2::4], k_pos, 6, 2).onednn

    n = O.ONEDNN_MIN_KEYS
    attention_route("onednn")
    assert planned(n) and not planned(n - 1)  # from ONEDNN_MIN_KEYS keys on
    assert O.attention_label().startswith("attn-onednn-")
    attention_route("flash")
    assert not planned(n) and O.attention_label() == "attn-flash"
    attention_route("auto")
    assert planned(n) == O.onednn_route_default() == (O.cpu_vendor() == "AuthenticAMD")
    attention_route("fastest")
    with pytest.raises(ValueError, match="KVBLEND_ATTENTION_GEMM='fastest' is not one of auto|flash|onednn"):
        planned(n)
    assert not O.use_onednn(n, torch.device("meta"))  # CPU only
    attention_route("onednn")
    k_pos = torch.arange(n)
    for dtype in (torch.bfloat16, torch.float16):  # float32 GEMMs: other dtypes keep the flash op, as their prefill
        assert not plan_query_blocks(k_pos[n // 2::4], k_pos, 6, 2, dtype=dtype).onednn
        assert not O.use_onednn(n, torch.device("cpu"), dtype)


@pytest.mark.parametrize("layout", [Layout.TOKEN_MAJOR, Layout.DIM_STRIDED])
@pytest.mark.parametrize("rows", ["blocks", "suffix"])
def test_the_flash_routes_read_any_layout(layout, rows, attention_route):
    """The CPU flash op, called directly, read operands whose last dim is not dense as if it were
    (wrong numbers, no error): both flash routes make such operands dense first."""
    from blend.kernels import sparse_query_attention_blocked

    attention_route("flash")
    t = 1424
    q_rows = torch.arange(t - 150, t) if rows == "suffix" else torch.sort(torch.randperm(t - 64)[:150] + 64).values
    inp = make_attention_inputs(2, 3, t, 32, q_rows, torch.float32, layout=layout)
    assert_close_tol(sparse_query_attention_blocked(*inp.args()), sparse_query_attention_ref(*inp.args()))


@needs_onednn
@pytest.mark.parametrize("p, s, group", [(300, 150, 3), (200, 64, 3), (257, 130, 1), (120, 200, 2)])
def test_chunked_prefill_on_onednn_matches_the_flash_op_and_reads_an_attached_prefix_in_place(
        p, s, group, attention_route):
    """A segment after cached rows (the exact path's chunked prefill) on oneDNN's GEMMs: within float32
    rounding of the flash op's prefix-and-square program, and the same bits whether the cached rows
    are the front of one tensor or a separate (attached) one."""
    from blend.kernels.suffix_attention import causal_suffix_attention, causal_suffix_attention_parts

    gen = torch.Generator().manual_seed(p + s)
    t, d = p + s, 32
    q = torch.randn(2 * group, s, d, generator=gen)
    k, v = torch.randn(2, t, d, generator=gen), torch.randn(2, t, d, generator=gen)
    attention_route("flash")
    flash = causal_suffix_attention(q, k, v, d ** -0.5)
    attention_route("onednn", SUFFIX_MIN_KEYS=64, SUFFIX_MIN_QUERIES=16)
    whole = causal_suffix_attention(q, k, v, d ** -0.5)
    parts = causal_suffix_attention_parts(q, k[:, :p].clone(), v[:, :p].clone(), k[:, p:].clone(),
                                          v[:, p:].clone(), d ** -0.5)
    assert torch.equal(whole, parts)
    assert_close_tol(whole, flash)
    want = sparse_query_attention_ref(q, torch.arange(p, t), k, v, torch.arange(t), d ** -0.5)
    assert_close_tol(whole, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hkv,group,t,s,d", [
    (1, 7, 1, 1, 96),  # one key, one query, GQA 7
    (2, 3, 5, 20, 80),  # fewer keys than a query block; queries repeat key positions
    (1, 1, 33, 17, 64),  # BLOCK_N + 1 keys, BLOCK_M + 1 queries (interpreted blocks 16 x 32)
    (4, 2, 31, 15, 128),  # BLOCK_N - 1 keys, BLOCK_M - 1 queries
])
def test_attention_kernel_odd_sizes_around_the_blocks(triton_backend, dtype, hkv, group, t, s, d):
    """Sizes a real model sends that the cases above miss: a single query or key, keys shorter than a
    query block, counts one off a block, GQA 7, head dims 80/96."""
    gen = torch.Generator().manual_seed(t + s)
    rows = torch.randint(0, t, (s,), generator=gen)  # unsorted, with repeats when s > t
    _check(make_attention_inputs(hkv, group, t, d, rows, dtype), dtype)
