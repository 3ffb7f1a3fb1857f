"""RAG pipeline and CLI on the tiny in-process model (fast; no real weights)."""

from __future__ import annotations

import argparse
import json
import io
import math
from pathlib import Path

import pytest

engine_mod = pytest.importorskip("blend.engine")

from blend.keys import Namespace  # noqa: E402
from blend.store.base import EntryState  # noqa: E402
from blend.retrieval.catalog import Catalog  # noqa: E402
from blend.retrieval.chunker import ChunkerConfig  # noqa: E402
from blend.retrieval.ingest import ingest  # noqa: E402
from blend.retrieval.ingest_options import IngestOptions, KVSync  # noqa: E402
from blend.retrieval.engine_kv import (  # noqa: E402
    engine_kv_deleter, engine_kv_signature, engine_kv_sync, engine_kv_writer,
)
from blend.retrieval.pipeline import RAG, Retrieved, order_documents  # noqa: E402
from blend.retrieval.testing import HashEmbedder  # noqa: E402
from _json_util import strict_loads  # noqa: E402

DOCS = {
    "keeper.txt": "The lighthouse keeper is Orla. She polishes the lens every morning.",
    "ferry.txt": "The ferry is named Marigold. It sails to Gull Island twice a day.",
    "pump.txt": "The pump weighs four kilograms. It lifts water eighteen metres.",
}


@pytest.fixture(scope="module")
def engine():
    from blend.store.memory import MemoryStore

    return engine_mod.Engine.load("tiny-llama", store=MemoryStore())


@pytest.fixture()
def index(tmp_path: Path, engine) -> tuple[Path, Path]:
    d = tmp_path / "docs"
    d.mkdir()
    for k, v in DOCS.items():
        (d / k).write_text(v)
    idx = tmp_path / "idx"
    ingest([d], idx, tokenizer=engine.tokenizer, tokenizer_fp=engine.provenance.tokenizer_sha256,
           embedder=HashEmbedder(), kv=KVSync(writer=engine_kv_writer(engine), deleter=engine_kv_deleter(engine)),
           options=IngestOptions(config=ChunkerConfig(target_tokens=64), stream=io.StringIO()))
    return d, idx


def test_ask_retrieves_orders_and_reports(index, engine) -> None:
    from blend.policy import ReusePolicy

    _, idx = index
    rag = RAG.open(idx, engine=engine, embedder=HashEmbedder())
    ans = rag.ask("What is the ferry named?", top_k=2, policy=ReusePolicy.blend(ratio=0.15, force=True), max_new_tokens=4)
    assert len(ans.retrieved) == 2 and "Marigold" in ans.retrieved[0].text
    assert ans.retrieved[0].source.endswith("ferry.txt")
    assert [r.score for r in ans.retrieved] == sorted((r.score for r in ans.retrieved), reverse=True)
    assert [c.chunk_id for c in ans.reuse] == [r.chunk_id for r in ans.retrieved]
    # KV was precomputed at ingest: every chunk is reused, none computed
    assert all(c.reuse_class in ("exact", "blended") for c in ans.reuse), ans.reuse
    assert ans.ttft_s > 0 and ans.report["segments"]
    again = rag.ask("What is the ferry named?", top_k=2, policy=ReusePolicy.blend(ratio=0.15, force=True), max_new_tokens=4)
    assert again.answer == ans.answer and again.retrieved == ans.retrieved


def test_caller_documents_bypass_the_index(engine) -> None:
    rag = RAG.open(None, engine=engine)
    ans = rag.ask("Who keeps the lighthouse?", documents=[DOCS["keeper.txt"], DOCS["pump.txt"]], max_new_tokens=3)
    assert [r.text for r in ans.retrieved] == [DOCS["keeper.txt"], DOCS["pump.txt"]]  # caller order kept
    assert all(r.source == "caller" and math.isnan(r.score) for r in ans.retrieved)
    assert len(ans.reuse) == 2


def test_order_is_score_then_id() -> None:
    rows = [Retrieved("b", 0.5, "s", "x"), Retrieved("a", 0.5, "s", "y"), Retrieved("c", 0.9, "s", "z")]
    assert [r.chunk_id for r in order_documents(rows)] == ["c", "a", "b"]


