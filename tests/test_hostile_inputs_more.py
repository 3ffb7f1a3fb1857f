"""Hostile inputs, second round: numbers past a float, shapes past a tensor, corrupt records, atomic writes.

Each test names the bug it pins down; each failed before its fix (an exception other than the
module's own error escaped, a corrupt record was trusted, or a temporary file was left behind).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import types

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from blend import gate, models, safeio
from blend.donors import DonorIndex
from blend.errors import InvalidPolicyError, InvalidRequestError
from blend.integrations.vllm.plan import PARAMS_KEY, parse_blend_params
from blend.keys import STORE_FORMAT_VERSION, Namespace, Provenance, StoreKey
from blend.policy import ReusePolicy
from blend.report import ReuseClass
from blend.store import codec
from blend.store.base import KVEntry, LookupStatus
from blend.store.codec import EntryError, EntryErrorKind, EntryHeader, checksum, decode, encode
from blend.store.disk import DiskStore
from blend.store.memory import MemoryStore
from blend.store.record_logs import DiskRecordLogs
from blend.store.redis_store import RedisStore
from blend.store.spec import StoreSpecError, parse_size, parse_store_spec
from blend.store.tiered import TieredStore
from blend.retrieval.corpus import IssueKind, read_file
from conftest import make_docs

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
PROV = Provenance("llama:x", "w", "t", "float32", "float32", "cpu", "kvblend-layers", "{}")
KEY = StoreKey(b"\x01" * 32)
HUGE = 10**400  # an int JSON may carry; float() of it overflows


# ---- 1. vLLM kv_transfer_params: numbers past a float ------------------------------------------------

def _params(**kw):
    return {PARAMS_KEY: {"documents": [[1, 3]], **kw}}


@pytest.mark.parametrize("field, value", [
    ("ratio", HUGE), ("ratio", -HUGE), ("ratio", float("inf")), ("ratio", 1e400),
    ("guard_margin", HUGE), ("guard_margin", float("inf")), ("guard_margin", -HUGE),
])
def test_vllm_blend_params_huge_numbers_are_invalid_requests(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        parse_blend_params(_params(**{field: value}), 10)


def test_vllm_blend_params_from_json_with_a_400_digit_ratio():
    raw = '{"kvblend": {"mode": "blend", "ratio": 1' + "0" * 400 + ', "documents": [[1, 3]]}}'
    with pytest.raises(InvalidRequestError, match="ratio"):
        parse_blend_params(json.loads(raw), 10)


@FAST
@given(value=st.one_of(st.integers(min_value=-(10**500), max_value=10**500), st.floats(allow_nan=True),
                       st.booleans(), st.text(max_size=3), st.none()))
def test_vllm_blend_params_any_number_gives_params_or_invalid_request(value):
    for field in ("ratio", "guard_margin"):
        try:
            p = parse_blend_params(_params(**{field: value}), 10)
        except InvalidRequestError:
            continue
        got = p.ratio if field == "ratio" else p.guard_margin
        assert got is None or (isinstance(got, float) and math.isfinite(got))


# ---- 2. codec: a header whose shape torch cannot lay out --------------------------------------------

def _blob(shape, prov=json.dumps({"kv_dtype": "float32"}), key=KEY, ns=Namespace.EXACT):
    """A zero-byte blob whose header claims ``shape``, with a matching (unkeyed) checksum."""
    meta = EntryHeader(STORE_FORMAT_VERSION, ns.value, key.hex(), prov, tuple(shape), "float32", "")
    meta = dataclasses.replace(meta, checksum=checksum(meta))
    header = {"__metadata__": {"kvblend": meta.to_json()},
              "k": {"dtype": "F32", "shape": list(shape), "data_offsets": [0, 0]},
              "v": {"dtype": "F32", "shape": list(shape), "data_offsets": [0, 0]}}
    hj = json.dumps(header).encode()
    hj += b" " * (-len(hj) % 8)
    return len(hj).to_bytes(8, "little") + hj


@pytest.mark.parametrize("shape", [
    [0, 2**40, 2**40, 1], [0, 2**62, 2**62, 4], [0, 2**70, 1, 1], [1, 2**20, 0, 2**40],
    [2**20, 2**20, 0, 2**20], [1, 1, 2**40, 0], [0, 1, 1, 1],
])
def test_decode_of_an_impossible_shape_is_a_shape_entry_error(shape):
    with pytest.raises(EntryError) as e:
        decode(bytearray(_blob(shape)), Namespace.EXACT, KEY)
    assert e.value.kind is EntryErrorKind.SHAPE


def test_a_view_torch_refuses_becomes_an_entry_error(monkeypatch):
    blob = encode(Namespace.EXACT, KEY, KVEntry(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4),
                                                json.dumps({"kv_dtype": "float32"})))
    for exc in (RuntimeError("Stride calculation overflowed"), TypeError("Overflow when unpacking long long")):
        def refuse(*a, exc=exc, **k):
            raise exc
        monkeypatch.setattr(codec, "_view", refuse)
        with pytest.raises(EntryError) as e:
            decode(bytearray(blob), Namespace.EXACT, KEY)
        assert e.value.kind is EntryErrorKind.SHAPE


@FAST
@given(shape=st.lists(st.one_of(st.integers(0, 4), st.integers(0, 2**70)), min_size=4, max_size=4))
def test_decode_of_any_claimed_shape_raises_only_entry_error(shape):
    try:
        e = decode(bytearray(_blob(shape)), Namespace.EXACT, KEY)
    except EntryError:
        return
    assert e.k.numel() == 0 and tuple(e.k.shape) == tuple(shape)


def test_impossible_shape_on_disk_is_rejected_by_every_reader(tmp_path):
    disk = DiskStore(tmp_path)
    p = disk.path(Namespace.EXACT, KEY)
    p.parent.mkdir(parents=True)
    p.write_bytes(_blob([0, 2**40, 2**40, 1]))
    prov = json.dumps({"kv_dtype": "float32"})
    assert disk.get(Namespace.EXACT, KEY, prov).status is LookupStatus.REJECTED
    assert "shape" in disk.verify(Namespace.EXACT, KEY).reason
    tiered = TieredStore([MemoryStore(), disk], write_behind=False)
    assert tiered.get(Namespace.EXACT, KEY, prov).status is LookupStatus.REJECTED


@pytest.fixture(scope="module")
def tiny():
    from blend.engine import Engine

    return Engine.load("tiny-llama", quality_gate=False)


def _classes(eng, store, prompt):
    ans = eng.with_store(store).generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
    return [s.reuse_class for s in ans.report.segments if s.kind.value != "question"]


def test_impossible_shape_entries_are_rejected_then_replaced(tiny, tmp_path):
    store = DiskStore(tmp_path, fsync=False)
    prompt = tiny.build_prompt("Which?", make_docs(2))
    assert set(_classes(tiny, store, prompt)) == {ReuseClass.COMPUTED}
    n = 0
    for ns in Namespace:
        for key in list(store.keys(ns)):
            store.path(ns, key).write_bytes(_blob([0, 2**40, 2**40, 1], tiny.segments.provenance_json, key, ns))
            n += 1
    assert n >= 2
    assert set(_classes(tiny, store, prompt)) == {ReuseClass.REJECTED}  # no exception: recomputed
    assert set(_classes(tiny, store, prompt)) == {ReuseClass.EXACT}  # and overwritten


# ---- 3. policy: infinity and integers past a float --------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("candidates", math.inf), ("candidates", HUGE), ("ratio", HUGE), ("max_ratio", math.inf),
    ("guard_margin", math.inf), ("guard_margin", HUGE), ("guard_ratio", math.inf), ("threshold", math.inf),
    ("threshold", HUGE), ("auto_target", math.inf), ("auto_target", HUGE), ("reused_temperature", HUGE),
    ("layer_ratios", (math.inf,)), ("candidates", math.nan),
])
def test_policy_rejects_non_finite_numbers_clearly(field, value):
    with pytest.raises(InvalidPolicyError, match=field):
        ReusePolicy.blend(**{field: value})


@FAST
@given(field=st.sampled_from(["ratio", "max_ratio", "guard_margin", "guard_ratio", "threshold", "auto_target",
                              "candidates", "reused_temperature"]),
       value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**400), 10**400)))
def test_policy_construction_either_works_or_is_an_invalid_policy(field, value):
    try:
        p = ReusePolicy.blend(**{field: value})
    except InvalidPolicyError:
        return
    assert math.isfinite(float(getattr(p, field)))
    if p.candidates is not None:  # what candidate pre-selection does with it (blending.BlendRows._probe_first):
        want = p.candidates * 7  # a budget of 7 rows; a huge factor makes this inf, compared before ceil
        n_cand = 10 if want >= 10 else int(math.ceil(want))  # of 10 free rows: no OverflowError
        assert 1 <= n_cand <= 10


# ---- 4. segments: an entry of another model shape ---------------------------------------------------

def test_entry_with_wrong_layers_is_rejected_and_replaced(tiny):
    store = MemoryStore()
    prompt = tiny.build_prompt("Which?", make_docs(2))
    assert set(_classes(tiny, store, prompt)) == {ReuseClass.COMPUTED}
    for ns in Namespace:
        for k in list(store.keys(ns)):
            e = store.get(ns, k, tiny.segments.provenance_json).entry
            store.put(ns, k, KVEntry(e.k[:1].clone(), e.v[:1].clone(), e.provenance))  # one layer, same T
    ans = tiny.with_store(store).generate(prompt, ReusePolicy.exact(), max_new_tokens=1)
    rows = [s for s in ans.report.segments if s.kind.value != "question"]
    assert {s.reuse_class for s in rows} == {ReuseClass.REJECTED}
    assert all("shape" in s.note for s in rows)
    assert set(_classes(tiny, store, prompt)) == {ReuseClass.EXACT}


@pytest.mark.parametrize("cut", ["heads", "dim"])
def test_lookup_rejects_wrong_heads_or_head_dim(tiny, cut):
    seg = tiny.segments
    d = seg.model.dims
    shape = [d.num_layers, d.num_kv_heads, 3, d.head_dim]
    shape[1 if cut == "heads" else 3] += 1
    store = MemoryStore()
    store.put(Namespace.EXACT, KEY, KVEntry(torch.zeros(shape), torch.zeros(shape), seg.provenance_json))
    old = seg.store
    seg.store = store
    try:
        found = seg.lookup(Namespace.EXACT, KEY, 3)
    finally:
        seg.store = old
    assert found.entry is None and "shape" in found.rejected


# ---- 5. the gate record -----------------------------------------------------------------------------

@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path))
    return types.SimpleNamespace(provenance=PROV, dtype=torch.float32, kv_dtype=None, model_name="m")


def _figure(name, bound, passed):
    """A figure within the check's bound (passed) or past it."""
    return (bound + 0.1 if passed else bound - 0.1) if name in gate.AT_LEAST else (bound / 2 if passed else bound * 2)


