"""Sampling: greedy is argmax, a seed fixes the draw, top-k / top-p restrict the support."""

import pytest
import torch

from blend.errors import InvalidRequestError
from blend.sampling import GenerationConfig, Sampler, sample

V = 50


def logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3  # (V,)


def draws(cfg: GenerationConfig, n: int, x: torch.Tensor) -> list[int]:
    s = Sampler(cfg)
    return [s(x) for _ in range(n)]


def test_greedy_is_argmax_and_ignores_the_seed():
    x = logits()
    assert draws(GenerationConfig(temperature=0.0, seed=1), 5, x) == [int(x.argmax())] * 5
    assert draws(GenerationConfig(temperature=0.0), 1, x) == [int(x.argmax())]


def test_a_seed_fixes_the_sequence_and_another_seed_changes_it():
    x = logits()
    a = draws(GenerationConfig(temperature=1.0, seed=7), 40, x)
    assert a == draws(GenerationConfig(temperature=1.0, seed=7), 40, x)
    assert a != draws(GenerationConfig(temperature=1.0, seed=8), 40, x)
    assert len(set(a)) > 1  # it does sample


def test_top_k_and_top_p_restrict_the_support():
    x = logits(3)
    top3 = set(torch.topk(x, 3).indices.tolist())
    assert set(draws(GenerationConfig(temperature=1.5, top_k=3, seed=0), 300, x)) <= top3
    assert draws(GenerationConfig(temperature=1.5, top_k=1, seed=0), 20, x) == [int(x.argmax())] * 20
    assert draws(GenerationConfig(temperature=1.0, top_p=1e-6, seed=0), 20, x) == [int(x.argmax())] * 20
    probs = torch.softmax(x, -1)
    p_sorted, order = torch.sort(probs, descending=True)
    nucleus = set(order[: int((torch.cumsum(p_sorted, 0) < 0.8).sum()) + 1].tolist())
    got = set(draws(GenerationConfig(temperature=1.0, top_p=0.8, seed=1), 400, x))
    assert got <= nucleus and len(got) > 1


def test_temperature_sharpens():
    x = logits(5)
    cold = draws(GenerationConfig(temperature=0.05, seed=2), 200, x)
    warm = draws(GenerationConfig(temperature=2.0, seed=2), 200, x)
    assert cold.count(int(x.argmax())) > warm.count(int(x.argmax()))


def test_sample_uses_only_the_given_generator():
    x = logits() / 3  # a flat row (logits() puts 0.97 on its argmax): the draws really vary
    cfg = GenerationConfig(temperature=1.0)
    a = [sample(x, cfg, g) for g in [torch.Generator().manual_seed(4)] for _ in range(20)]
    torch.manual_seed(123)  # the global RNG plays no part
    b = [sample(x, cfg, g) for g in [torch.Generator().manual_seed(4)] for _ in range(20)]
    assert a == b
    assert len(set(a)) > 1  # drawn, not the argmax every time
    c = [sample(x, cfg, g) for g in [torch.Generator().manual_seed(5)] for _ in range(20)]
    assert c != a  # another generator, other draws


@pytest.mark.parametrize("kw, message", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": -0.1}, "top_p"), ({"top_k": -1}, "top_k"), ({"seed": -(2**63) - 1}, "seed"), ({"stop": ("",)}, "stop"),
    ({"stop": ("a",) * 5}, "stop"), ({"stop": "abc"}, "stop"), ({"max_tokens": True}, "max_tokens"),
])
def test_bad_settings_are_clear_errors(kw, message):
    with pytest.raises(InvalidRequestError, match=message):
        GenerationConfig(**kw)


def test_logprobs_are_the_rows_log_softmax_with_its_best_alternatives():
    from blend.logprobs import token_logprob

    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    e = token_logprob(logits, 2, 2)
    ref = torch.log_softmax(logits, -1)
    assert e.token_id == 2 and e.logprob == pytest.approx(float(ref[2]))
    assert [t for t, _ in e.top] == [1, 2] and e.top[0][1] == pytest.approx(float(ref[1]))
    assert token_logprob(logits, 0, 0).top == ()


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5])
def test_logprobs_setting_is_checked(bad):
    with pytest.raises(InvalidRequestError, match="logprobs"):
        GenerationConfig(logprobs=bad)