def test_changed_file_deletes_old_chunk_kv_from_engine_store(index, engine) -> None:
    from blend.keys import canonical_key
    from blend.prompt import document_text, preamble_segment, tokenize_segment

    d, idx = index
    pre = preamble_segment(engine.tokenizer, None).token_ids

    def key(text: str):
        return canonical_key(engine.provenance, pre, tokenize_segment(engine.tokenizer, document_text(text)))

    assert engine.store.contains(Namespace.CANONICAL, key(DOCS["pump.txt"]))
    (d / "pump.txt").write_text("The pump weighs five kilograms.")
    s = ingest([d], idx, tokenizer=engine.tokenizer, tokenizer_fp=engine.provenance.tokenizer_sha256,
               embedder=HashEmbedder(), kv=KVSync(writer=engine_kv_writer(engine), deleter=engine_kv_deleter(engine)),
               options=IngestOptions(config=ChunkerConfig(target_tokens=64), stream=io.StringIO()))
    assert s.chunks_removed == 1 and s.gc_collected == 1 and s.files_unchanged == 2
    assert not engine.store.contains(Namespace.CANONICAL, key(DOCS["pump.txt"]))
    assert engine.store.contains(Namespace.CANONICAL, key("The pump weighs five kilograms."))
    assert engine.store.contains(Namespace.CANONICAL, key(DOCS["ferry.txt"]))


def test_engine_with_other_provenance_gets_every_chunk_kv_on_reingest(index, engine) -> None:
    """The demo's upgrade bug: an engine whose KV keys differ (here the GEMM backend) re-ingests an
    unchanged corpus; every indexed chunk must then be a canonical hit under its keys."""
    from blend.keys import canonical_key
    from blend.prompt import document_text, preamble_segment, tokenize_segment

    d, idx = index
    other = engine_mod.Engine.load("tiny-llama", store=engine.store, gemm="torch")
    assert engine_kv_signature(other) != engine_kv_signature(engine)
    assert engine_kv_signature(engine, "You are terse.") != engine_kv_signature(engine)
    pre = preamble_segment(other.tokenizer, None).token_ids

    texts = [r.text for r in Catalog.open(idx).records.values()]

    def held(e) -> bool:
        return all(e.store.contains(Namespace.CANONICAL, canonical_key(
            e.provenance, pre, tokenize_segment(e.tokenizer, document_text(t)))) for t in texts)

    ingest([d], idx, tokenizer=engine.tokenizer, tokenizer_fp=engine.provenance.tokenizer_sha256,
           embedder=HashEmbedder(),
           kv=engine_kv_sync(engine),
           options=IngestOptions(config=ChunkerConfig(target_tokens=64), stream=io.StringIO()))
    assert held(engine) and not held(other)
    s = ingest([d], idx, tokenizer=other.tokenizer, tokenizer_fp=other.provenance.tokenizer_sha256,
               embedder=HashEmbedder(),
               kv=engine_kv_sync(other),
               options=IngestOptions(config=ChunkerConfig(target_tokens=64), stream=io.StringIO()))
    assert s.files_unchanged == 3 and s.kv_checked == len(texts) and s.kv_bytes > 0
    assert held(other)
    assert Catalog.open(idx).meta.kv_signature == engine_kv_signature(other)