def _record(passed=True, **over):
    bounds = gate.check_bounds(torch.float32)  # the fake engine's
    d = {"model": "m", "provenance_sha256": PROV.digest().hex(), "passed": passed,
         "checks": [{"name": n.value, "passed": passed, "figure": _figure(n, bounds[n], passed), "bound": bounds[n],
                     "detail": ""} for n in gate.CheckName]}
    d.update(over)
    return d


def _with_check(name, **fields):
    """A passing record whose ``name`` check has ``fields`` instead."""
    return {**_record(), "checks": [{**c, **fields} if c["name"] == name.value else c for c in _record()["checks"]]}


def _write(eng, text):
    p = gate.gate_path(eng)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_a_well_formed_record_loads(fake_engine):
    _write(fake_engine, json.dumps(_record()))
    assert gate.load_record(fake_engine).passed
    _write(fake_engine, json.dumps(_record(False)))
    assert not gate.load_record(fake_engine).passed


@pytest.mark.parametrize("text", [
    "[" * 100_000,
    json.dumps(_record(checks=[])),
    json.dumps({**_record(), "checks": [{**c, "passed": "false"} for c in _record()["checks"]]}),
    json.dumps({**_record(), "checks": [{**c, "passed": 1} for c in _record()["checks"]]}),
    json.dumps({**_record(), "checks": _record()["checks"][:-1]}),
    json.dumps({**_record(), "checks": _record()["checks"] + _record()["checks"][:1]}),
    json.dumps({**_record(), "checks": [{**c, "name": "other"} for c in _record()["checks"]]}),
    json.dumps(_record(provenance_sha256="0" * 64)),
    json.dumps(_record(passed="yes")),
    json.dumps({**_record(), "checks": [{**c, "figure": HUGE} for c in _record()["checks"]]}),
    # "passed": true beside a figure past its bound (or NaN), or against another bound than this engine's
    json.dumps(_with_check(gate.CheckName.FIDELITY_KL, figure=3.0)),
    json.dumps(_with_check(gate.CheckName.FIDELITY_TOP1, figure=0.1)),
    json.dumps(_with_check(gate.CheckName.REFERENCE, figure=float("nan"))),
    json.dumps(_with_check(gate.CheckName.FIDELITY_KL, figure=3.0, bound=5.0)),
    json.dumps(_with_check(gate.CheckName.ROPE, bound=1.0)),
    "[]", "", "\xff", "null", '{"checks": {}}',
], ids=lambda t: t[:24])
def test_a_bad_record_is_no_record(fake_engine, text, caplog):
    _write(fake_engine, text)
    assert gate.load_record(fake_engine) is None
    assert "gate runs again" in caplog.text


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4)
                     | st.sampled_from([n.value for n in gate.CheckName]),
                     lambda kids: st.lists(kids, max_size=5) | st.dictionaries(
                         st.sampled_from(["model", "provenance_sha256", "checks", "passed", "name", "figure",
                                          "bound", "detail"]), kids, max_size=8), max_leaves=30)


