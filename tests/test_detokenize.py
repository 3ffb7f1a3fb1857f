"""IncrementalText: the answer's text after every token equals decoding every token at once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blend.detokenize import IncrementalText
from blend.tiny import byte_tokenizer

BYTES = byte_tokenizer()


def assert_matches_full_decode(tokenizer, ids: list[int]) -> None:
    inc = IncrementalText(tokenizer)
    for i, t in enumerate(ids):
        got = inc.push(t)
        assert got == tokenizer.decode(ids[: i + 1], skip_special_tokens=True), (ids[: i + 1], got)


# bytes of multi-byte characters (UTF-8 lead and continuation bytes), ASCII, invalid bytes, the specials
byte_ids = st.lists(st.one_of(st.integers(0, 258), st.sampled_from([0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F,
                                                                    0x98, 0x80, 0xFF, 0x20, 0x0A])), max_size=60)


@settings(max_examples=400, deadline=None)
@given(byte_ids)
def test_byte_level_tokens_decode_as_a_whole(ids):
    assert_matches_full_decode(BYTES, ids)


def test_text_with_multi_byte_characters_and_specials():
    text = "naïve café — 😀 ok\n"
    ids = list(text.encode("utf-8"))
    assert_matches_full_decode(BYTES, ids[:5] + [258] + ids[5:] + [257])


class _Tidying:
    """transformers' clean_up_tokenization_spaces: "a ." decodes as "a." unless asked not to tidy."""

    clean_up_tokenization_spaces = True

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
        text = BYTES.decode(ids, skip_special_tokens=skip_special_tokens)
        tidy = clean_up_tokenization_spaces
        if tidy is None:
            tidy = self.clean_up_tokenization_spaces
        return text.replace(" .", ".") if tidy else text


def test_a_tokenizer_that_tidies_spaces_is_decoded_untidied_so_the_text_only_grows():
    tok = _Tidying()
    ids = list(b"a b . c .")
    inc = IncrementalText(tok)
    for i, t in enumerate(ids):
        assert inc.push(t) == tok.decode(ids[: i + 1], clean_up_tokenization_spaces=False)


def test_a_tidying_tokenizers_answer_keeps_every_token_in_the_stream_and_the_text():
    # the tidy-up rewrote text already streamed ("cat ." -> "cat."), after which every later token's text
    # was dropped from the stream and from the answer
    import torch

    from blend.generation import TokenStream
    from blend.sampling import GenerationConfig

    ids = list(b"It is a cat . It sleeps all day")
    stream = TokenStream(_Tidying(), {258}, GenerationConfig(max_tokens=len(ids)))
    pieces = []
    for t in ids:
        logits = torch.full((259,), -10.0)
        logits[t] = 10.0
        pieces.append(stream.step(logits))
    assert "".join(pieces) == stream.text == "It is a cat . It sleeps all day"


def test_a_window_whose_context_changes_falls_back_to_the_whole_decode():
    class Merging:  # "ab" decodes as "X": a later token rewrites its context's text
        clean_up_tokenization_spaces = False

        def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
            return BYTES.decode(ids).replace("ab", "X")

    tok = Merging()
    ids = list(b"xxaba")
    inc = IncrementalText(tok)
    for i, t in enumerate(ids):
        assert inc.push(t) == tok.decode(ids[: i + 1])


@pytest.mark.usefixtures("real_engine")
class TestRealTokenizer:
    @pytest.fixture(autouse=True)
    def _tok(self, real_engine):
        self.tok = real_engine.tokenizer

    def test_natural_text_with_non_ascii(self):
        text = "The café's naïve owner said: «voilà» — 東京 😀\n  indented\tcode() {}"
        assert_matches_full_decode(self.tok, self.tok(text)["input_ids"])

    @settings(max_examples=150, deadline=None)
    @given(st.lists(st.integers(0, 49151), max_size=40))
    def test_random_tokens_of_the_whole_vocabulary(self, ids):
        assert_matches_full_decode(self.tok, ids)


def test_the_detokenize_bench_compares_the_same_text():
    from blend.evals.bench_detokenize import measure

    ids = list("naïve café 😀 ".encode()) * 20
    t_inc, t_full = measure(BYTES, ids)
    assert t_inc > 0 and t_full > 0