def test_an_ingest_whose_kv_writes_fail_says_so_and_records_no_kv_signature(tmp_path) -> None:
    """A failed store write is logged, not raised: ingest reported the bytes as written, recorded the
    engine's KV signature, and later runs never wrote the KV again (every ask computed every chunk)."""
    from blend.store.memory import MemoryStore

    d = tmp_path / "docs"
    d.mkdir()
    for k, v in DOCS.items():
        (d / k).write_text(v)
    from blend.store.spec import open_store
    broken = open_store(f"memory,disk:{tmp_path / 'kv'}")

    def refuse(*_a, **_kw):
        raise OSError("disk full")

    broken.tiers[-1].put = refuse  # the chain logs a tier's failed put and goes on
    eng = engine_mod.Engine.load("tiny-llama", store=broken)
    kw = dict(embedder=HashEmbedder(),
              options=IngestOptions(config=ChunkerConfig(target_tokens=64), stream=io.StringIO()))
    s = ingest([d], tmp_path / "idx", tokenizer=eng.tokenizer, tokenizer_fp=eng.provenance.tokenizer_sha256,
               kv=KVSync(writer=engine_kv_writer(eng), signature=engine_kv_signature(eng)), **kw)
    assert s.kv_unsaved == s.chunks_total > 0 and "NOT stored" in s.format()
    assert Catalog.open(tmp_path / "idx").meta.kv_signature != engine_kv_signature(eng)
    good = engine_mod.Engine.load("tiny-llama", store=MemoryStore())  # the store works again: written now
    again = ingest([d], tmp_path / "idx", tokenizer=good.tokenizer, tokenizer_fp=good.provenance.tokenizer_sha256,
                   kv=KVSync(writer=engine_kv_writer(good), signature=engine_kv_signature(good)), **kw)
    assert again.kv_unsaved == 0 and again.kv_checked == again.chunks_total and again.kv_bytes > 0
    assert Catalog.open(tmp_path / "idx").meta.kv_signature == engine_kv_signature(good)


def _cli(argv: list[str]) -> argparse.Namespace:
    from blend.cli import build_parser

    if argv[0] == "ask":  # the tiny model and a memory store unless the test says otherwise
        argv = [*argv, "--model", "tiny-llama", "--store", "memory"]
    return build_parser(argv[0]).parse_args(argv)


def cli_index(tmp_path: Path) -> Path:
    """DOCS ingested into ``tmp_path/idx`` by ``kvblend ingest`` (the tiny model, a memory store).

    Returns:
        The index folder.
    """
    from blend.retrieval.cli import run_ingest

    d = tmp_path / "docs"
    d.mkdir()
    for k, v in DOCS.items():
        (d / k).write_text(v)
    assert run_ingest(_cli(["ingest", str(d), "--index", str(tmp_path / "idx"), "--model", "tiny-llama",
                            "--store", "memory", "--quiet"])) == 0
    return tmp_path / "idx"


def test_cli_ingest_and_ask(tmp_path, capsys) -> None:
    from blend.retrieval.cli import ask_over_index, run_ingest

    d = tmp_path / "docs"
    d.mkdir()
    for k, v in DOCS.items():
        (d / k).write_text(v)
    (d / "bad.jsonl").write_text('{"text": "A fine line."}\n{"nope": 1}\n')
    rc = run_ingest(_cli(["ingest", str(d), str(tmp_path / "missing.md"), "--index", str(tmp_path / "idx"),
                          "--model", "tiny-llama", "--store", "memory", "--quiet"]))
    out, err = capsys.readouterr()
    assert rc == 1  # finished, with bad inputs listed
    assert "missing.md" in err and "bad.jsonl:2: no text field" in err
    assert "4 ingested" in out and "KV" in out
    assert len(Catalog.open(tmp_path / "idx").files) == 4
    rc = ask_over_index(_cli(["ask", "What is the ferry named?", "--index", str(tmp_path / "idx"), "--top-k", "2"]))
    out, _ = capsys.readouterr()
    assert rc == 0 and "ferry.txt" in out


@pytest.mark.parametrize("semantic", [False, True])
def test_cli_ingest_experimental_semantic_registers_each_chunk_as_a_donor(tmp_path, semantic: bool) -> None:
    """`kvblend ingest` had no --experimental-semantic: ingested chunks became donors only after a semantic
    engine hit each of them, so a near-duplicate of a chunk never asked about was computed in full. With the
    flag each chunk whose KV the ingest precomputes is registered (in the store's donor log), as a semantic
    engine does on first use; without it nothing is (the default is unchanged)."""
    from blend.retrieval.cli import run_ingest
    from blend.store.disk import DiskStore

    d = tmp_path / "docs"
    d.mkdir()
    for k, v in DOCS.items():
        (d / k).write_text(v)
    flag = ["--experimental-semantic"] if semantic else []
    assert run_ingest(_cli(["ingest", str(d), "--index", str(tmp_path / "idx"), "--model", "tiny-llama",
                            "--store", f"disk:{tmp_path / 'kv'}", "--quiet", *flag])) == 0
    chunks = list(DiskStore(tmp_path / "kv").keys(Namespace.CANONICAL))
    later = engine_mod.Engine.load("tiny-llama", store=DiskStore(tmp_path / "kv"), experimental_semantic=True,
                                   quality_gate=False)  # another process, reading the donor log
    assert len(chunks) == len(DOCS)
    assert len(later.segments.donors.index) == (len(chunks) if semantic else 0)
    assert all(k in later.segments.donors.index for k in chunks) == semantic