@FAST
@given(d=_JSON)
def test_a_record_parses_or_is_a_gate_record_error(d):
    try:
        r = gate.GateResult.from_dict(d)
    except gate.GateRecordError:
        return
    assert sorted(c.name.value for c in r.checks) == sorted(n.value for n in gate.CheckName)
    assert all(type(c.passed) is bool for c in r.checks)


def test_a_fifo_at_the_record_path_is_not_waited_on(fake_engine):
    p = gate.gate_path(fake_engine)
    p.parent.mkdir(parents=True)
    os.mkfifo(p)
    done = []
    t = threading.Thread(target=lambda: done.append(gate.load_record(fake_engine)), daemon=True)
    t.start()
    t.join(5)
    assert done == [None]


def test_a_bad_record_makes_the_gate_run_again_and_is_rewritten(fake_engine, monkeypatch):
    _write(fake_engine, json.dumps({**_record(), "checks": []}))  # all([]) would have said "passed"
    failing = gate.GateResult.from_dict(_record(False))
    runs = []
    monkeypatch.setattr(gate, "run_gate", lambda eng, progress=True: runs.append(1) or failing)
    verdict = gate.QualityGate(progress=False).verdict(fake_engine)
    assert runs == [1] and verdict.refused
    assert gate.load_record(fake_engine) == failing


