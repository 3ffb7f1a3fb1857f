"""Model files against corruption and hostile bytes: the converted GGUF copy under $KVBLEND_HOME/models,
a checkpoint folder given by path (its weights, config and tokenizer), the assembled Qwen GGUF.

The rule: a damaged converted copy is converted again (never loaded as it is); a damaged checkpoint folder
is one clear error (CheckpointError, a one-line `kvblend: error:` from the CLI); a tensor missing from the
weight files is refused, never filled with random values; nothing waits or allocates without bound.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from blend import checkpoint, conversion, fingerprints, models, safeio
from blend.cli import main as kvblend
from blend.errors import CheckpointError, UnknownModelError
from blend.exit_codes import ExitCode
from blend.tiny import TinyModel, build_tiny
from _fake_gguf import fake_conversion
from _fuzz_util import CI_EXAMPLES, EXAMPLES, FUZZ, bounded, dumps_mutated, mutate_bytes, mutate_json

WEIGHTS = "model.safetensors"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _tiny_weights_sha() -> str:
    return models.weights_fingerprint(build_tiny(TinyModel.LLAMA)[0])


@pytest.fixture
def fake_gguf(tmp_path, home, monkeypatch):
    """SmolLM2's conversion with the tiny Llama in place of the GGUF (counts conversions)."""
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF" + bytes(100))
    return fake_conversion(monkeypatch, fake)


def _header(blob: bytes) -> tuple[dict, int]:
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8 : 8 + n]), 8 + n


def _with_header(blob: bytes, header: dict) -> bytes:
    _, end = _header(blob)
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + blob[end:]


def _huge_shape(blob: bytes) -> bytes:
    h, _ = _header(blob)
    name = next(k for k in h if k != "__metadata__")
    return _with_header(blob, {**h, name: {**h[name], "shape": [10**12, 10**6]}})


def _zero_tail(blob: bytes) -> bytes:
    return blob[:-256] + bytes(256)  # the last tensor's bytes, the header intact


def _other_weights(blob: bytes) -> bytes:
    model = build_tiny(TinyModel.LLAMA)[0]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    return _saved_bytes(model)


def _saved_bytes(model) -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        return (Path(d) / WEIGHTS).read_bytes()