def test_cli_ask_notes_chunk_kv_precomputed_by_another_engine(tmp_path, capsys) -> None:
    from blend.retrieval.cli import ask_over_index, run_ingest

    d = tmp_path / "docs"
    d.mkdir()
    (d / "ferry.txt").write_text(DOCS["ferry.txt"])
    assert run_ingest(_cli(["ingest", str(d), "--index", str(tmp_path / "idx"), "--model", "tiny-llama",
                            "--store", "memory", "--quiet"])) == 0
    capsys.readouterr()
    assert ask_over_index(_cli(["ask", "What is the ferry named?", "--index", str(tmp_path / "idx")])) == 0
    assert "precomputed by another engine" not in capsys.readouterr().err
    assert ask_over_index(_cli(["ask", "What is the ferry named?", "--index", str(tmp_path / "idx"),
                                "--gemm", "torch"])) == 0
    assert "precomputed by another engine" in capsys.readouterr().err
    # what the note asks for: ingest again with that engine (and system prompt), then the chunks are hits
    assert run_ingest(_cli(["ingest", str(d), "--index", str(tmp_path / "idx"), "--model", "tiny-llama",
                            "--store", "memory", "--quiet", "--gemm", "torch", "--system", "Be brief."])) == 0
    capsys.readouterr()
    assert ask_over_index(_cli(["ask", "What is the ferry named?", "--index", str(tmp_path / "idx"),
                                "--gemm", "torch", "--system", "Be brief."])) == 0
    assert "precomputed by another engine" not in capsys.readouterr().err


def test_cli_ask_over_an_index_with_doc_uses_both_retrieved_chunks_then_the_doc(tmp_path, capsys) -> None:
    from blend.retrieval.cli import ask_over_index

    cli_index(tmp_path)
    extra = tmp_path / "extra.txt"
    extra.write_text("The lighthouse keeper is named Ilse Marsh.")
    capsys.readouterr()
    rc = ask_over_index(_cli(["ask", "Who keeps the lighthouse?", "--index", str(tmp_path / "idx"), "--top-k", "2",
                              "--doc", str(extra), "--json"]))
    out = strict_loads(capsys.readouterr().out)  # printed `"score": NaN` for the --doc file: not JSON
    assert rc == 0
    assert [r["source"] for r in out["retrieved"]][-1] == "caller"  # the --doc file, after the retrieved chunks
    assert out["retrieved"][-1]["score"] is None and all(isinstance(r["score"], float) for r in out["retrieved"][:2])
    assert len(out["retrieved"]) == 3 and all(r["source"] != "caller" for r in out["retrieved"][:2])
    assert out["retrieved"][-1]["text"] == extra.read_text()