# ---- 6. the weights fingerprint cache ---------------------------------------------------------------

@pytest.mark.parametrize("text", ["", "[]", '{"weights_sha256": 5}', '{"weights_sha256": "abc"}',
                                  json.dumps({"weights_sha256": "G" * 64}), "[" * 50_000, "null", "\xff"])
def test_a_corrupt_fingerprint_cache_is_a_miss_and_rewritten(tmp_path, monkeypatch, text):
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path / "home"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"x" * 10)
    model = torch.nn.Linear(2, 2)
    want = models.weights_fingerprint(model)
    assert models._dir_fingerprint(ckpt, model) == want
    [cache] = (tmp_path / "home" / "fingerprints").glob("*.json")
    cache.write_text(text)
    assert models._dir_fingerprint(ckpt, model) == want
    assert json.loads(cache.read_text())["weights_sha256"] == want
    (ckpt / models.FINGERPRINT_FILE).write_text(text)  # a checkpoint's own file, corrupt: the same
    assert models._dir_fingerprint(ckpt, model) == want


# ---- 7. corpus: lone surrogates in JSONL ------------------------------------------------------------

def test_jsonl_text_with_a_lone_surrogate_is_a_line_issue(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_bytes(b'{"text": "fine one"}\n{"text": "hello \\ud800 world"}\n{"text": "fine two"}\n')
    fr = read_file(p)
    assert [d.text for d in fr.documents] == ["fine one", "fine two"]
    assert [(i.line, i.kind) for i in fr.issues] == [(2, IssueKind.NOT_UTF8)]


@FAST
@given(texts=st.lists(st.lists(st.sampled_from(["a", " ", "\u00e9", "\ud800", "\udfff", "\U0001f600", "\n"]),
                               max_size=6).map("".join), min_size=1, max_size=4))
@example(texts=["\ud800\udfff", "\udfff\ud800", "a\ud800"])  # a pair JSON joins; a reversed pair; a lone one
def test_jsonl_documents_are_always_utf8(tmp_path_factory, texts):
    p = tmp_path_factory.mktemp("c") / "a.jsonl"
    p.write_bytes("\n".join(json.dumps({"text": t}) for t in texts).encode())
    fr = read_file(p)
    for d in fr.documents:
        d.text.encode("utf-8")
    # every line is either a document (its text, whole) or an issue: a surrogate is NOT_UTF8, blank is EMPTY
    want_docs, want_issues = [], []
    for line, raw in enumerate(texts, start=1):
        t = json.loads(json.dumps(raw))  # JSON joins an escaped high + low surrogate pair into one character
        if any("\ud800" <= c <= "\udfff" for c in t):
            want_issues.append((line, IssueKind.NOT_UTF8))
        elif not t.strip():
            want_issues.append((line, IssueKind.EMPTY))
        else:
            want_docs.append((line, t))
    assert [(d.line, d.text) for d in fr.documents] == want_docs
    assert [(i.line, i.kind) for i in fr.issues] == want_issues


# ---- 8. redis: the fetch is bounded by the size checked -----------------------------------------------

class _SwappingRedis:
    """A fake client whose value is swapped for a bigger one right after the size probe."""

    def __init__(self, first: bytes, then: bytes | None) -> None:
        self.value, self.then, self.ranges = first, then, []

    def pipeline(self, transaction=False):
        client, ops = self, []

        class Pipe:
            def exists(self, k):
                ops.append(1)

            def strlen(self, k):
                ops.append(len(client.value))

            def getrange(self, k, a, b):
                ops.append(client.value[a:b + 1])

            def execute(self, raise_on_error=True):
                if client.then is not None:
                    client.value = client.then  # another writer's SET lands between the round trips
                return ops

        return Pipe()

    def getrange(self, k, a, b):
        self.ranges.append((a, b))
        return self.value[a:b + 1]

    def get(self, k):
        raise AssertionError("an unbounded GET")


def _small():
    return encode(Namespace.EXACT, KEY, KVEntry(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4),
                                                json.dumps({"kv_dtype": "float32"})))


