"""``kvblend store stats|ls|verify|clear|prune``: inspect and repair a store.

The main CLI (blend/cli.py) calls :func:`add_store_command` on its
subparsers, which dispatches to :func:`run_store_command`. Commands act on the persistent tiers the spec names
(no in-process memory tier in front: a fresh process's memory tier is empty).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, TextIO

from blend import json_text
from blend.exit_codes import ExitCode
from blend.keys import Namespace, key_hex
from blend.store.base import EntryState, InspectableStore, store_tiers
from blend.store.codec import EntryError
from blend.store.disk import DiskStore
from blend.options import add_store_argument
from blend.store.spec import StoreSpecError, open_store, parse_size
from blend.terminal_text import shown


class StoreCommand(Enum):
    STATS = "stats"
    LS = "ls"
    VERIFY = "verify"
    CLEAR = "clear"
    PRUNE = "prune"


EXIT_UNREACHABLE = ExitCode.UNREACHABLE  # a tier could not be read: the check is incomplete


@dataclass(frozen=True)
class VerifyResult:
    namespace: str
    key: str  # hex
    ok: bool
    reason: str = ""


def add_store_commands(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``store`` with its sub-commands on an argparse subparsers object.

    Args:
        subparsers: the result of ``parser.add_subparsers(dest="command")``.

    Returns:
        The ``store`` parser.
    """
    p = subparsers.add_parser("store", help="inspect, verify or clear the KV store")
    sub = p.add_subparsers(dest="store_command", required=True)
    for cmd, text in [
        (StoreCommand.STATS, "entries, bytes and counters per tier"),
        (StoreCommand.LS, "list entries with their shapes, dtypes and provenance"),
        (StoreCommand.VERIFY, "decode every entry and report corrupt ones"),
        (StoreCommand.CLEAR, "delete entries"),
        (StoreCommand.PRUNE, "shrink disk tiers to a byte budget, least recently used entries first"),
    ]:
        c = sub.add_parser(cmd.value, help=text)
        add_store_argument(c)
        c.add_argument("--json", action="store_true", help="machine-readable output")
        if cmd in (StoreCommand.LS, StoreCommand.VERIFY, StoreCommand.CLEAR):
            c.add_argument("--namespace", choices=[n.value for n in Namespace], default=None)
        if cmd is StoreCommand.VERIFY:
            c.add_argument("--delete", action="store_true", help="remove corrupt entries")
        if cmd is StoreCommand.PRUNE:
            c.add_argument("--max-bytes", required=True, type=_size, metavar="SIZE",
                           help="bytes to keep per disk tier, e.g. 500M or 20G")
    return p