def test_ask_decodes_with_a_generation_config_as_the_engines_stream_does(index, engine) -> None:
    from blend.generation import generate
    from blend.policy import ReusePolicy
    from blend.retrieval.pipeline import greedy_config
    from blend.sampling import GenerationConfig

    _, idx = index
    rag = RAG.open(idx, engine=engine, embedder=HashEmbedder())
    policy = ReusePolicy.blend(ratio=0.15, force=True)
    config = GenerationConfig(max_tokens=6, temperature=1.5, seed=11, stop_at_newline=False)
    ans = rag.ask("What is the ferry named?", top_k=2, policy=policy, config=config)
    prompt = engine.build_prompt("What is the ferry named?", [r.text for r in ans.retrieved])
    direct = generate(engine, prompt, policy, config)  # what `kvblend ask --doc` runs
    assert ans.answer == direct.text.strip() and ans.seed == 11 and len(direct.token_ids) >= 1
    assert rag.ask("What is the ferry named?", top_k=2, policy=policy, config=config).answer == ans.answer
    other = [rag.ask("What is the ferry named?", top_k=2, policy=policy, config=GenerationConfig(
        max_tokens=6, temperature=1.5, seed=s, stop_at_newline=False)).answer for s in range(12, 16)]
    assert any(o != ans.answer for o in other)  # the seed (not a greedy fallback) decides the sample
    capped = rag.ask("What is the ferry named?", top_k=2, policy=policy,
                     config=GenerationConfig(max_tokens=2, temperature=1.5, seed=11, stop_at_newline=False))
    assert capped.finish_reason in ("length", "stop")
    greedy = rag.ask("Who keeps the lighthouse?", documents=[DOCS["keeper.txt"]], max_new_tokens=3)
    assert greedy.answer == rag.ask("Who keeps the lighthouse?", documents=[DOCS["keeper.txt"]],
                                    config=greedy_config(3)).answer
    with pytest.raises(ValueError, match="max_tokens"):
        rag.ask("Who keeps the lighthouse?", documents=[DOCS["keeper.txt"]], max_new_tokens=3, config=config)


def test_rag_stream_yields_the_answer_it_returns(index, engine) -> None:
    from blend.sampling import GenerationConfig

    _, idx = index
    rag = RAG.open(idx, engine=engine, embedder=HashEmbedder())
    g = rag.stream("What is the ferry named?", top_k=2, config=GenerationConfig(max_tokens=5, stop_at_newline=False))
    assert len(g.retrieved) == 2  # retrieval ran before any decoding
    text = "".join(g)
    ans = g.result()
    assert ans.answer == text.strip() and [r.chunk_id for r in ans.retrieved] == [r.chunk_id for r in g.retrieved]


def test_cli_ask_over_an_index_honours_the_sampling_options(tmp_path, capsys) -> None:
    from blend.retrieval.cli import ask_over_index

    cli_index(tmp_path)
    capsys.readouterr()

    def ask(*extra: str) -> dict:
        assert ask_over_index(_cli(["ask", "What is the ferry named?", "--index", str(tmp_path / "idx"),
                                    "--max-new-tokens", "6", "--json", *extra])) == 0
        return json.loads(capsys.readouterr().out)

    a, b = ask("--temperature", "1.5", "--seed", "5", "--multiline"), ask("--temperature", "1.5", "--seed", "5",
                                                                         "--multiline")
    assert a["answer"] == b["answer"] and a["seed"] == 5
    others = {ask("--temperature", "1.5", "--seed", str(s), "--multiline")["answer"] for s in range(6, 10)}
    assert others != {a["answer"]}  # the sampling options reach the decoder
    greedy = ask()
    assert greedy["finish_reason"] in ("stop", "length") and "\n" not in greedy["answer"]
    assert ask_over_index(_cli(["ask", "What is the ferry named?", "--index", str(tmp_path / "idx"),
                                "--temperature", "1.5", "--seed", "5", "--multiline", "--max-new-tokens", "6"])) == 0
    out = capsys.readouterr().out
    assert out.startswith(a["answer"]) and "seed 5" in out  # streamed text mode: the same answer


def test_cli_user_errors_are_one_line(tmp_path, capsys) -> None:
    from blend.retrieval.cli import ask_over_index

    rc = ask_over_index(_cli(["ask", "q?", "--index", str(tmp_path / "none")]))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("kvblend: error:") and "no index here" in err[0]