@pytest.mark.parametrize("then", [b"\0" * (1 << 20), None, b""])
def test_redis_fetch_reads_at_most_the_checked_size(then):
    small = _small()
    r = RedisStore("redis://127.0.0.1:1/0")
    r._link.client = fake = _SwappingRedis(small, then)
    got = r.get(Namespace.EXACT, KEY, json.dumps({"kv_dtype": "float32"}))
    assert fake.ranges and all(b - a + 1 <= len(small) + 1 for a, b in fake.ranges)
    want = {None: LookupStatus.HIT, b"": LookupStatus.MISS}.get(then, LookupStatus.REJECTED)
    assert got.status is want


def test_redis_fetch_rejects_a_same_prefix_value_that_grew():
    small = _small()
    r = RedisStore("redis://127.0.0.1:1/0")
    r._link.client = _SwappingRedis(small, small + b"\0" * 64)
    assert r.get(Namespace.EXACT, KEY, json.dumps({"kv_dtype": "float32"})).status is LookupStatus.REJECTED


# ---- 9. store spec sizes ----------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "1e400", "1e400K", "Infinity", "1e30T", "9" * 400])
def test_parse_size_out_of_range_is_a_spec_error(text):
    with pytest.raises(StoreSpecError):
        parse_size(text)


def test_disk_spec_max_bytes_inf_is_a_spec_error():
    with pytest.raises(StoreSpecError):
        parse_store_spec("disk:/tmp/x?max_bytes=inf")


@FAST
@given(text=st.text(max_size=12))
def test_parse_size_raises_only_its_own_error(text):
    try:
        n = parse_size(text)
    except StoreSpecError:
        return
    assert isinstance(n, int) and n >= 1


# ---- 10. atomic writes ------------------------------------------------------------------------------

