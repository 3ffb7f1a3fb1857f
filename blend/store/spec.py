"""``--store`` specs: which tiers a command uses.

    memory                      in-process LRU only (lost at exit)
    disk:PATH                   memory -> disk at PATH
    disk:PATH?max_bytes=20G     ... with a byte budget (LRU; K/M/G/T are powers of 1024)
    redis://HOST:PORT/DB        memory -> redis
    disk:PATH,redis://H:P/DB    memory -> disk -> redis (any comma-separated chain)
    (none)                      $KVBLEND_STORE, else disk:$KVBLEND_HOME/store
                                ($KVBLEND_HOME defaults to ~/.cache/kvblend)

Redis options ride on the URL's query string and are removed before the URL
reaches redis-py: ``redis://h:6379/0?prefix=team&ttl=86400``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

from blend.defaults import DEFAULT_MEMORY_BUDGET, DEFAULT_WRITE_BEHIND, kvblend_home
from blend.prompt import is_unicode
from blend.store.base import InspectableStore
from blend.store.disk import DiskStore
from blend.store.memory import MemoryStore
from blend.store.redis_url import redacted_url
from blend.store.tiered import TieredStore

_REDIS_OPTIONS = ("prefix", "ttl")


class StoreSpecError(ValueError):
    """A ``--store`` value that names no store."""


class TierKind(Enum):
    MEMORY = "memory"
    DISK = "disk"
    REDIS = "redis"


@dataclass(frozen=True)
class TierSpec:
    kind: TierKind
    location: str = ""  # disk: a path; redis: the URL without kvblend options
    prefix: str = "kvblend"
    ttl_s: int | None = None
    budget_bytes: int | None = None  # disk: LRU byte budget


MAX_SIZE = 1 << 60  # bytes: no budget is larger (an int that any byte count compares with)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes in ``text``: a whole number with an optional K, M, G or T (powers of 1024, ``iB``/``B`` allowed).

    Args:
        text: the size as written (``500M``, ``20GiB``, ``1.5G``, ...).

    Returns:
        The size in bytes, rounded down, from 1 to :data:`MAX_SIZE`.

    Raises:
        StoreSpecError: not a positive size.
    """
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1] if t and t[-1] in "KMGT" else ""
    number = t[: len(t) - len(unit)]
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise StoreSpecError(f"size must look like 500M or 20G, got {text!r:.80}") from None
    if not math.isfinite(value):  # inf, nan, 1e400 (float() reads them all)
        raise StoreSpecError(f"size must be a finite number of bytes, got {text!r:.80}")
    if not value >= 1:
        raise StoreSpecError(f"size must be at least one byte, got {text!r:.80}")
    if value > MAX_SIZE:
        raise StoreSpecError(f"size must be at most {MAX_SIZE} bytes (1 EiB), got {text!r:.80}")
    return int(value)


def default_spec() -> str:
    """The store spec used where none is given: ``$KVBLEND_STORE``, else the disk store under
    ``$KVBLEND_HOME/store``.

    Returns:
        The spec, as :func:`open_store` reads it.
    """
    return os.environ.get("KVBLEND_STORE") or f"disk:{kvblend_home() / 'store'}"


