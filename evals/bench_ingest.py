"""Ingest throughput: chunk + embed + index on the demo corpus replicated to ~200 chunks.

    python -m blend.evals.bench_ingest [--chunks 200] [--kv-chunks 16] [--json OUT]

Phases are timed separately (chunking with the model tokenizer, MiniLM
embedding, faiss add + search, atomic commit), then one end-to-end
``ingest`` without KV. When the engine and the real model are available, KV
precompute is timed on ``--kv-chunks`` chunks and an end-to-end ingest with KV
is extrapolated from it (KV dominates on CPU). The embedder and the engine each
answer one untimed call first.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from blend.defaults import DEFAULT_MODEL
from blend.evals.environment import describe_environment
from blend import safeio

WARM_UP_TEXT = "A sentence that is no chunk of the corpus, for each model's first call."


def _corpus(folder: Path, copies: int) -> None:
    from blend.retrieval.cli import demo_dir

    docs = sorted(p for p in demo_dir().iterdir() if p.suffix in (".txt", ".md"))
    for c in range(copies):
        for p in docs:  # a distinct first line per copy: distinct chunk ids
            (folder / f"{c:03d}-{p.name}").write_text(f"Edition {c} of this page.\n\n{p.read_text()}")


def _tokenizer(model: str):
    """The engine's tokenizer and fingerprint, else MiniLM's (engine not importable)."""
    try:
        from blend.options import load_engine

        eng = load_engine(model, "float32", "memory")
        return eng.tokenizer, eng.provenance.tokenizer_sha256, eng, model
    except Exception as e:  # noqa: BLE001 - the benchmark degrades to no-KV
        from transformers import AutoTokenizer

        from blend.retrieval.chunker import tokenizer_fingerprint
        from blend.retrieval.embedder import default_model_dir

        print(f"bench_ingest: engine unavailable ({type(e).__name__}: {e}); chunking with the MiniLM tokenizer, no KV",
              file=sys.stderr)
        tok = AutoTokenizer.from_pretrained(str(default_model_dir()), local_files_only=True)
        return tok, tokenizer_fingerprint(tok), None, "all-MiniLM-L6-v2 tokenizer"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=200, help="approximate chunks in the replicated corpus")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--kv-chunks", type=int, default=16, help="chunks whose KV is timed (0: skip)")
    ap.add_argument("--json", default=None, metavar="OUT", help="also write the numbers as JSON")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import numpy as np

    from blend.retrieval.catalog import Catalog, IndexMeta
    from blend.retrieval.chunker import ChunkerConfig, chunk_text
    from blend.retrieval.corpus import expand_paths, read_file
    from blend.retrieval.embedder import Embedder
    from blend.retrieval.index import IndexKind, VectorIndex
    from blend.retrieval.ingest import ingest
    from blend.retrieval.ingest_options import IngestOptions

    tok, fp, engine, tok_name = _tokenizer(args.model)
    emb = Embedder.load()
    res: dict[str, object] = {"tokenizer": tok_name, "threads": os.environ.get("OMP_NUM_THREADS", "default"),
                              "environment": describe_environment()}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        _corpus(corpus, max(1, math.ceil(args.chunks / 7)))
        files, _ = expand_paths([corpus])
        cfg = ChunkerConfig()

        t = time.perf_counter()
        chunks = [c for f in files for d in read_file(f).documents for c in chunk_text(d.text, tok, fp, cfg)]
        t_chunk = time.perf_counter() - t
        n, ntok = len(chunks), sum(c.n_tokens for c in chunks)
        emb.embed([WARM_UP_TEXT])  # the model's first call (thread pools, kernel set-up) is no phase's time
        t = time.perf_counter()
        vecs = emb.embed([c.text for c in chunks])  # (n, 384)
        t_embed = time.perf_counter() - t
        t = time.perf_counter()
        vi = VectorIndex(emb.dim, IndexKind.EXACT)
        vi.add(np.arange(n, dtype=np.int64), vecs)
        vi.search(vecs[:8], 5)
        t_index = time.perf_counter() - t
        t = time.perf_counter()
        ingest([corpus], Path(tmp) / "idx", tokenizer=tok, tokenizer_fp=fp, embedder=emb,
               options=IngestOptions(config=cfg, progress=False, stream=io.StringIO()))
        t_e2e = time.perf_counter() - t
        t = time.perf_counter()
        Catalog.open(Path(tmp) / "idx").commit()
        t_commit = time.perf_counter() - t
        t = time.perf_counter()
        again = ingest([corpus], Path(tmp) / "idx", tokenizer=tok, tokenizer_fp=fp, embedder=emb,
                       options=IngestOptions(config=cfg, progress=False, stream=io.StringIO()))
        t_reingest = time.perf_counter() - t
        assert again.chunks_added == 0
        res.update(chunks=n, tokens=ntok, files=len(files))
        for name, sec in [("chunk", t_chunk), ("embed", t_embed), ("index", t_index), ("commit", t_commit),
                          ("ingest_no_kv", t_e2e), ("reingest_unchanged", t_reingest)]:
            res[name] = {"s": round(sec, 3), "chunks_per_s": round(n / sec, 1), "tokens_per_s": round(ntok / sec, 1)}
        if engine is not None and args.kv_chunks > 0:
            sub = [c.text for c in chunks[: args.kv_chunks]]
            engine.precompute_chunks([WARM_UP_TEXT])  # untimed: the per-chunk time is extrapolated to every chunk,
            t = time.perf_counter()  # so a first call's one-off cost would be multiplied by chunks / kv-chunks
            nbytes = engine.precompute_chunks(sub)
            t_kv = time.perf_counter() - t
            sub_tok = sum(c.n_tokens for c in chunks[: args.kv_chunks])
            per_chunk = t_kv / len(sub)
            res["kv"] = {"chunks": len(sub), "s": round(t_kv, 3), "chunks_per_s": round(len(sub) / t_kv, 2),
                         "tokens_per_s": round(sub_tok / t_kv, 1), "bytes_per_chunk": nbytes // len(sub)}
            est = t_e2e + per_chunk * n
            res["ingest_with_kv_estimated"] = {"s": round(est, 1), "chunks_per_s": round(n / est, 2),
                                               "tokens_per_s": round(ntok / est, 1)}
    print(f"bench_ingest: {res['chunks']} chunks, {res['tokens']} tokens from {res['files']} files "
          f"(tokenizer: {tok_name}, threads: {res['threads']})")
    for k, v in res.items():
        if isinstance(v, dict) and "s" in v:
            extra = f"  ({v['bytes_per_chunk'] / 2**20:.1f} MiB KV/chunk)" if "bytes_per_chunk" in v else ""
            print(f"  {k:<26} {v['s']:>8.2f} s {v['chunks_per_s']:>9.1f} chunks/s {v['tokens_per_s']:>10.1f} tokens/s{extra}")
    if args.json:
        safeio.atomic_write_text(Path(args.json), json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