def test_atomic_write_replaces_fsyncs_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "f.json"
    target.write_text("old")
    os.chmod(target, 0o640)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    safeio.atomic_write_text(target, "new")
    assert target.read_text() == "new" and len(synced) == 2  # the file, then the folder
    assert os.stat(target).st_mode & 0o777 == 0o640 and os.listdir(tmp_path) == ["f.json"]

    def fail(*a, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        safeio.atomic_write_bytes(target, b"newer")
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["f.json"]


def test_an_atomic_file_is_private_on_request_and_a_failing_block_changes_nothing(tmp_path):
    target = tmp_path / "entry.bin"
    with safeio.atomic_file(target, private=True) as f:  # the disk store's entries, the assembled GGUF
        f.write(b"a")
        f.write(b"b")
    assert target.read_bytes() == b"ab" and os.stat(target).st_mode & 0o777 == 0o600
    with pytest.raises(RuntimeError, match="mid-write"):
        with safeio.atomic_file(target) as f:
            f.write(b"partial")
            raise RuntimeError("mid-write")
    assert target.read_bytes() == b"ab" and os.listdir(tmp_path) == ["entry.bin"]


@pytest.fixture
def atomic_paths(monkeypatch):
    """The paths written through safeio.atomic_write_bytes."""
    seen = []
    real = getattr(safeio, "atomic_write_bytes", None)

    def spy(path, data, **kw):
        seen.append(os.fspath(path))
        return real(path, data, **kw)

    monkeypatch.setattr(safeio, "atomic_write_bytes", spy, raising=False)
    return seen


def test_gate_record_and_fingerprint_cache_write_atomically(fake_engine, tmp_path, atomic_paths):
    gate.record(fake_engine, gate.GateResult.from_dict(_record()))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    models._dir_fingerprint(ckpt, torch.nn.Linear(1, 1))
    assert atomic_paths[0] == str(gate.gate_path(fake_engine))
    assert "fingerprints" in atomic_paths[1]


def test_a_failed_gate_record_leaves_no_temp_file(fake_engine, monkeypatch):
    monkeypatch.setattr(os, "replace", lambda *a, **kw: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        gate.record(fake_engine, gate.GateResult.from_dict(_record()))
    assert os.listdir(gate.gate_path(fake_engine).parent) == []


def test_record_log_rewrite_is_atomic_and_leaves_no_temp_on_failure(tmp_path, monkeypatch, atomic_paths):
    logs = DiskRecordLogs(tmp_path)
    logs.append("donors", b"a")
    logs.append("donors", b"b")
    beneath = []
    real_beneath = safeio.atomic_file_beneath
    monkeypatch.setattr(safeio, "atomic_file_beneath", lambda root, path, **kw: (
        beneath.append(os.fspath(path)), real_beneath(root, path, **kw))[1])
    assert logs.rewrite("donors", [b"a", b"b"], [b"c"]) and logs.read("donors") == [b"c"]
    assert beneath == [str(logs.path("donors"))]  # the atomic write that never follows a link
    monkeypatch.setattr(os, "replace", lambda *a, **kw: (_ for _ in ()).throw(OSError("disk full")))
    assert not logs.rewrite("donors", [b"c"], [b"d"])
    assert os.listdir(tmp_path) == ["donors.jsonl"] and logs.read("donors") == [b"c"]


def test_donor_index_saves_do_not_share_a_temp_name(tmp_path, atomic_paths):
    path = tmp_path / "donors.json"
    (tmp_path / "donors.json.tmp").mkdir()  # the fixed temp name every save used to write
    idx = DonorIndex()
    idx.add(KEY, [1, 2, 3], list(range(40)))
    idx.save(path)
    assert atomic_paths == [str(path)]
    assert len(DonorIndex.load(path).candidates([1, 2, 3], list(range(40)), 0.5)) == 1


def test_catalog_current_is_written_atomically(tmp_path, monkeypatch, atomic_paths):
    from blend.retrieval.ingest import ingest
    from blend.retrieval.ingest_options import IngestOptions
    from blend.retrieval.testing import HashEmbedder, word_tokenizer

    doc = tmp_path / "a.txt"
    doc.write_text("a perfectly fine document about cats.")
    idx = tmp_path / "idx"
    ingest([str(doc)], str(idx), tokenizer=word_tokenizer(["cats"]), embedder=HashEmbedder(),
           options=IngestOptions(progress=False))
    assert str(idx / "CURRENT") in atomic_paths
    doc.write_text("another document about dogs.")
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b, **kw: (_ for _ in ()).throw(OSError("disk full"))
                        if os.path.basename(b) == "CURRENT" else real(a, b, **kw))
    with pytest.raises(OSError):
        ingest([str(doc)], str(idx), tokenizer=word_tokenizer(["dogs"]), embedder=HashEmbedder(),
               options=IngestOptions(progress=False))
    assert not [p for p in os.listdir(idx) if "CURRENT" in p and p != "CURRENT"]