WEIGHT_DAMAGE = {
    "truncated": lambda b: b[: len(b) // 2],
    "cut in the header": lambda b: b[:20],
    "empty": lambda b: b"",
    "zeros": lambda b: bytes(len(b)),
    "huge shape": _huge_shape,
    "huge header length": lambda b: struct.pack("<Q", 2**62) + b[8:],
    "tail zeroed": _zero_tail,
    "another model's weights": _other_weights,
}


# ---- the converted copy under $KVBLEND_HOME/models: damaged means converted again ------------------------

@pytest.mark.parametrize("damage", sorted(WEIGHT_DAMAGE))
def test_a_damaged_converted_weight_file_is_converted_again(fake_gguf, damage):
    """A truncated (disk full, killed), zeroed or replaced model.safetensors in the converted copy raised
    safetensors' own error as a traceback, or was loaded as it was (garbage weights, their KV keyed as such)."""
    out = models.convert_gguf(models.SMOLLM2, progress=False)
    (out / WEIGHTS).write_bytes(WEIGHT_DAMAGE[damage]((out / WEIGHTS).read_bytes()))
    loaded = models.load_model(models.SMOLLM2)
    assert fake_gguf["n"] == 2  # converted again
    assert loaded.weights_sha256 == _tiny_weights_sha() == models.weights_fingerprint(loaded.model)
    assert models.load_model(models.SMOLLM2).weights_sha256 == _tiny_weights_sha() and fake_gguf["n"] == 2


@pytest.mark.parametrize("name,damage", [("tokenizer.json", b"[]"), ("tokenizer.json", b"{\"trunc"),
                                         ("config.json", b"\x00" * 64), ("chat_template.jinja", b"{{ 'other' }}"),
                                         (models.FINGERPRINT_FILE, b"not json")])
def test_other_damaged_files_of_the_converted_copy_are_converted_again(fake_gguf, name, damage):
    out = models.convert_gguf(models.SMOLLM2, progress=False)
    want_tok = models.tokenizer_fingerprint(build_tiny(TinyModel.LLAMA)[1])
    (out / name).write_bytes(damage)
    loaded = models.load_model(models.SMOLLM2)
    assert fake_gguf["n"] == 2
    assert loaded.tokenizer_sha256 == want_tok and loaded.weights_sha256 == _tiny_weights_sha()


def test_a_converted_copy_touched_but_unchanged_is_kept_and_its_record_updated(fake_gguf):
    """Files whose stamp changed (a backup restored, `touch`) but whose bytes did not: checked once by their
    fingerprint, not converted again."""
    out = models.convert_gguf(models.SMOLLM2, progress=False)
    os.utime(out / WEIGHTS)
    assert models.load_model(models.SMOLLM2).weights_sha256 == _tiny_weights_sha() and fake_gguf["n"] == 1
    row = fingerprints.read_record(out / models.FINGERPRINT_FILE)
    assert row is not None and row["stamp"] == fingerprints.files_stamp(out)


def _flip_a_weight_bit(path: Path) -> None:
    """Flip the lowest bit of one weight byte halfway through the tensor data (the value stays finite): what
    the disk can do at rest, the file's size kept."""
    blob = bytearray(path.read_bytes())
    _, start = _header(bytes(blob))
    at = start + (len(blob) - start) // 2
    blob[at] ^= 0x01
    path.write_bytes(bytes(blob))


def test_a_converted_weight_changed_at_rest_under_its_old_stamp_is_converted_again(fake_gguf):
    """A byte changed at rest leaves the files' names, sizes and times as the record saw them (simulated here by
    giving the record the files' new stamp). The record was taken on trust: the flipped weights loaded under
    the converted weights' fingerprint, and their KV was stored and served under that key."""
    out = models.convert_gguf(models.SMOLLM2, progress=False)
    models.load_model(models.SMOLLM2)
    _flip_a_weight_bit(out / WEIGHTS)
    row = fingerprints.read_record(out / models.FINGERPRINT_FILE)
    (out / models.FINGERPRINT_FILE).write_text(json.dumps({**row, "stamp": fingerprints.files_stamp(out)}))
    loaded = models.load_model(models.SMOLLM2)
    assert fake_gguf["n"] == 2  # converted again
    assert loaded.weights_sha256 == _tiny_weights_sha() == models.weights_fingerprint(loaded.model)


def test_a_record_from_before_the_check_digest_is_checked_once_and_kept(fake_gguf):
    """A conversion recorded before records kept the weights' XXH3: its weights are fingerprinted once (they
    match: nothing converted again) and the record gains the XXH3."""
    out = models.convert_gguf(models.SMOLLM2, progress=False)
    row = fingerprints.read_record(out / models.FINGERPRINT_FILE)
    del row[fingerprints.CHECK_DIGEST_FIELD]
    (out / models.FINGERPRINT_FILE).write_text(json.dumps(row))
    assert models.load_model(models.SMOLLM2).weights_sha256 == _tiny_weights_sha() and fake_gguf["n"] == 1
    kept = fingerprints.read_record(out / models.FINGERPRINT_FILE)
    assert kept[fingerprints.CHECK_DIGEST_FIELD] == fingerprints.weights_check_digest(build_tiny(TinyModel.LLAMA)[0])


@pytest.mark.parametrize("record", ["cached under KVBLEND_HOME", "the folder's own fingerprint file"])
def test_a_checkpoint_weight_changed_at_rest_is_fingerprinted_again(tmp_path, home, monkeypatch, record):
    """A checkpoint folder's cached fingerprint (under $KVBLEND_HOME/fingerprints, or the folder's own record)
    was taken while the files' stamp matched, whatever their bytes had become: the changed weights' KV was
    keyed as the old weights'. The stamp is held fixed here, as bit rot leaves it."""
    d = _checkpoint(tmp_path / "ckpt")
    if record == "the folder's own fingerprint file":
        model = build_tiny(TinyModel.LLAMA)[0]
        (d / models.FINGERPRINT_FILE).write_text(json.dumps({
            "weights_sha256": models.weights_fingerprint(model),
            fingerprints.CHECK_DIGEST_FIELD: fingerprints.weights_check_digest(model),
            "stamp": fingerprints.files_stamp(d)}))
    first = models.load_model(str(d))
    assert first.weights_sha256 == _tiny_weights_sha()
    stamp = fingerprints.files_stamp(d)
    _flip_a_weight_bit(d / WEIGHTS)
    monkeypatch.setattr(models, "files_stamp", lambda path: stamp)
    again = models.load_model(str(d))
    assert again.weights_sha256 == models.weights_fingerprint(again.model) != first.weights_sha256
    assert models.load_model(str(d)).weights_sha256 == again.weights_sha256  # cached as what it now is


def test_a_folder_without_a_fingerprint_file_at_the_conversions_place_is_replaced(fake_gguf):
    """A folder there that is not a finished conversion (from before conversions were atomic, or not ours):
    the conversion's rename failed, the folder was loaded as it was."""
    out = conversion.converted_dir(models.SMOLLM2)
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    loaded = models.load_model(models.SMOLLM2)
    assert loaded.weights_sha256 == _tiny_weights_sha() and (out / models.FINGERPRINT_FILE).is_file()


def test_a_second_damage_after_converting_again_is_one_clear_error(fake_gguf, monkeypatch):
    def always_damaged(path, model, tokenizer_sha256):
        raise CheckpointError(f"{path}: damaged")

    monkeypatch.setattr(models, "checked_fingerprint", always_damaged)
    with pytest.raises(CheckpointError, match="damaged"):
        models.load_model(models.SMOLLM2)
    assert fake_gguf["n"] == 2  # converted again once, not in a loop


def test_the_conversion_is_fsynced_before_it_is_renamed_into_place(fake_gguf, monkeypatch):
    """save_pretrained's files were never fsynced: after a power loss the renamed folder (its fingerprint file
    included) could hold empty or zeroed files."""
    synced: list[str] = []
    real_fsync, real_rename = os.fsync, os.rename
    renamed: list[list[str]] = []

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def rename(a, b, **kw):
        renamed.append(list(synced))
        return real_rename(a, b, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    out = models.convert_gguf(models.SMOLLM2, progress=False)
    before = renamed[-1]
    for f in out.iterdir():
        assert any(p.endswith("/" + f.name) for p in before), f"{f.name} not fsynced before the rename"
    assert any(os.path.basename(p).startswith(f".{out.name}-") for p in before)  # the folder itself
    assert str(out.parent) in synced[len(before):]  # and the rename


def test_a_killed_conversions_leftover_is_removed_once_stale(fake_gguf, home):
    out = conversion.converted_dir(models.SMOLLM2)
    left = out.parent / f".{out.name}-dead1234"
    left.mkdir(parents=True)
    (left / WEIGHTS).write_bytes(b"x" * 1000)
    fresh = out.parent / f".{out.name}-live5678"  # a conversion in progress elsewhere
    fresh.mkdir()
    old = time.time() - conversion.CONVERSION_STALE_S - 60
    for p in (left / WEIGHTS, left):
        os.utime(p, (old, old))
    models.convert_gguf(models.SMOLLM2, progress=False)
    assert not left.exists() and fresh.exists()


def test_two_processes_converting_at_once_keep_one_conversion(fake_gguf, monkeypatch):
    import transformers

    real_save = transformers.PreTrainedModel.save_pretrained
    both_saving = threading.Barrier(2, timeout=30)

    def slow_save(self, *a, **k):
        both_saving.wait()
        return real_save(self, *a, **k)

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", slow_save)
    outs, errors = [], []

    def convert():
        try:
            outs.append(models.convert_gguf(models.SMOLLM2, progress=False))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and fake_gguf["n"] == 2 and outs[0] == outs[1]
    assert sorted(p.name for p in outs[0].parent.iterdir()) == [outs[0].name]  # no temporary folder left
    assert models.load_model(models.SMOLLM2).weights_sha256 == _tiny_weights_sha()


def test_a_cut_assembled_qwen_gguf_is_assembled_again(tmp_path, home, monkeypatch):
    parts = []
    for i in range(1, 7):
        d = tmp_path / f"part{i}"
        (d / "data").mkdir(parents=True)
        (d / "data" / f"part{i:02d}.bin").write_bytes(bytes([i]) * 1000)
        parts.append(d)
    monkeypatch.setattr(conversion, "_package_dir", lambda pkg: parts[int(pkg[-1]) - 1])
    want = b"".join(bytes([i]) * 1000 for i in range(1, 7))
    folder, name = conversion._gguf_source(models.QWEN_CODER)
    assert (folder / name).read_bytes() == want
    (folder / name).write_bytes(want[:2500])  # cut short (not by us: ours are atomic)
    folder, name = conversion._gguf_source(models.QWEN_CODER)
    assert (folder / name).read_bytes() == want


# ---- a checkpoint folder given by path: one clear error ---------------------------------------------------

def _checkpoint(d: Path, kind: TinyModel = TinyModel.LLAMA) -> Path:
    model, tok = build_tiny(kind)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _drop_tensor(d: Path) -> None:
    sd = load_file(d / WEIGHTS)
    del sd["model.layers.0.self_attn.q_proj.weight"]
    save_file(sd, d / WEIGHTS, metadata={"format": "pt"})


def _resize_tensor(d: Path) -> None:
    sd = load_file(d / WEIGHTS)
    sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(5, 5)
    save_file(sd, d / WEIGHTS, metadata={"format": "pt"})


def _nan_tensor(d: Path) -> None:
    sd = load_file(d / WEIGHTS)
    sd["model.layers.1.mlp.down_proj.weight"][3, 4] = float("nan")
    save_file(sd, d / WEIGHTS, metadata={"format": "pt"})


def _config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **changes}))


