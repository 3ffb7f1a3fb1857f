"""Generation: stop rules, streamed text, usage, and agreement with Engine.generate."""

import pytest
import torch

from blend.generation import FinishReason, TokenStream, generate, logits_sha256, stream
from blend.policy import ReusePolicy
from blend.sampling import GenerationConfig
from blend.tiny import byte_tokenizer
from _serve_util import one_torch_thread  # noqa: F401 - module fixture
from conftest import make_docs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOK = byte_tokenizer()
EOS = 258


def forced(token: int) -> torch.Tensor:
    x = torch.full((259,), -10.0)  # (V,)
    x[token] = 10.0
    return x


def run(text: str | bytes, eos: bool = False, **cfg) -> tuple[TokenStream, list[str]]:
    """Feed the bytes of ``text`` (then EOS) to a greedy TokenStream; returns it and its deltas."""
    s = TokenStream(TOK, {EOS}, GenerationConfig(**{"max_tokens": 100, **cfg}))
    data = text.encode() if isinstance(text, str) else text
    deltas = []
    for b in list(data) + ([EOS] if eos else []):
        if s.finished:
            break
        deltas.append(s.step(forced(b)))
    return s, deltas


def test_stop_string_cuts_the_text_and_counts_its_tokens():
    s, deltas = run("hello STOP world", stop=("STOP",))
    assert s.finish_reason is FinishReason.STOP
    assert s.text == "hello " == "".join(deltas)
    assert len(s.tokens) == len("hello STOP")


def test_a_partial_stop_string_is_held_back_until_resolved():
    s, deltas = run("ab STx done", stop=("STOP",), max_tokens=len("ab STx done"))
    assert s.finish_reason is FinishReason.LENGTH
    shown = ""
    for d in deltas:  # while "ST" could still become "STOP", it is not shown
        shown += d
        assert not shown.endswith(("S", "ST"))
    assert shown == "ab STx done"


def test_invalid_bytes_before_a_stop_string_stay_in_the_answer():
    """Text cut before a stop string is final: its U+FFFDs are invalid bytes the later ones followed, not an
    incomplete character (they were dropped, so the answer lost them)."""
    s, deltas = run(b"\xe6\xf0C rest", stop=("C",))
    assert s.finish_reason is FinishReason.STOP and s.text == "\ufffd\ufffd" == "".join(deltas)
    s, _ = run(b"ab\xe6", max_tokens=3)  # the answer ends inside a character: its U+FFFD too
    assert s.finish_reason is FinishReason.LENGTH and s.text == "ab\ufffd"


def test_the_earliest_of_several_stop_strings_wins():
    s, _ = run("one. two! three", stop=("!", "."))
    assert s.text == "one"


def test_newline_rule_is_an_option():
    s, _ = run("first line\nsecond", stop_at_newline=True)
    assert s.text == "first line" and s.finish_reason is FinishReason.STOP
    assert len(s.tokens) == len("first line")  # the newline token is not part of the answer
    s, _ = run("first line\nsecond", eos=True)
    assert s.text == "first line\nsecond" and s.finish_reason is FinishReason.STOP


def test_eos_and_max_tokens():
    s, _ = run("abc", eos=True)
    assert (s.text, s.finish_reason, len(s.tokens)) == ("abc", FinishReason.STOP, 3)
    s, _ = run("abc", eos=True, ignore_eos=True)
    assert s.tokens == [97, 98, 99, EOS] and not s.finished
    s, _ = run("abcdef", max_tokens=4)
    assert (s.text, s.finish_reason, len(s.tokens)) == ("abcd", FinishReason.LENGTH, 4)
    with pytest.raises(RuntimeError):
        s.step(forced(1))


def test_multibyte_characters_are_streamed_whole():
    s, deltas = run("é€x".encode(), max_tokens=6)
    assert [d for d in deltas if d] == ["é", "€", "x"]
    assert s.text == "é€x"


def test_generate_matches_engine_generate_greedy(tiny_engine):
    prompt = tiny_engine.build_prompt("which river?", make_docs(3))
    for policy in (ReusePolicy.exact(), ReusePolicy.blend(ratio=0.3)):
        old = tiny_engine.generate(prompt, policy, max_new_tokens=12)
        new = generate(tiny_engine, prompt, policy, GenerationConfig(max_tokens=12, stop_at_newline=True))
        assert new.token_ids == old.token_ids
        assert new.logits_sha256() == old.logits_sha256()
        # completion tokens: the answer's, and the EOS or newline token that ended it (a decode step computed it)
        ended_by_a_token = new.finish_reason.value == "stop"  # no stop strings here: an EOS or a newline
        assert new.usage.prompt_tokens == len(prompt)
        assert new.usage.completion_tokens == len(new.token_ids) + ended_by_a_token
        assert new.usage.cached_tokens == new.report.reused_tokens


def test_stream_yields_the_answer_piece_by_piece_and_a_seed_fixes_it(tiny_engine):
    prompt = tiny_engine.build_prompt("which stone?", make_docs(2))
    cfg = GenerationConfig(max_tokens=20, temperature=0.9, top_p=0.9, seed=11)
    g = stream(tiny_engine, prompt, config=cfg)
    pieces = list(g)
    done = g.result()
    assert "".join(pieces) == done.text and len(pieces) > 1
    again = generate(tiny_engine, prompt, config=cfg)
    assert again.token_ids == done.token_ids and again.steps_sha256 == done.steps_sha256
    other = generate(tiny_engine, prompt, config=GenerationConfig(max_tokens=20, temperature=0.9, top_p=0.9, seed=12))
    assert other.token_ids != done.token_ids
    assert other.logits_sha256() == done.logits_sha256()  # the prompt's logits do not depend on the seed