def test_a_deleted_documents_chunks_stop_being_semantic_donors(tmp_path) -> None:
    from blend.keys import canonical_key
    from blend.prompt import document_text, preamble_segment, tokenize_segment
    from blend.store.memory import MemoryStore

    eng = engine_mod.Engine.load("tiny-llama", store=MemoryStore(), experimental_semantic=True, quality_gate=False)
    d = tmp_path / "docs"
    d.mkdir()
    for k, v in DOCS.items():
        (d / k).write_text(v)

    def run():
        return ingest([d], tmp_path / "idx", tokenizer=eng.tokenizer, tokenizer_fp=eng.provenance.tokenizer_sha256,
                      embedder=HashEmbedder(),
                      kv=KVSync(writer=engine_kv_writer(eng), deleter=engine_kv_deleter(eng)),
                      options=IngestOptions(config=ChunkerConfig(target_tokens=64), stream=io.StringIO()))

    run()
    pre = preamble_segment(eng.tokenizer, None).token_ids
    pump = canonical_key(eng.provenance, pre, tokenize_segment(eng.tokenizer, document_text(DOCS["pump.txt"])))
    assert pump in eng.segments.donors.index  # ingest offered it as a donor
    (d / "pump.txt").write_text("The pump weighs five kilograms.")
    assert run().gc_collected == 1
    assert not eng.store.contains(Namespace.CANONICAL, pump)
    assert pump not in eng.segments.donors.index  # its tokens are no longer offered (nor kept as a live donor)


def test_an_ingest_without_semantic_reuse_still_removes_a_deleted_chunks_donor(tmp_path) -> None:
    """`kvblend ingest` without --experimental-semantic: its engine's donors are off, and deleting a chunk
    left its registration live in the donor log beside the store for the processes that enable it."""
    from blend.keys import canonical_key
    from blend.prompt import document_text, preamble_segment, tokenize_segment
    from blend.store.disk import DiskStore

    secret = "The vault code of the northern tower is 7 4 1 9, known only to the keeper of the lantern."
    semantic = engine_mod.Engine.load("tiny-llama", store=DiskStore(tmp_path / "kv"), experimental_semantic=True,
                                      quality_gate=False)
    semantic.precompute_chunks([secret])
    plain = engine_mod.Engine.load("tiny-llama", store=DiskStore(tmp_path / "kv"), quality_gate=False)
    assert engine_kv_deleter(plain)("cid", secret)
    later = engine_mod.Engine.load("tiny-llama", store=DiskStore(tmp_path / "kv"), experimental_semantic=True,
                                   quality_gate=False)
    key = canonical_key(later.provenance, preamble_segment(later.tokenizer, None).token_ids,
                        tokenize_segment(later.tokenizer, document_text(secret)))
    assert key not in later.segments.donors.index


def test_an_engine_without_semantic_reuse_logs_removals_to_a_donor_log_created_after_its_first(tmp_path) -> None:
    """An engine without semantic reuse looked for donor logs once, at its first deletion: a log that a
    semantic process created afterwards got no removal record from it, so a chunk it deleted then stayed a
    live donor (tokens included) for every process. The logs are looked for at each removal (one stat)."""
    from blend.keys import canonical_key
    from blend.prompt import document_text, preamble_segment, tokenize_segment
    from blend.store.disk import DiskStore

    secret = "The vault code of the northern tower is 7 4 1 9, known only to the keeper of the lantern."
    plain = engine_mod.Engine.load("tiny-llama", store=DiskStore(tmp_path / "kv"), quality_gate=False)
    deleter = engine_kv_deleter(plain)
    assert deleter("early", "A chunk deleted before any process enabled semantic reuse.")
    assert not (tmp_path / "kv" / "logs").exists()  # no log yet: none is made for a removal
    semantic = engine_mod.Engine.load("tiny-llama", store=DiskStore(tmp_path / "kv"), experimental_semantic=True,
                                      quality_gate=False)
    semantic.precompute_chunks([secret])  # creates the donor log
    assert deleter("cid", secret)
    later = engine_mod.Engine.load("tiny-llama", store=DiskStore(tmp_path / "kv"), experimental_semantic=True,
                                   quality_gate=False)
    key = canonical_key(later.provenance, preamble_segment(later.tokenizer, None).token_ids,
                        tokenize_segment(later.tokenizer, document_text(secret)))
    assert key not in later.segments.donors.index


