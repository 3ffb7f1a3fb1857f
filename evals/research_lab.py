"""A selector laboratory: one item's blend prefill, replayed for many selections.

The check-layer state of a blended request (fresh K/V of every row at layers
<= c, the deviations, the question's attention) does not depend on which rows
a selector keeps; only layers >= c's attention and layers > c do. An
:class:`ItemLab` computes that state once per item and then replays the rest
of :func:`blend.blending.prefill_blend` for any set of kept document rows,
with the same kernels (``rope_mix``, ``sparse_query_attention``) in the same
order, so its first-token logits equal the engine's for the same selection
(checked by ``tests/test_evals_research_lab.py``).

It also runs the *query probe*: the question's rows alone through the layers
after the check layer over the re-positioned cached KV of every document (a
ratio-0 blend that keeps the check layer's fresh KV), recording the question's
attention to every document row at every layer.

Research tool only (``evals/``): the engine's blend path is
:mod:`blend.blending`.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from blend.blending import canonical_chunk_kv
from blend.kernels import kv_deviation, rope_mix, sparse_query_attention
from blend.layers import attn_out, mlp_block, project_qkv, rms_norm
from blend.policy import ReusePolicy
from blend.prompt import Prompt
from blend.rope import apply_rope
from blend.runner import SegmentKV


@dataclass(frozen=True)
class CheckState:
    """Per-candidate signals at the check layer (document rows of docs 2..k)."""

    dev_k: torch.Tensor  # (nb,) ||K_fresh - K_cached||
    dev_v: torch.Tensor  # (nb,) ||V_fresh - V_cached||
    v_norm: torch.Tensor  # (nb,) ||V_cached||
    query_attn: torch.Tensor  # (nb,) question's attention mass at the check layer (mean over heads, tokens)
    doc: torch.Tensor  # (nb,) int64 blended-document index
    offset: torch.Tensor  # (nb,) int64 offset inside its document
    budget_base: int  # reused document tokens a ratio counts (all documents, as the engine does)


class KVDiskCache:
    """Canonical chunk KV and full-prefill reference logits, cached on disk by content hash."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "kv").mkdir(parents=True, exist_ok=True)
        (root / "ref").mkdir(parents=True, exist_ok=True)

    @staticmethod
    def _hash(ids) -> str:
        return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:32]

    def chunk(self, engine, prompt: Prompt, j: int) -> SegmentKV:
        """Canonical KV of document ``j`` of ``prompt`` (computed once, then loaded)."""
        ids = prompt.documents[j].token_ids
        path = self.root / "kv" / f"{self._hash(list(prompt.preamble.token_ids) + [-1] + list(ids))}.pt"
        if path.exists():
            k, v = torch.load(path)
            return SegmentKV(k, v)
        with torch.inference_mode():
            kv = canonical_chunk_kv(engine, prompt.preamble, ids)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save((kv.k.contiguous(), kv.v.contiguous()), tmp)
        tmp.replace(path)
        return kv

    def reference(self, engine, prompt: Prompt) -> torch.Tensor:
        """Full prefill's first-token logits (V,) float32."""
        path = self.root / "ref" / f"{self._hash(prompt.token_ids)}.pt"
        if path.exists():
            return torch.load(path)
        with torch.inference_mode():
            logits = engine.generate(prompt, ReusePolicy.none(), max_new_tokens=1).first_logits
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(logits.clone(), tmp)
        tmp.replace(path)
        return logits