class _DeviceRow(torch.Tensor):
    """A logits row that, like one on a GPU, has no numpy view until it is copied to the CPU."""

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first.")

    def cpu(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor)


def test_logits_from_an_accelerator_are_sampled_and_hashed_on_the_cpu():
    # A CUDA engine's prefill and decode steps return their logits on the GPU.
    text = "hi"
    cfg = GenerationConfig(max_tokens=len(text), temperature=0.8, seed=3, logprobs=1)
    on_cpu, on_dev = TokenStream(TOK, {EOS}, cfg), TokenStream(TOK, {EOS}, cfg)
    for b in text.encode():
        row = forced(b)
        on_cpu.step(row)
        on_dev.step(row.clone().as_subclass(_DeviceRow))
    assert on_dev.text == on_cpu.text == text and on_dev.steps_sha256 == on_cpu.steps_sha256
    assert on_dev.logprobs == on_cpu.logprobs
    assert logits_sha256(forced(1).as_subclass(_DeviceRow)) == logits_sha256(forced(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_generate_on_a_cuda_engine_matches_its_stream(tiny_engine_factory):
    engine = tiny_engine_factory(device="cuda")
    prompt = engine.build_prompt("which stone?", make_docs(2))
    cfg = GenerationConfig(max_tokens=8, temperature=0.9, seed=5, logprobs=2)
    g = stream(engine, prompt, config=cfg)
    pieces = list(g)
    done = g.result()
    assert "".join(pieces) == done.text and len(done.logprobs) == len(done.token_ids)
    assert generate(engine, prompt, config=cfg).token_ids == done.token_ids
    assert len(done.logits_sha256()) == 64


def test_a_long_answer_decodes_a_window_per_token_not_the_whole_answer():
    """decode(all tokens) at every step made an answer's text O(n^2) (1.1 ms per step at 4k tokens with
    SmolLM2's tokenizer, per stream of a batch); the stream's text is the same either way."""
    decoded = []

    class Counting:
        clean_up_tokenization_spaces = False

        def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None):
            decoded.append(len(ids))
            return TOK.decode(ids, skip_special_tokens=skip_special_tokens)

    text = ("naïve café 😀 " * 200).encode()  # ~3.6k byte tokens, multi-byte characters among them
    s = TokenStream(Counting(), {EOS}, GenerationConfig(max_tokens=len(text), stop=("zz",)))
    pieces = [s.step(forced(b)) for b in text]
    assert s.finished and "".join(pieces) == s.text == text.decode()
    assert sum(decoded) < 8 * len(text)  # was ~len(text)^2 / 2


def test_a_logit_bias_on_a_token_outside_the_vocabulary_is_refused(tiny_engine):
    """The server refused such ids; the Python API silently ignored the bias."""
    from blend.sampling import InvalidSettingError

    prompt = tiny_engine.build_prompt("Which?", make_docs(1))
    with pytest.raises(InvalidSettingError, match=r"\[259, 100000\] are not in this model's vocabulary \(0..258\)"):
        generate(tiny_engine, prompt, config=GenerationConfig(max_tokens=2, logit_bias=((100000, 5.0), (259, 1.0))))
    ok = generate(tiny_engine, prompt, config=GenerationConfig(max_tokens=2, logit_bias=((258, -100.0),)))
    assert 258 not in ok.token_ids


def test_the_eos_set_takes_the_generation_configs_end_of_turn_tokens_too():
    """Instruct checkpoints (Qwen2.5) list their end-of-turn token in generation_config.json, not
    config.json: without it an answer ran on past <|im_end|> to max_tokens."""
    from types import SimpleNamespace

    from blend.engine_setup import eos_ids
    model = SimpleNamespace(config=SimpleNamespace(eos_token_id=151643),
                            generation_config=SimpleNamespace(eos_token_id=[151645, 151643]))
    assert eos_ids(model, SimpleNamespace(eos_token_id=151643)) == {151643, 151645}
    bare = SimpleNamespace(config=SimpleNamespace(eos_token_id=None))
    assert eos_ids(bare, SimpleNamespace(eos_token_id=2)) == {2}


@pytest.mark.parametrize("data, stop, text, finish", [
    # U+FFFD stands in for a character whose bytes are still coming: "ȅ" is C8 85. A stop string holding U+FFFD
    # matched that stand-in after C8 and ended the answer empty, before 85 made it a character
    (b"\xc8\x85x", ("\ufffd",), "\u0205x", FinishReason.LENGTH),
    (b"a\xc8\x85\xaa b", ("\ufffd",), "a\u0205", FinishReason.STOP),  # AA starts no character: a real U+FFFD
    (b"ok\xe6\x97\xa5!", ("k\ufffd",), "ok\u65e5!", FinishReason.LENGTH),
    # the answer ends inside a character: its U+FFFD is final, and no answer's text holds a stop string
    (b"ab\xe6", ("\ufffd",), "ab", FinishReason.STOP),
])
def test_a_stop_string_never_matches_a_character_still_incomplete(data, stop, text, finish):
    s, deltas = run(data, stop=stop, max_tokens=len(data))
    assert (s.text, s.finish_reason) == (text, finish) and "".join(deltas) == text
    s, _ = run(data, eos=True, stop=stop)  # ended by an EOS (inside a character, in the last case)
    assert s.finish_reason is FinishReason.STOP and not any(x in s.text for x in stop)
