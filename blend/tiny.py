"""Tiny random models for tests: built in-process from a config, deterministic.

They share a byte-level tokenizer built in-process (256 byte tokens plus the
chat specials), so nothing is ever read from disk or a hub.
"""

from __future__ import annotations

import random
from enum import Enum

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

from blend.errors import UnknownModelError
from blend.logprobs import byte_level_chars

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PSEUDO_WORDS = ("alpha beta gamma delta river stone harbor lantern copper meadow violet anchor "
                "quartz ember willow summit canyon falcon orchid maple").split()


def make_docs(n: int, words: int = 40, seed: int = 0) -> list[str]:
    """Deterministic pseudo-documents for the byte-level tiny models (tests, the device check).

    Args:
        n: how many documents.
        words: pseudo-words per document.
        seed: the random generator's seed (the same seed, the same documents).

    Returns:
        ``n`` documents, each ending ``(doc i)``.
    """
    rng = random.Random(seed)
    return [" ".join(rng.choice(PSEUDO_WORDS) for _ in range(words)) + f" (doc {i})" for i in range(n)]


class TinyModel(Enum):
    LLAMA = "tiny-llama"
    QWEN2 = "tiny-qwen2"
    LLAMA_ROPE_LLAMA3 = "tiny-llama-rope-llama3"
    LLAMA_ROPE_LINEAR = "tiny-llama-rope-linear"
    LLAMA_ROPE_DYNAMIC = "tiny-llama-rope-dynamic"  # dynamic NTK past 512 positions


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: ids 0..255 are bytes, then the chat specials.

    Returns:
        A fast tokenizer of 259 ids (256 bytes, ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``) with a
        ChatML chat template.
    """
    table = byte_level_chars()
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


def tiny_config(kind: TinyModel):
    """The config of a tiny test model (vocab 259 = bytes + 3 specials).

    Args:
        kind: which tiny model.

    Returns:
        A transformers ``LlamaConfig`` or ``Qwen2Config`` (4 layers, GQA with 2 KV heads).

    Raises:
        UnknownModelError: ``kind`` is not a :class:`TinyModel`.
    """
    common = dict(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        max_position_embeddings=4096,
        bos_token_id=257,
        eos_token_id=258,
        pad_token_id=256,
        tie_word_embeddings=False,
    )
    if kind is TinyModel.QWEN2:
        return Qwen2Config(
            **{**common, "hidden_size": 96}, num_attention_heads=6, num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            rms_norm_eps=1e-6, use_sliding_window=False,
        )
    rope = {"rope_type": "default", "rope_theta": 10_000.0}
    if kind is TinyModel.LLAMA_ROPE_LLAMA3:
        rope = {
            "rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 512,
        }
    elif kind is TinyModel.LLAMA_ROPE_LINEAR:
        rope = {"rope_type": "linear", "rope_theta": 10_000.0, "factor": 4.0}
    elif kind is TinyModel.LLAMA_ROPE_DYNAMIC:
        rope = {"rope_type": "dynamic", "rope_theta": 10_000.0, "factor": 4.0}
        common = {**common, "max_position_embeddings": 512}  # the NTK base grows past this length
    elif kind is not TinyModel.LLAMA:
        raise UnknownModelError(f"unknown tiny model {kind}")
    return LlamaConfig(
        **common, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, rope_parameters=rope,
    )


def build_tiny(kind: TinyModel, seed: int = 0):
    """Build a tiny random model deterministically.

    Args:
        kind: which tiny model.
        seed: RNG seed for the weights.

    Returns:
        (model, tokenizer), model in fp32 eval mode.
    """
    return build_from_config(tiny_config(kind), seed)


def build_from_config(cfg, seed: int = 0):
    """Build a random model of any small config deterministically, as the tiny models are (tests of config
    variants: GQA ratios, head dims, RoPE types...).

    Args:
        cfg: a transformers config (vocab 259 for the byte tokenizer); its ``initializer_range`` is set here.
        seed: RNG seed for the weights.

    Returns:
        (model, tokenizer), model in fp32 eval mode.
    """
    from transformers import AutoModelForCausalLM

    cfg.initializer_range = 0.08  # sharper logits than the default 0.02
    saved = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # HF zero-inits biases and ones-inits norms: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    torch.random.set_rng_state(saved)
    return model.eval(), byte_tokenizer()