FOLDER_DAMAGE = {
    **{f"weights {k}": (lambda f: lambda d: (d / WEIGHTS).write_bytes(f((d / WEIGHTS).read_bytes())))(f)
       for k, f in WEIGHT_DAMAGE.items() if k not in ("tail zeroed", "another model's weights")},
    "a tensor missing": _drop_tensor,
    "a tensor of another shape": _resize_tensor,
    "a NaN weight": _nan_tensor,
    "no heads": lambda d: _config(d, num_attention_heads=0, num_key_value_heads=0),
    "a million layers": lambda d: _config(d, num_hidden_layers=10**6),
    "a config that is a list": lambda d: (d / "config.json").write_text("[1]"),
    "a tokenizer that is a list": lambda d: (d / "tokenizer.json").write_text("[]"),
    "a tokenizer config that is a list": lambda d: (d / "tokenizer_config.json").write_text("[1]"),
    "a tokenizer cut short": lambda d: (d / "tokenizer.json").write_bytes((d / "tokenizer.json").read_bytes()[:500]),
}


@pytest.mark.parametrize("damage", sorted(FOLDER_DAMAGE))
def test_a_damaged_checkpoint_folder_is_one_clear_error(tmp_path, home, damage):
    """Each raised its parser's own error (SafetensorError, TypeError, AttributeError, ZeroDivisionError...) as
    a traceback, loaded random values for a missing tensor, waited on a FIFO, or (a million layers) built and
    initialized every layer the weight files lack."""
    d = _checkpoint(tmp_path / "ckpt")
    FOLDER_DAMAGE[damage](d)
    with bounded(max_bytes=256 << 20, seconds=30):
        with pytest.raises(CheckpointError, match=str(d)):
            models.load_model(str(d))