def add_store_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``store`` (see :func:`add_store_commands`) with :func:`run_store_command` as its action.

    Args:
        subparsers: the result of ``parser.add_subparsers(dest="command")``.

    Returns:
        The ``store`` parser.
    """
    p = add_store_commands(subparsers)
    p.set_defaults(func=run_store_command)
    return p


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except StoreSpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _namespaces(args: argparse.Namespace) -> list[Namespace]:
    ns = getattr(args, "namespace", None)
    return [Namespace(ns)] if ns else list(Namespace)


def _down_tiers(tiers: list, what: str) -> list:
    """Say on stderr which of ``tiers`` could not be reached (so ``what`` left them out).

    Returns:
        The tiers that are down.
    """
    down = []
    for t in tiers:
        if why := t.check_reachable():
            print(f"kvblend store: tier {t.name} unreachable ({why}); {what}", file=sys.stderr)
            down.append(t)
    return down


def _unreachable(store: InspectableStore, what: str) -> int:
    """:func:`_down_tiers` over every tier of ``store``.

    Returns:
        ``EXIT_UNREACHABLE`` if any tier is down, else 0.
    """
    return EXIT_UNREACHABLE if _down_tiers(store_tiers(store), what) else 0


def _stats(store: InspectableStore, as_json: bool, out: TextIO) -> int:
    status = _unreachable(store, "its figures are not real")
    rows = [(t.name, t.stats()) for t in store_tiers(store)]
    if as_json:
        out.write(json_text.dumps({name: asdict(s) for name, s in rows}, indent=1))
        out.write("\n")
        return status
    out.write(f"{'tier':<8} {'entries':>8} {'MiB':>10} {'hits':>6} {'misses':>6} {'rejected':>8}  extra\n")
    for name, s in rows:
        extra = " ".join(f"{k}={v:g}" for k, v in sorted(s.extra.items()))
        out.write(f"{name:<8} {s.entries:>8} {s.bytes / 2**20:>10.1f} {s.hits:>6} {s.misses:>6} {s.rejected:>8}  {extra}\n")
    return status


def _model_of(provenance: str) -> str:
    """The ``model_arch`` a stored provenance names ('?' if it names none)."""
    try:
        prov = json.loads(provenance)
    except (ValueError, RecursionError):
        return "?"
    arch = prov.get("model_arch") if isinstance(prov, dict) else None
    if not isinstance(arch, str):
        return "?"
    return shown(arch)  # stored bytes, shown on a terminal: escape sequences and lone surrogates escaped


def _ls(store: InspectableStore, args: argparse.Namespace, out: TextIO) -> int:
    status = _unreachable(store, "its entries are not listed")
    rows: list[dict[str, Any]] = []
    for tier in store_tiers(store):
        for ns in _namespaces(args):
            for key in tier.keys(ns):
                row: dict[str, Any] = {"tier": tier.name, "namespace": ns.value, "key": key_hex(key)}
                try:
                    info = tier.info(ns, key)
                except EntryError as e:
                    row["error"] = str(e)
                else:
                    if info is None:
                        continue  # deleted or expired meanwhile
                    row.update(shape=list(info.shape), dtype=info.dtype, bytes=info.stored_bytes,
                               model=_model_of(info.provenance))
                rows.append(row)
    if args.json:
        out.write(json_text.dumps(rows, indent=1))
        out.write("\n")
        return status
    for r in rows:
        if "error" in r:
            out.write(f"{r['tier']:<6} {r['namespace']:<9} {r['key'][:16]}  UNREADABLE: {r['error']}\n")
        else:
            L, H, T, D = r["shape"]
            out.write(f"{r['tier']:<6} {r['namespace']:<9} {r['key'][:16]}  L={L} Hkv={H} T={T} D={D} "
                      f"{r['dtype']:<8} {r['bytes'] / 2**20:8.2f} MiB  {r['model']}\n")
    out.write(f"{len(rows)} entries\n")
    return status


def _verify(store: InspectableStore, args: argparse.Namespace, out: TextIO) -> int:
    """Decode every entry of every tier; a tier that cannot be reached (before or
    during its scan) is reported and makes the exit status 3, never "clean"."""
    results: list[tuple[str, VerifyResult]] = []
    unreachable: list[tuple[str, str]] = []  # (tier, why)
    undeleted: list[str] = []  # keys --delete could not remove
    for tier in store_tiers(store):
        why_down = tier.check_reachable()
        if why_down:
            unreachable.append((tier.name, why_down))
            continue
        for ns in _namespaces(args):
            for key in list(tier.keys(ns)):
                verdict = tier.verify(ns, key)
                if verdict.state is EntryState.ABSENT:
                    continue
                results.append((tier.name, VerifyResult(ns.value, key_hex(key), not verdict.invalid, verdict.reason)))
                if verdict.invalid and args.delete and not tier.delete(ns, key):
                    undeleted.append(key_hex(key))
        if isinstance(tier, DiskStore) and args.delete:
            tier.sweep_temp()
        why_down = tier.check_reachable()  # failed mid-scan: entries may have been skipped as absent
        if why_down:
            unreachable.append((tier.name, why_down))
    bad = [(t, r) for t, r in results if not r.ok]
    if args.json:
        out.write(json_text.dumps({"checked": len(results), "corrupt": [{"tier": t, **asdict(r)} for t, r in bad],
                                   "deleted": bool(args.delete), "unreachable": [t for t, _ in unreachable],
                                   **({"undeleted": undeleted} if undeleted else {})}, indent=1))
        out.write("\n")
    else:
        for t, r in bad:
            out.write(f"CORRUPT {t:<6} {r.namespace:<9} {r.key[:16]}  {r.reason}\n")
        for k in undeleted:
            out.write(f"NOT DELETED {k[:16]} (see the warning above)\n")
        for t, why in unreachable:
            out.write(f"UNREACHABLE {t}: {why}\n")
        verb = "deleted" if args.delete else "found"
        n_deleted = len(bad) - len(undeleted) if args.delete else len(bad)
        tail = f"; {len(unreachable)} tier(s) unreachable, not checked" if unreachable else ""
        out.write(f"checked {len(results)} entries, {verb} {n_deleted} corrupt{tail}\n")
    if unreachable:
        return EXIT_UNREACHABLE
    return ExitCode.FAILED if bad and (not args.delete or undeleted) else ExitCode.OK


def _clear(store: InspectableStore, args: argparse.Namespace, out: TextIO) -> int:
    status = _unreachable(store, "its entries are not deleted")
    ns = getattr(args, "namespace", None)
    n = store.clear(Namespace(ns) if ns else None)
    if args.json:
        out.write(json_text.dumps({"deleted": n}))
        out.write("\n")
    else:
        out.write(f"deleted {n} entries\n")
    return status


def _prune(store: InspectableStore, args: argparse.Namespace, out: TextIO) -> int:
    disks = [t for t in store_tiers(store) if isinstance(t, DiskStore)]
    if not disks:
        print("kvblend store prune: the store has no disk tier (Redis expires entries with ?ttl=)", file=sys.stderr)
        return ExitCode.USER_ERROR
    down = _down_tiers(disks, "it is not pruned")
    rows = [(str(t.root), t.prune(args.max_bytes)) for t in disks if not any(t is d for d in down)]
    status = EXIT_UNREACHABLE if down else 0
    if args.json:
        out.write(json_text.dumps([{"root": root, **asdict(r)} for root, r in rows], indent=1))
        out.write("\n")
    else:
        for root, r in rows:
            out.write(f"{root}: removed {r.removed} entries ({r.freed_bytes / 2**20:.1f} MiB), "
                      f"kept {r.kept_bytes / 2**20:.1f} MiB\n")
    return status


def run_store_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run a parsed ``kvblend store ...`` command.

    Args:
        args: parsed arguments (``store_command``, ``store``, ``json``, ...).
        out: where to write (default stdout).

    Returns:
        The process exit status: 0 ok, 1 corrupt entries found (or left undeleted), 2 bad store
        spec (or no disk tier to prune), 3 a tier could not be reached (``verify`` reports nothing
        clean; ``ls``, ``stats``, ``clear`` and ``prune`` name the tier on stderr and cover only the others).
    """
    out = out or sys.stdout
    try:
        store = open_store(args.store, with_memory=False)
    except StoreSpecError as e:
        print(f"kvblend store: {e}", file=sys.stderr)
        return ExitCode.USER_ERROR
    cmd = StoreCommand(args.store_command)
    if cmd is StoreCommand.STATS:
        return _stats(store, args.json, out)
    if cmd is StoreCommand.LS:
        return _ls(store, args, out)
    if cmd is StoreCommand.VERIFY:
        missing = [str(t.root) for t in store_tiers(store) if isinstance(t, DiskStore) and not os.path.lexists(t.root)]
        if missing:  # a mistyped path is not a clean store
            print(f"kvblend store: no disk store at {', '.join(missing)} (nothing to verify)", file=sys.stderr)
            return ExitCode.USER_ERROR
        return _verify(store, args, out)
    if cmd is StoreCommand.PRUNE:
        return _prune(store, args, out)
    return _clear(store, args, out)


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (``python -m blend.store.cli stats``) until blend/cli.py wires it.

    Args:
        argv: the arguments after the program's name; None: ``sys.argv[1:]``.

    Returns:
        The exit status of :func:`run_store_command` (a usage error exits with status 2, argparse's).
    """
    parser = argparse.ArgumentParser(prog="kvblend")
    add_store_commands(parser.add_subparsers(dest="command", required=True))
    return run_store_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
