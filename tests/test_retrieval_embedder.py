"""The real MiniLM embedder: offline load, normalized, semantic, batch-invariant."""

from __future__ import annotations

import numpy as np
import pytest

from blend.retrieval.embedder import Embedder


@pytest.fixture(scope="module")
def emb() -> Embedder:
    return Embedder.load(batch_size=4)


def test_normalized_and_shaped(emb: Embedder) -> None:
    v = emb.embed(["hello world", "a much longer sentence about faiss indexes and caches"])  # (2, 384)
    assert v.shape == (2, 384) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)


def test_similar_sentences_closer_than_unrelated(emb: Embedder) -> None:
    a, b, c = emb.embed([
        "The cat sat on the mat.",
        "A cat was sitting on a rug.",
        "Quarterly revenue grew by eight percent in Europe.",
    ])
    assert float(a @ b) > float(a @ c) + 0.2


def test_batched_equals_unbatched(emb: Embedder) -> None:
    texts = [f"sentence number {i} " + "padding words " * (i % 7) for i in range(11)]
    batched = emb.embed(texts, batch_size=5)  # (11, D)
    single = np.stack([emb.embed([t], batch_size=1)[0] for t in texts])  # (11, D)
    np.testing.assert_allclose(batched, single, atol=1e-5)


def test_info_identifies_model(emb: Embedder) -> None:
    assert emb.info.name == "all-MiniLM-L6-v2" and emb.info.dim == 384 and len(emb.info.fingerprint) == 64


def _legacy_fingerprint(d) -> str:
    """What every index recorded before 2026-12-06: config bytes and weight file sizes."""
    import hashlib

    h = hashlib.sha256((d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        h.update(f.name.encode() + str(f.stat().st_size).encode())
    return h.hexdigest()


def test_the_packaged_models_fingerprint_is_what_indexes_recorded_before(emb: Embedder) -> None:
    """Indexes built with the packaged model keep opening."""
    from blend.retrieval.embedder import default_model_dir

    assert emb.info.fingerprint == _legacy_fingerprint(default_model_dir())
    assert Embedder.load(default_model_dir()).info.fingerprint == emb.info.fingerprint  # named explicitly


def test_another_models_weights_or_truncation_change_the_fingerprint(emb: Embedder, tmp_path) -> None:
    """A copy of MiniLM with other weights of the same size (a fine-tune) or another max_length embeds
    differently: its fingerprint differs, so an index refuses its query vectors. Both got the packaged
    model's fingerprint before."""
    import shutil

    from blend.retrieval.embedder import default_model_dir, model_fingerprint

    copy = tmp_path / "minilm"
    shutil.copytree(default_model_dir(), copy)
    same = model_fingerprint(copy, 256, packaged=False)
    with open(copy / "model.safetensors", "r+b") as f:  # flip bytes deep inside the tensors, size unchanged
        f.seek(-4096, 2)
        tail = bytearray(f.read(8))
        f.seek(-4096, 2)
        f.write(bytes(b ^ 0x01 for b in tail))
    assert model_fingerprint(copy, 256, packaged=False) != same
    assert _legacy_fingerprint(copy) == _legacy_fingerprint(default_model_dir())  # what the old check saw
    assert Embedder.load(max_length=8).info.fingerprint != emb.info.fingerprint
    # a folder whose weights are a pytorch_model.bin: its bytes count too (two fine-tunes shared one fingerprint)
    (copy / "model.safetensors").unlink()
    (copy / "pytorch_model.bin").write_bytes(b"weights one")
    one = model_fingerprint(copy, 256, packaged=False)
    (copy / "pytorch_model.bin").write_bytes(b"weights two")
    assert model_fingerprint(copy, 256, packaged=False) != one


@pytest.mark.parametrize("damage", ["a tensor missing", "truncated", "a FIFO for the tokenizer"])
def test_a_damaged_embedding_model_folder_is_a_retrieval_error(tmp_path, damage) -> None:
    """A folder lacking a tensor loaded with it filled at random (every vector noise, under a fingerprint of
    its files, so the index took them); a truncated file raised safetensors' own error; a FIFO was waited on."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    from blend.retrieval.corpus import RetrievalError
    from blend.retrieval.embedder import default_model_dir

    copy = tmp_path / "minilm"
    shutil.copytree(default_model_dir(), copy)
    weights = copy / "model.safetensors"
    if damage == "a tensor missing":
        sd = load_file(weights)
        del sd[next(k for k in sorted(sd) if "encoder.layer.0.attention" in k)]
        save_file(sd, weights, metadata={"format": "pt"})
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:100_000])
    else:
        (copy / "tokenizer.json").unlink()
        os.mkfifo(copy / "tokenizer.json")
    with pytest.raises(RetrievalError, match="embedding model"):
        Embedder.load(copy)