@pytest.mark.parametrize("semantic", [False, True])
def test_a_deleted_chunks_tokens_leave_the_donor_log_on_disk_at_once(tmp_path, semantic: bool) -> None:
    """A removal record only cancelled the registration: the deleted document's tokens stayed readable in
    the log file until a compaction that needs 64 lines and over half of them dead. An ingest that deletes
    chunks (finish() after its garbage collection) now rewrites the log without them."""
    from blend.prompt import document_ids
    from blend.store.disk import DiskStore

    secret = "The vault code of the northern tower is 7 4 1 9, known only to the keeper of the lantern."
    keep = "The harbor master logs every ship that enters after dusk, in a ledger kept by the gate."
    writer = engine_mod.Engine.load("tiny-llama", store=DiskStore(tmp_path / "kv"), experimental_semantic=True,
                                    quality_gate=False)
    writer.precompute_chunks([secret, keep])
    eng = engine_mod.Engine.load("tiny-llama", store=DiskStore(tmp_path / "kv"), experimental_semantic=semantic,
                                 quality_gate=False)
    tokens = ",".join(map(str, document_ids(eng.tokenizer, secret))).encode()
    logs = tmp_path / "kv" / "logs"

    def on_disk() -> bytes:
        return b"".join(f.read_bytes() for f in logs.rglob("*") if f.is_file())

    assert tokens in on_disk()
    deleter = engine_kv_deleter(eng)
    assert deleter("cid", secret)
    deleter.finish()
    assert tokens not in on_disk()  # gone from the files, not only cancelled
    kept = ",".join(map(str, document_ids(eng.tokenizer, keep))).encode()
    assert kept in on_disk()  # the live donor stays


def test_a_reingest_that_changes_chunk_ids_but_not_texts_keeps_their_kv(tmp_path) -> None:
    """A new tokenizer fingerprint gives every chunk a new id; the old ids went to garbage collection with
    the same texts, and KV (keyed by text) that the live chunks use was deleted."""
    from blend.prompt import preamble_segment
    from blend.retrieval.engine_kv import canonical_chunk_key
    from blend.store.memory import MemoryStore

    eng = engine_mod.Engine.load("tiny-llama", store=MemoryStore())
    d = tmp_path / "docs"
    d.mkdir()
    for k, v in DOCS.items():
        (d / k).write_text(v)

    def run(fp):
        return ingest([d], tmp_path / "idx", tokenizer=eng.tokenizer, tokenizer_fp=fp, embedder=HashEmbedder(),
                      kv=engine_kv_sync(eng),
                      options=IngestOptions(config=ChunkerConfig(target_tokens=64), stream=io.StringIO()))

    run(eng.provenance.tokenizer_sha256)
    s = run("0" * 64)
    assert s.gc_collected == s.chunks_total > 0  # the old ids leave the index
    pre = preamble_segment(eng.tokenizer, None)
    texts = [r.text for r in Catalog.open(tmp_path / "idx").records.values()]
    assert all(eng.store.contains(Namespace.CANONICAL, canonical_chunk_key(eng, pre, t)) for t in texts)


def test_a_delete_during_a_redis_outage_is_not_reported_done(tmp_path) -> None:
    """A Redis tier in its back-off window skips calls and answers the default: delete and contains read
    'absent', the deleter said the chunk was gone, and garbage collection forgot it while Redis kept its
    KV. Unknown is not gone: the chunk stays pending."""
    from blend.store.memory import MemoryStore
    from blend.store.redis_store import RedisStore
    from blend.store.tiered import TieredStore

    down = RedisStore("redis://127.0.0.1:1/0", connect_timeout_s=0.05, retry_after_s=60.0)  # nothing listens
    eng = engine_mod.Engine.load("tiny-llama", store=TieredStore([MemoryStore(), down], write_behind=False),
                                 quality_gate=False)
    text = "The ferry leaves the north pier at seven and returns before the tide turns at noon."
    eng.precompute_chunks([text])
    assert not down.available  # the put found the server down
    assert engine_kv_deleter(eng)("cid", text) is False
    up = engine_mod.Engine.load("tiny-llama", store=MemoryStore(), quality_gate=False)
    eng_mem = up.store  # a store with every tier answering: the same deletion is done
    up.precompute_chunks([text])
    assert engine_kv_deleter(up)("cid", text) is True and len(list(eng_mem.keys(Namespace.CANONICAL))) == 0