def _parse_one(part: str) -> TierSpec:
    if part == "memory":
        return TierSpec(TierKind.MEMORY)
    if part.startswith("disk:"):
        path, _, query = part[len("disk:") :].partition("?")
        if not path:
            raise StoreSpecError("disk: needs a path, e.g. disk:/var/cache/kvblend")
        opts = dict(parse_qsl(query, keep_blank_values=True))
        unknown = sorted(set(opts) - {"max_bytes"})
        if unknown:
            raise StoreSpecError(f"unknown disk option(s) {', '.join(unknown)}: the only one is max_bytes")
        budget = parse_size(opts["max_bytes"]) if "max_bytes" in opts else None
        return TierSpec(TierKind.DISK, path, budget_bytes=budget)
    if part.startswith(("redis://", "rediss://", "unix://")):
        if not is_unicode(part):  # a byte the locale could not decode (argv and the environment keep it escaped)
            raise StoreSpecError(f"{redacted_url(part)!a}: a Redis URL must be UTF-8 text")
        u = urlsplit(part)
        query = parse_qsl(u.query)
        _check_database(part, u.path if u.scheme != "unix" else "", [v for k, v in query if k == "db"])
        opts = {k: v for k, v in query if k in _REDIS_OPTIONS}
        rest = [(k, v) for k, v in query if k not in _REDIS_OPTIONS]
        try:
            ttl = int(opts["ttl"]) if "ttl" in opts else None
        except ValueError:
            raise StoreSpecError(f"ttl must be whole seconds, got {opts['ttl']!r}") from None
        if ttl is not None and ttl < 1:  # Redis refuses SET ... EX 0 (and below): every put would fail
            raise StoreSpecError(f"ttl must be at least 1 second, got {ttl}")
        # only the query changes: cut it off the text rather than re-joining the parts (urlunsplit drops the
        # empty authority of unix:///path, and redis-py refuses unix:/path)
        base = part.split("?", 1)[0].split("#", 1)[0]
        url = base + ("?" + urlencode(rest) if rest else "") + ("#" + u.fragment if u.fragment else "")
        return TierSpec(TierKind.REDIS, url, prefix=opts.get("prefix", "kvblend"), ttl_s=ttl)
    raise StoreSpecError(f"unknown store {part!r}: use memory, disk:PATH or redis://HOST:PORT/DB")


def _check_database(url: str, path: str, db_params: list[str]) -> None:
    """A Redis database is a whole number >= 0, given as the URL's path (``/3``) or ``?db=3``.

    redis-py ignores a database it cannot parse and silently uses database 0.
    """
    given = [path.strip("/")] if path.strip("/") else []
    for db in given + db_params:
        if not db.isdigit() or not db.isascii():
            raise StoreSpecError(f"{redacted_url(url)}: the Redis database must be a whole number >= 0 (e.g. /0), "
                                 f"got {db!r}")


def redacted_spec(spec: str) -> str:
    """A store spec as output may show it.

    Args:
        spec: a ``--store`` spec (a comma chain of tiers).

    Returns:
        The spec with every Redis tier's password replaced by ``***``.
    """
    return ",".join(redacted_url(part) if part.strip().lower().startswith(("redis", "unix")) else part
                    for part in spec.split(","))


def parse_store_spec(spec: str | None) -> list[TierSpec]:
    """Tiers named by ``spec`` (None: the default), fastest first, without the memory front.

    Args:
        spec: see the module docstring.

    Returns:
        One TierSpec per comma-separated part.
    """
    text = (spec or default_spec()).strip()
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise StoreSpecError("empty store spec")
    return [_parse_one(p) for p in parts]


def _build(t: TierSpec, memory_budget_bytes: int | None) -> InspectableStore:
    if t.kind is TierKind.MEMORY:
        return MemoryStore(memory_budget_bytes)
    if t.kind is TierKind.DISK:
        return DiskStore(t.location, budget_bytes=t.budget_bytes)
    from blend.store.redis_store import RedisStore  # redis-py loads only for a spec that names a Redis tier

    return RedisStore(t.location, prefix=t.prefix, ttl_s=t.ttl_s)


def open_store(
    spec: str | None = None,
    *,
    memory_budget_bytes: int | None = DEFAULT_MEMORY_BUDGET,
    with_memory: bool = True,
    write_behind: bool = DEFAULT_WRITE_BEHIND,
) -> InspectableStore:
    """Open the store a ``--store`` value names.

    Args:
        spec: ``memory``, ``disk:PATH``, ``redis://...`` or a comma chain; None: default.
        memory_budget_bytes: budget of the in-process LRU tier.
        with_memory: put an in-process LRU in front of persistent tiers (inspection
            commands pass False: a fresh process's memory tier is empty).
        write_behind: a chain writes the tiers after its first one on a background thread
            (``blend.store.write_behind``); False writes every tier inline.

    Returns:
        A single tier, or a :class:`TieredStore` chain.
    """
    tiers = [_build(t, memory_budget_bytes) for t in parse_store_spec(spec)]
    if with_memory and not isinstance(tiers[0], MemoryStore):
        tiers.insert(0, MemoryStore(memory_budget_bytes))
    return tiers[0] if len(tiers) == 1 else TieredStore(tiers, write_behind=write_behind)