def question_attention_rows(q_rot: torch.Tensor, q_pos: torch.Tensor, k_all: torch.Tensor,
                            k_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention probabilities of question queries to every key, per head and query.

    Args:
        q_rot: (Hq, Nq, D) after RoPE; k_all: (Hkv, T, D) after RoPE.

    Returns:
        (Hq, Nq, T) float32 probabilities (causal by absolute position).
    """
    group = q_rot.shape[0] // k_all.shape[0]
    k = k_all.float().repeat_interleave(group, dim=0)  # (Hq, T, D)
    scores = torch.matmul(q_rot.float(), k.transpose(1, 2)) * scale  # (Hq, Nq, T)
    scores = scores.masked_fill(~(k_pos[None, :] <= q_pos[:, None]), float("-inf"))
    return torch.softmax(scores, dim=-1)


@dataclass(frozen=True)
class Probe:
    """The question's attention to the blended document rows at every layer.

    ``mean``: (L, nb) averaged over heads and question tokens; ``last``: (L, nb)
    the last question token only (the one whose logits are the answer), averaged
    over heads; ``headmax``: (L, nb) max over heads of the mean over question tokens.
    ``logits``: (V,) the probe's own first-token logits (a ratio-0 blend with a fresh check layer).
    """

    mean: torch.Tensor
    last: torch.Tensor
    headmax: torch.Tensor
    logits: torch.Tensor


class ItemLab:
    """One blended request's check-layer state, replayable for any selection.

    Args:
        engine: a loaded :class:`blend.engine.Engine`.
        prompt: the request.
        chunks: canonical KV of every document of the prompt, in order.
        check: the check layer.
    """

    def __init__(self, engine, prompt: Prompt, chunks: list[SegmentKV], check: int = 1) -> None:
        self.engine, self.check = engine, check
        runner, d = engine.runner, engine.dims
        self.d = d
        with torch.inference_mode():
            pre = runner.new_cache(len(prompt) + 1)
            runner.prefill(pre, engine._ids(prompt.preamble.token_ids), keep_kv=False)
            runner.load(pre, chunks[0])
            self.cache = pre
            e = pre.length
            self.e = e
            blended = chunks[1:]
            nq = len(prompt.question)
            pad = torch.zeros(d.num_layers, d.num_kv_heads, nq, d.head_dim, dtype=engine.dtype)
            self.k = torch.cat([c.k for c in blended] + [pad], dim=2)  # (L, Hkv, n, D)
            self.v = torch.cat([c.v for c in blended] + [pad], dim=2)  # (L, Hkv, n, D)
            lens = [c.k.shape[2] for c in blended]
            self.nb = nb = sum(lens)
            n = nb + nq
            self.n = n
            self.pos = torch.arange(e, e + n)  # (n,)
            self.cos, self.sin = runner.rope(self.pos)  # (n, R)
            pre.set_positions(e, self.pos)
            self.k_pos = pre.pos[: e + n]  # (T,)
            ids = torch.tensor([t for doc in prompt.documents[1:] for t in doc.token_ids] + list(prompt.question.token_ids))
            h = runner.embed(ids)  # (n, C)
            allrows = torch.arange(n)
            for layer in range(check):
                w = runner.layers[layer]
                qh, kh, vh = project_qkv(w, d, rms_norm(h, w.input_norm, d.eps))
                k_mix, v_mix = rope_mix(self.k[layer], self.v[layer], self.cos, self.sin, allrows, kh, vh,
                                        trusted_indices=True)
                pre.write(layer, e, k_mix, v_mix)
                k_all, v_all = pre.view(layer, e + n)
                attn = sparse_query_attention(apply_rope(qh, self.cos, self.sin), self.pos, k_all, v_all,
                                              self.k_pos, d.scale)
                h = mlp_block(w, d, attn_out(w, h, attn.transpose(0, 1).reshape(n, -1)))
            self.h_check = h  # (n, C) input of the check layer
            w = runner.layers[check]
            self.qh, kh, vh = project_qkv(w, d, rms_norm(h, w.input_norm, d.eps))  # (Hq, n, D) ...
            self.kh_check, self.vh_check = kh, vh
            rows = torch.arange(nb)
            dev_k = kv_deviation(kh[:, :nb], self.k[check][:, :nb])  # (nb,)
            dev_v = kv_deviation(vh[:, :nb], self.v[check][:, :nb])  # (nb,)
            v_norm = self.v[check][:, :nb].float().pow(2).sum(dim=(0, 2)).sqrt().clamp_min(1e-12)
            k_mix, v_mix = rope_mix(self.k[check], self.v[check], self.cos, self.sin, allrows, kh, vh,
                                    trusted_indices=True)
            pre.write(check, e, k_mix, v_mix)
            k_all, _ = pre.view(check, e + n)
            qi = torch.arange(nb, n)
            q_rot = apply_rope(self.qh[:, qi], self.cos[qi], self.sin[qi])
            probs = question_attention_rows(q_rot, self.pos[qi], k_all, self.k_pos, d.scale)  # (Hq, Nq, T)
            self.check_probs_full = probs  # (Hq, Nq, T)
            qa = probs.mean(dim=(0, 1))[e + rows]  # (nb,)
            self.state = CheckState(
                dev_k=dev_k, dev_v=dev_v, v_norm=v_norm, query_attn=qa,
                doc=torch.cat([torch.full((m,), j, dtype=torch.long) for j, m in enumerate(lens)]),
                offset=torch.cat([torch.arange(m) for m in lens]),
                budget_base=sum(len(doc) for doc in prompt.documents),
            )
        self._probe: Probe | None = None

    def run(self, keep_doc: torch.Tensor, record: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Replay the blend from the check layer, recomputing ``keep_doc`` rows and the question.

        Args:
            keep_doc: (S,) document rows (in [0, nb)) to recompute.
            record: also return the question's attention probabilities at each layer >= check.

        Returns:
            first-token logits (V,) float32, and [(Hq, Nq, T)] per layer from the check layer (if record).
        """
        runner, d, e, n, nb = self.engine.runner, self.d, self.e, self.n, self.nb
        keep = torch.cat([torch.sort(keep_doc.long()).values, torch.arange(nb, n)])  # (A,)
        recorded = []
        with torch.inference_mode():
            check = self.check
            # check layer: every row's fresh K/V is in the cache already (written in __init__)
            k_all, v_all = self.cache.view(check, e + n)
            qh, h, active = self.qh[:, keep], self.h_check[keep], keep
            for layer in range(check, d.num_layers):
                w = runner.layers[layer]
                if layer > check:
                    qh, kh, vh = project_qkv(w, d, rms_norm(h, w.input_norm, d.eps))
                    k_mix, v_mix = rope_mix(self.k[layer], self.v[layer], self.cos, self.sin, active, kh, vh,
                                            trusted_indices=True)
                    self.cache.write(layer, e, k_mix, v_mix)
                    k_all, v_all = self.cache.view(layer, e + n)
                q_rot = apply_rope(qh, self.cos[active], self.sin[active])  # (Hq, A, D)
                if record:
                    nq = n - nb
                    recorded.append(question_attention_rows(q_rot[:, -nq:], self.pos[active[-nq:]], k_all,
                                                            self.k_pos, d.scale))
                attn = sparse_query_attention(q_rot, self.pos[active], k_all, v_all, self.k_pos, d.scale)
                h = attn_out(w, h, attn.transpose(0, 1).reshape(h.shape[0], -1))
                h = mlp_block(w, d, h)
            return runner.logits(h[-1:])[0], recorded

    def probe(self) -> Probe:
        """The query probe (computed once): question rows only, all layers, attention recorded."""
        if self._probe is None:
            logits, rec = self.run(torch.empty(0, dtype=torch.long), record=True)
            e, nb = self.e, self.nb
            per = rec  # layers check..L-1, each (Hq, Nq, T)
            mean = torch.stack([p.mean(dim=(0, 1))[e:e + nb] for p in per])  # (L', nb)
            last = torch.stack([p[:, -1].mean(dim=0)[e:e + nb] for p in per])  # (L', nb)
            headmax = torch.stack([p.mean(dim=1).max(dim=0).values[e:e + nb] for p in per])  # (L', nb)
            self._probe = Probe(mean=mean, last=last, headmax=headmax, logits=logits)
        return self._probe
