"""Decoding as OpenAI defines it, with transformers as the numeric reference: greedy answers token for token,
the distribution a sampled token is drawn from, log-probabilities, budgets, stop strings, usage, and the
fields kvblend refuses, through the Python API and the official ``openai`` client (tiny model, one server)."""

from __future__ import annotations

import threading

import openai
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from _serve_util import TINY, one_torch_thread, running_server, tiny_serve_engine  # noqa: F401
from blend.generation import generate
from blend.logprobs import token_bytes, token_logprob
from blend.policy import ReusePolicy
from blend.sampling import GenerationConfig, Sampler, sampling_distribution
from blend.serve.config import SchedulerConfig, ServeConfig
from conftest import make_docs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N = 10  # answer tokens compared
LONG = 32  # answer tokens of requests meant to decode in shared steps (long enough to overlap)
CASES = [(f"question {i}?", make_docs(1 + i % 3, words=8 + 5 * i, seed=20 + i)) for i in range(4)]


@pytest.fixture(scope="module")
def srv(one_torch_thread):
    engine = tiny_serve_engine()
    with running_server(engine, ServeConfig(model=TINY, scheduler=SchedulerConfig(max_concurrency=4))) as running:
        running.engine = engine
        yield running


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def chat_kw(case: int, **kw) -> dict:
    question, docs = CASES[case]
    kw.setdefault("max_tokens", N)
    return {"model": TINY, "messages": [{"role": "user", "content": question}], "temperature": 0,
            "extra_body": {"documents": docs, "ignore_eos": True}, **kw}


def prompt_ids(engine, case: int) -> list[int]:
    question, docs = CASES[case]
    return engine.build_prompt(question, docs).token_ids


def hf_rows(engine, ids: list[int], answer: list[int]) -> torch.Tensor:
    """transformers' logits rows (len(answer), V) that chose each answer token."""
    with torch.no_grad():
        return engine.runner.loaded.model(torch.tensor([ids + answer])).logits[0, len(ids) - 1:-1].float()


def hf_greedy(engine, ids: list[int], n: int, presence: float = 0.0, frequency: float = 0.0,
              bias: dict[int, float] | None = None) -> list[int]:
    """transformers' greedy continuation, with OpenAI's penalties and logit_bias written out here:
    ``logit[t] - frequency * count[t] - presence * (count[t] > 0) + bias[t]`` over the answer so far."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            row = engine.runner.loaded.model(torch.tensor([ids + out])).logits[0, -1].float().clone()
        for t in set(out):
            row[t] -= frequency * out.count(t) + presence
        for t, b in (bias or {}).items():
            row[t] += b
        out.append(int(row.argmax()))
    return out


def tokens_of(r) -> list[int]:
    return r.model_extra["kvblend"]["answer_token_ids"]


def concurrently(client, requests: list[dict]) -> list:
    out: list = [None] * len(requests)

    def go(i: int) -> None:
        out[i] = client.chat.completions.create(**requests[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


# ---- greedy: transformers' continuation, alone, reused and batched ----

def test_greedy_is_transformers_continuation_cold_reused_and_batched_in_the_pool(srv, client):
    engine, sched = srv.engine, srv.scheduler
    refs = [hf_greedy(engine, prompt_ids(engine, i), LONG) for i in range(len(CASES))]
    question, docs = CASES[0]
    api = generate(engine, engine.build_prompt(question, docs), ReusePolicy.exact(),
                   GenerationConfig(max_tokens=LONG, ignore_eos=True))
    assert api.token_ids == refs[0]
    for i in range(len(CASES)):  # alone; the second time its preamble and documents are exact hits
        cold, warm = (client.chat.completions.create(**chat_kw(i, max_tokens=LONG)) for _ in range(2))
        assert tokens_of(cold) == tokens_of(warm) == refs[i], i
        assert warm.usage.prompt_tokens_details.cached_tokens > 0
        assert cold.choices[0].finish_reason == "length" and cold.usage.completion_tokens == LONG
    steps, adopted = sched.steps, sched.pool.adopted
    together = concurrently(client, [chat_kw(i, max_tokens=LONG) for i in range(len(CASES))])
    assert [tokens_of(r) for r in together] == refs
    assert sched.pool.adopted - adopted == len(CASES)  # each decoded from a pool slot
    assert sched.steps - steps < len(CASES) * (LONG - 1)  # in shared steps


# ---- sampling: the distribution drawn from, seeds ----

def hf_distribution(logits: torch.Tensor, cfg: GenerationConfig) -> torch.Tensor:
    """transformers' sampling distribution: temperature, then top-k, then top-p, then softmax."""
    scores = TemperatureLogitsWarper(cfg.temperature)(None, logits[None].clone())
    if cfg.top_k:
        scores = TopKLogitsWarper(cfg.top_k)(None, scores)
    if cfg.top_p < 1.0:
        scores = TopPLogitsWarper(max(cfg.top_p, 1e-12))(None, scores)  # transformers' own refuses 0
    return torch.softmax(scores[0], dim=-1)