def test_penalties_follow_openais_definition_and_steer_greedy():
    from blend.sampling import adjust_logits

    logits = torch.tensor([0.0, 3.0, 2.5, 1.0])
    cfg = GenerationConfig(presence_penalty=0.4, frequency_penalty=0.2)
    out = adjust_logits(logits, cfg, {1: 2, 3: 1})
    assert torch.allclose(out, torch.tensor([0.0, 3.0 - 0.4 - 0.4, 2.5, 1.0 - 0.2 - 0.4]))
    assert adjust_logits(logits, GenerationConfig(), {1: 5}) is logits  # nothing to adjust: no copy
    g = torch.Generator()
    assert sample(logits, GenerationConfig(), g, {1: 3}) == 1
    assert sample(logits, GenerationConfig(frequency_penalty=0.2), g, {1: 3}) == 2  # 3.0 - 0.6 < 2.5


def test_logit_bias_forces_and_bans_tokens():
    logits = torch.tensor([0.0, 3.0, 2.5, 1.0])
    g = torch.Generator()
    assert sample(logits, GenerationConfig(logit_bias=((1, -100.0),)), g) == 2
    assert sample(logits, GenerationConfig(logit_bias=((0, 100.0),), temperature=1.0, seed=1), g) == 0


@pytest.mark.parametrize("kw", [{"presence_penalty": 2.5}, {"frequency_penalty": float("nan")},
                                {"logit_bias": ((1, 101.0),)}, {"logit_bias": ((-1, 1.0),)},
                                {"logit_bias": [(1, 1.0)]}, {"logit_bias": ((True, 1.0),)},
                                {"logit_bias": ((5, 100.0), (5, 100.0))}])  # summed past the bound: refused
def test_penalty_and_bias_settings_are_checked(kw):
    with pytest.raises(InvalidRequestError):
        GenerationConfig(**kw)


def test_an_integer_too_large_for_a_float_is_a_refused_setting_not_an_overflow():
    from blend.sampling import InvalidSettingError

    for field in ("temperature", "top_p", "frequency_penalty"):
        with pytest.raises(InvalidSettingError, match=field):
            GenerationConfig(**{field: 10**400})
    with pytest.raises(InvalidSettingError, match="logit_bias"):
        GenerationConfig(logit_bias=((5, 10**400),))


def test_logprob_token_texts_keep_a_sentencepiece_words_leading_space():
    """Llama/Mistral tokenizers mark a word's space with U+2581 and decoding one token alone drops it:
    each token's text and bytes keep it, so the tokens join up to the answer (its very first space
    aside, which the tokenizer strips from the start of any text)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from blend.logprobs import TokenLogprob
    from blend.serve.protocol import Endpoint, LogprobFormat
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581": 3, "\u2581Paris": 4, "\u2581is": 5, "\u2581big": 6, "<0xE2>": 7}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    entries = tuple(TokenLogprob(t, -0.1) for t in (4, 5, 6, 7))
    comp = LogprobFormat(Endpoint.COMPLETIONS, tok, True).format(entries)
    # the offsets index the answer's text, "Paris is big\ufffd" (its first space stripped, as any decode does)
    assert comp["tokens"] == [" Paris", " is", " big", "\ufffd"] and comp["text_offset"] == [0, 5, 8, 12]
    chat = LogprobFormat(Endpoint.CHAT, tok, True).format(entries)
    assert [bytes(e["bytes"]) for e in chat["content"]] == [b" Paris", b" is", b" big", b"\xe2"]


def test_top_p_zero_keeps_only_the_most_likely_token_and_any_signed_64_bit_seed_samples():
    """OpenAI's top_p may be 0 and its seed any signed 64-bit integer (tools send -1)."""
    logits = torch.tensor([0.5, 2.0, 1.9, -1.0])
    only = GenerationConfig(temperature=1.0, top_p=0.0, seed=-1)
    assert {Sampler(only)(logits) for _ in range(5)} == {1}  # the argmax, never a draw past it
    for seed in (-1, -(2**63), 2**63 - 1):
        a, b = Sampler(GenerationConfig(temperature=1.0, seed=seed)), Sampler(GenerationConfig(temperature=1.0, seed=seed))
        assert [a(logits) for _ in range(8)] == [b(logits) for _ in range(8)]  # the same seed, the same draws
    wide = GenerationConfig(temperature=1.0, top_p=0.5, seed=3)  # a top_p > 0 keeps what it kept before
    assert {Sampler(wide)(logits) for _ in range(3)} <= {1, 2}
