"""A stand-in for a named GGUF model's conversion: the tiny Llama where the GGUF would be read (tests of
blend.conversion run in milliseconds, without the GGUF packages)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from blend import conversion
from blend.tiny import TinyModel, build_tiny


def fake_conversion(monkeypatch: pytest.MonkeyPatch, gguf: Path) -> dict[str, int]:
    """Make ``gguf`` the source of every named model and the tiny Llama what reading a GGUF gives; loads of a
    folder (``gguf_file`` not given) stay transformers' own.

    Returns:
        ``{"n": GGUF reads so far}``, updated as conversions run.
    """
    import transformers

    monkeypatch.setattr(conversion, "_gguf_source", lambda name: (gguf.parent, gguf.name))
    real_model = transformers.AutoModelForCausalLM.from_pretrained
    real_tok = transformers.AutoTokenizer.from_pretrained
    calls = {"n": 0}
    # one load at a time across threads: build_tiny seeds torch's global generator, and transformers' loading
    # switches process-wide state (weight initialization off) that two threads loading at once leave wrong
    one_at_a_time = threading.RLock()

    def model_from(*a, **k):
        with one_at_a_time:
            if "gguf_file" not in k:
                return real_model(*a, **k)
            calls["n"] += 1
            return build_tiny(TinyModel.LLAMA)[0]

    def tokenizer_from(*a, **k):
        with one_at_a_time:
            return build_tiny(TinyModel.LLAMA)[1] if "gguf_file" in k else real_tok(*a, **k)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model_from)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer_from)
    return calls