@pytest.mark.parametrize("layers", [10**6, 5, 3])
def test_a_pickled_checkpoint_declaring_other_layers_than_it_holds_is_refused(tmp_path, home, layers):
    """A pytorch_model.bin checkpoint has no header naming its layers, so a config claiming 10**6 layers had
    transformers build and initialize every one (minutes, gigabytes) before anything was refused, and one
    declaring 3 of its 4 layers loaded and ran without the fourth. Its size now bounds the layers (10**6 refused
    before anything is built); a count it does not hold is refused by the load (5 of 4: a missing tensor; 3 of 4:
    a layer the config leaves out)."""
    model, tok = build_tiny(TinyModel.LLAMA)
    d = tmp_path / "ckpt"
    model.config.save_pretrained(d)
    torch.save(model.state_dict(), d / "pytorch_model.bin")  # save_pretrained writes safetensors only
    tok.save_pretrained(d)
    assert models.load_model(str(d)).model.config.num_hidden_layers == model.config.num_hidden_layers
    _config(d, num_hidden_layers=layers)
    with bounded(max_bytes=256 << 20, seconds=30):
        with pytest.raises(CheckpointError, match=str(d)):
            models.load_model(str(d))


@pytest.mark.parametrize("damage", ["weights truncated", "a tensor missing", "a tokenizer that is a list"])
def test_kvblend_ask_over_a_damaged_checkpoint_is_one_line(tmp_path, home, damage, capsys):
    d = _checkpoint(tmp_path / "ckpt")
    FOLDER_DAMAGE[damage](d)
    doc = tmp_path / "doc.txt"
    doc.write_text("The ferry leaves at noon.")
    code = kvblend(["ask", "When?", "--doc", str(doc), "--model", str(d), "--store", "memory"])
    err = capsys.readouterr().err
    assert code == ExitCode.USER_ERROR
    assert err.startswith("kvblend: error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_a_base_models_checkpoint_and_tied_embeddings_still_load(tmp_path, home):
    """What transformers fills legitimately (a tied head; a base model's names without "model.") is no
    missing tensor."""
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    d = tmp_path / "base"
    LlamaModel(cfg).save_pretrained(d)
    build_tiny(TinyModel.LLAMA)[1].save_pretrained(d)
    loaded = models.load_model(str(d))
    assert torch.equal(loaded.model.lm_head.weight, loaded.model.model.embed_tokens.weight)


# ---- fuzz: mutated weight, config and tokenizer files -----------------------------------------------------

@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("pristine"))


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# ~0.2 s a load: 60 examples in CI (KVBLEND_FUZZ_EXAMPLES=N runs N)
FOLDER_FUZZ = settings(FUZZ, max_examples=60 if EXAMPLES == CI_EXAMPLES else EXAMPLES)