@pytest.mark.parametrize("damage", ["emptied last tier", "truncated entry"])
def test_a_kv_refresh_repairs_what_the_last_tier_lacks(tmp_path, damage: str) -> None:
    """precompute took any tier's key as stored: under an emptied last tier every refresh wrote nothing and
    counted the chunks unsaved (ingest exited 1 forever); a truncated file was reported saved."""
    from blend.prompt import preamble_segment
    from blend.retrieval.engine_kv import canonical_chunk_key
    from blend.store.disk import DiskStore
    from blend.store.tiered import TieredStore

    texts = ["The lighthouse keeper climbs the stairs each dusk to light the lamp.",
             "The mill by the river grinds barley every autumn for the village bakers."]
    upper, last = DiskStore(tmp_path / "upper"), DiskStore(tmp_path / "last")
    eng = engine_mod.Engine.load("tiny-llama", store=TieredStore([upper, last], write_behind=False),
                                 quality_gate=False)
    writer = engine_kv_writer(eng)
    assert writer(texts) > 0 and writer.unsaved == 0
    pre = preamble_segment(eng.tokenizer, None)
    keys = [canonical_chunk_key(eng, pre, t) for t in texts]
    if damage == "emptied last tier":
        last.clear()
    else:
        for key in keys:
            for tier in (upper, last):
                path = tier.path(Namespace.CANONICAL, key)
                path.write_bytes(path.read_bytes()[:100])
    again = engine_kv_writer(eng)
    assert again(texts) > 0 and again.unsaved == 0  # computed and stored again
    assert all(last.verify(Namespace.CANONICAL, k).state is EntryState.VALID for k in keys)


def test_a_kv_refresh_during_a_last_tier_outage_keeps_the_valid_copies(tmp_path) -> None:
    """The refresh's repair took a Redis tier's skipped call for 'absent' and deleted the valid disk copies:
    every ingest during an outage recomputed the whole corpus."""
    from blend.store.disk import DiskStore
    from blend.store.redis_store import RedisStore
    from blend.store.tiered import TieredStore

    texts = ["The lighthouse keeper climbs the stairs each dusk to light the lamp.",
             "The mill by the river grinds barley every autumn for the village bakers."]
    disk = DiskStore(tmp_path / "disk")
    down = RedisStore("redis://127.0.0.1:1/0", connect_timeout_s=0.05, retry_after_s=60.0)
    eng = engine_mod.Engine.load("tiny-llama", store=TieredStore([disk, down], write_behind=False),
                                 quality_gate=False)
    first = engine_kv_writer(eng)
    assert first(texts) > 0 and first.unsaved == 2  # Redis down: not in the last tier
    again = engine_kv_writer(eng)
    assert again(texts) == 0  # the disk copies are valid: nothing recomputed
    assert len(list(disk.keys(Namespace.CANONICAL))) == 2


def test_a_chunk_longer_than_the_context_gets_no_kv_and_does_not_count_as_unsaved(tiny_engine_factory):
    """precompute_chunks stored a 20k-token chunk for a 4,096-position model: KV no prompt could ever use
    (a prompt holding it is refused). It is skipped now, and the index writer does not count it as a
    failed write (that would keep the index from recording its KV signature for good)."""
    from blend.keys import Namespace

    eng = tiny_engine_factory()
    long = "word " * eng.dims.max_positions  # ~5 tokens a word on the byte tokenizer: far past the context
    writer = engine_kv_writer(eng)
    assert writer([long, "a short chunk."]) > 0  # the short one is written
    assert len(list(eng.store.keys(Namespace.CANONICAL))) == 1 and writer.unsaved == 0


def test_cli_ask_over_an_index_refuses_a_bad_sampling_flag_before_the_model_loads(index, monkeypatch, capsys) -> None:
    """--temperature 5 with --index loaded the model first and only then was refused."""
    import blend.retrieval.cli as rcli
    from blend.cli import main

    def no_load(args):
        raise AssertionError("the engine loaded before the sampling flags were checked")

    monkeypatch.setattr(rcli, "engine_from_args", no_load)
    _, idx = index
    assert main(["ask", "q", "--index", str(idx), "--model", "tiny-llama", "--temperature", "5"]) == 2
    assert "temperature must be in [0, 2]" in capsys.readouterr().err