@pytest.mark.parametrize("temperature", [1e-5, 1e-3, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("top_p, top_k", [(1.0, 0), (1e-9, 0), (0.0, 0), (0.3, 0), (0.9, 0), (1.0, 7), (0.8, 20),
                                          (1.0, 259)])
def test_the_sampled_distribution_is_transformers_temperature_top_k_top_p(temperature, top_p, top_k):
    g = torch.Generator().manual_seed(int(temperature * 1e5) + top_k)
    for scale in (0.5, 3.0, 10.0):
        logits = torch.randn(259, generator=g) * scale  # (V,)
        cfg = GenerationConfig(temperature=temperature, top_p=top_p, top_k=top_k)
        ours, ref = sampling_distribution(logits, cfg), hf_distribution(logits, cfg)
        assert torch.equal(ours > 0, ref > 0)  # the same support
        assert torch.allclose(ours, ref, atol=1e-6, rtol=1e-4)


def test_draws_follow_that_distribution_and_a_seed_fixes_them():
    logits = torch.randn(12, generator=torch.Generator().manual_seed(3)) * 1.5  # (V,)
    cfg = GenerationConfig(temperature=1.3, top_p=0.9, top_k=8, seed=77)
    want = sampling_distribution(logits, cfg)
    sampler = Sampler(cfg)
    draws = [sampler(logits) for _ in range(4000)]
    freq = torch.bincount(torch.tensor(draws), minlength=12).float() / len(draws)
    assert torch.equal(freq > 0, want > 0)  # never outside the support
    assert (freq - want).abs().max() < 0.03
    again = Sampler(cfg)
    assert [again(logits) for _ in range(200)] == draws[:200]
    greedy = sampling_distribution(logits, GenerationConfig(temperature=0))
    assert int(greedy.argmax()) == int(logits.argmax()) and float(greedy.sum()) == 1.0


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(srv, client, tiny_engine_factory):
    sampled = [chat_kw(i, temperature=t, top_p=p, seed=s, max_tokens=LONG)
               for i, (t, p, s) in enumerate([(1.0, 1.0, 1), (2.0, 0.95, -5), (0.7, 0.5, 2**63 - 1), (1.5, 1.0, 0)])]
    alone = [tokens_of(client.chat.completions.create(**kw)) for kw in sampled]
    steps = srv.scheduler.steps
    together = [tokens_of(r) for r in concurrently(client, sampled)]
    assert together == alone
    assert srv.scheduler.steps - steps < len(sampled) * (LONG - 1)  # drawn in shared steps
    fresh = tiny_engine_factory()  # another engine, its own store: the same seed draws the same answer
    question, docs = CASES[1]
    cfg = GenerationConfig(max_tokens=LONG, temperature=2.0, top_p=0.95, seed=-5, ignore_eos=True)
    assert generate(fresh, fresh.build_prompt(question, docs), ReusePolicy.exact(), cfg).token_ids == alone[1]
    assert len({tuple(t) for t in alone}) == len(alone)


# ---- logprobs ----

def test_equal_log_probabilities_are_listed_in_token_id_order_with_the_greedy_token_first():
    """torch.topk orders ties arbitrarily: a greedy answer's token (the argmax, the lowest id among the best)
    was listed after another token of the same log-probability, and which of the tokens tied at the n-th
    place made the list was arbitrary."""
    logits = torch.zeros(300)  # (V,)
    logits[[201, 82, 250, 7]] = 3.0  # four tied best, then a tie of many at 0
    entry = token_logprob(logits, int(logits.argmax()), 6)
    assert entry.token_id == 7
    assert [t for t, _ in entry.top] == [7, 82, 201, 250, 0, 1]
    assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
    values = torch.randn(259, generator=torch.Generator().manual_seed(1)).bfloat16().float()  # bf16: ties
    ids = [t for t, _ in token_logprob(values, 0, 20).top]
    logp = torch.log_softmax(values, -1)
    assert sorted(ids, key=lambda t: (-float(logp[t]), t)) == ids


def test_logprobs_are_transformers_log_softmax_streamed_or_not(srv, client):
    engine = srv.engine
    kw = chat_kw(2, temperature=1.5, seed=11, logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**kw)
    answer, content = tokens_of(r), r.choices[0].logprobs.content
    ref = torch.log_softmax(hf_rows(engine, prompt_ids(engine, 2), answer), dim=-1)  # (N, V)
    assert len(content) == len(answer) == N
    outside = 0
    for c, t, row in zip(content, answer, ref):
        assert c.logprob == pytest.approx(float(row[t]), abs=1e-4)  # the raw distribution's, sampled or not
        assert bytes(c.bytes) == token_bytes(engine.tokenizer, t)
        vals, ids = torch.topk(row, 3)
        assert [a.logprob for a in c.top_logprobs] == pytest.approx(vals.tolist(), abs=1e-4)
        assert [bytes(a.bytes) for a in c.top_logprobs] == [token_bytes(engine.tokenizer, int(i)) for i in ids]
        outside += c.logprob < c.top_logprobs[-1].logprob
    assert outside > 0  # a sampled token outside the top 3 still has its own entry
    parts = list(client.chat.completions.create(**kw, stream=True))
    streamed = [c for p in parts for ch in p.choices if ch.logprobs for c in ch.logprobs.content]
    assert [(c.token, c.logprob, c.bytes) for c in streamed] == [(c.token, c.logprob, c.bytes) for c in content]


def test_completions_top_logprobs_hold_the_sampled_token_as_openais_do(srv, client):
    """OpenAI's completions: "the API will always return the logprob of the sampled token, so there may be up
    to logprobs+1 elements" in each top_logprobs dict (vLLM's too); a sampled token outside the top N was
    missing from it."""
    question, docs = CASES[2]
    r = client.completions.create(model=TINY, prompt=question, max_tokens=N, temperature=1.5, seed=11, logprobs=2,
                                  extra_body={"documents": docs, "ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.top_logprobs) == N
    for token, logprob, alts in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(alts) <= 3 and token in alts
        if token != "\ufffd":  # pieces of multi-byte characters share that text: one value is kept
            assert alts[token] == logprob
    assert any(len(alts) == 3 for alts in lp.top_logprobs)  # sampled outside the top 2: listed too
    none = client.completions.create(model=TINY, prompt=question, max_tokens=3, temperature=0, logprobs=0,
                                     extra_body={"documents": docs})
    assert all(list(alts) == [t] for t, alts in zip(none.choices[0].logprobs.tokens,
                                                    none.choices[0].logprobs.top_logprobs))


# ---- budgets, stop strings, usage, streaming ----

def streamed(client, kw: dict) -> tuple[str, list[str], object]:
    """A stream's text, its finish reasons and its usage chunk's usage."""
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, finish, chunks[-1].usage


def test_budgets_stop_strings_and_usage_agree_streamed_or_not(srv, client):
    full = client.chat.completions.create(**chat_kw(3, temperature=1.0, seed=5, max_tokens=16))
    text, tokens = full.choices[0].message.content, tokens_of(full)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 16
    both = client.chat.completions.create(**chat_kw(3, temperature=1.0, seed=5, max_tokens=16,
                                                    max_completion_tokens=5))
    assert tokens_of(both) == tokens[:5] and both.usage.completion_tokens == 5  # max_completion_tokens wins
    k = next(k for k in range(4, len(text) - 2) if "\ufffd" not in text[k:k + 2] and text.find(text[k:k + 2]) == k)
    stop = text[k:k + 2]  # two characters: two tokens at least (a byte-level tokenizer)
    cases = [(chat_kw(3, temperature=1.0, seed=5, max_tokens=16, stop=[stop, "\u20ac\u20ac"]), text[:k], "stop"),
             (chat_kw(3, temperature=1.0, seed=5, max_tokens=7), None, "length")]
    for kw, want, reason in cases:
        r = client.chat.completions.create(**kw)
        got = r.choices[0].message.content
        assert r.choices[0].finish_reason == reason
        if want is not None:
            assert got == want
            # every token up to the one that completed the stop string is counted
            assert len(tokens_of(r)) == r.usage.completion_tokens < 16
            assert engine_text(srv.engine, tokens_of(r)).startswith(text[:k] + stop)
        s_text, s_finish, s_usage = streamed(client, kw)
        assert (s_text, s_finish) == (got, [reason])
        assert s_usage.model_dump() == r.usage.model_dump()


def engine_text(engine, tokens: list[int]) -> str:
    return engine.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)


# ---- penalties, logit_bias, n ----

def test_penalties_and_logit_bias_are_openais_formula_over_transformers_logits(srv, client):
    engine = srv.engine
    ids = prompt_ids(engine, 0)
    plain = hf_greedy(engine, ids, N)
    bias = {plain[0]: -100.0, 65: 5.0}
    want = hf_greedy(engine, ids, N, presence=1.5, frequency=0.7, bias=bias)
    assert want != plain
    r = client.chat.completions.create(**chat_kw(0, presence_penalty=1.5, frequency_penalty=0.7,
                                                 logit_bias={str(t): b for t, b in bias.items()}))
    assert tokens_of(r) == want


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_n_above_one_is_refused_naming_the_field(srv, path):
    import httpx

    question, _ = CASES[0]
    body = {"model": TINY, "n": 2, "max_tokens": 2,
            **({"messages": [{"role": "user", "content": question}]} if "chat" in path else {"prompt": question})}
    r = httpx.post(srv.url + path, json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert httpx.post(srv.url + path, json={**body, "n": 1}, timeout=30).status_code == 200


@pytest.mark.parametrize("stop, text, tokens", [
    (("\u20ac",), "price 5", len("price 5\u20ac".encode())),  # a 3-byte character: cut where it starts
    (("5\u20ac n",), "price ", len("price 5\u20ac n".encode())),  # across a character's bytes and tokens
    (("w\u00f6",), "price 5\u20ac no", len("price 5\u20ac now\u00f6".encode())),
])
def test_a_multibyte_stop_string_cuts_where_it_starts_and_counts_its_tokens(stop, text, tokens):
    from blend.generation import FinishReason, TokenStream
    from blend.tiny import byte_tokenizer

    s = TokenStream(byte_tokenizer(), {258}, GenerationConfig(max_tokens=64, stop=stop))
    deltas = []
    for b in "price 5\u20ac now\u00f6 later".encode():
        row = torch.full((259,), -10.0)  # (V,)
        row[b] = 10.0
        deltas.append(s.step(row))
        if s.finished:
            break
    assert (s.text, s.finish_reason, len(s.tokens)) == (text, FinishReason.STOP, tokens)
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