@FOLDER_FUZZ
@given(data=st.data(), target=st.sampled_from([WEIGHTS, "config.json", "tokenizer.json"]))
def test_a_mutated_checkpoint_file_loads_or_is_a_checkpoint_error(tmp_path_factory, home, pristine, data, target):
    d = _copy(pristine, tmp_path_factory.mktemp("m"))
    blob = (d / target).read_bytes()
    if target == WEIGHTS and data.draw(st.booleans(), label="header rewritten"):  # dtype, shape, offsets, names
        header, end = _header(blob)
        tensor = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")), label="tensor")
        new = _with_header(blob, {**header, tensor: mutate_json(header[tensor], data)})
    elif target == WEIGHTS:
        new = mutate_bytes(blob, data, header_end=_header(blob)[1])
    elif data.draw(st.booleans(), label="as json"):
        new = json.dumps(mutate_json(json.loads(blob), data)).encode()
    elif data.draw(st.booleans(), label="as json text"):
        new = dumps_mutated(json.loads(blob), data)
    else:
        new = mutate_bytes(blob, data)
    (d / target).write_bytes(new)
    with bounded(max_bytes=256 << 20, seconds=30):
        try:
            loaded = models.load_model(str(d))
        except UnknownModelError:  # CheckpointError, or a config of an architecture the engine does not run
            return
    assert loaded.weights_sha256 == models.weights_fingerprint(loaded.model)  # what was loaded is what is keyed
    assert all(bool(torch.isfinite(p).all()) for p in loaded.model.parameters())


_UNBLOCK = """
import os, sys, time
time.sleep(float(sys.argv[2]))
while True:  # a reader blocked on the FIFO sees end of file
    try:
        os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader waiting
        pass
    time.sleep(0.05)
"""


def _unblocker(fifo: Path, delay: float) -> subprocess.Popen:
    """A process that, after ``delay`` seconds, keeps opening ``fifo`` for writing and closing it: a parser
    blocked on it (some hold the GIL while they open) then reads end of file, so a missing check makes the
    test fail, not hang."""
    return subprocess.Popen([sys.executable, "-c", _UNBLOCK, str(fifo), str(delay)])


@pytest.mark.parametrize("name", ["config.json", WEIGHTS, "tokenizer.json"])
def test_a_fifo_in_a_checkpoint_folder_is_refused_not_waited_on(tmp_path, home, name):
    d = _checkpoint(tmp_path / "ckpt")
    (d / name).unlink()
    os.mkfifo(d / name)
    unblock = _unblocker(d / name, delay=10.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(CheckpointError, match=f"{name}: a FIFO"):
            models.load_model(str(d))
    finally:
        unblock.kill()
        unblock.wait()
    assert time.monotonic() - t0 < 10.0  # refused, not read after a writer came


def test_fifo_check_names_the_file(tmp_path):
    d = _checkpoint(tmp_path / "ckpt")
    (d / "tokenizer.json").unlink()
    os.mkfifo(d / "tokenizer.json")
    with pytest.raises(CheckpointError, match="tokenizer.json: a FIFO"):
        checkpoint.check_files(d)
    assert not safeio.is_regular(d / "tokenizer.json")
