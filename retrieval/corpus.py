"""Corpus readers: .txt, .md and .jsonl files into documents.

Bad input never stops a corpus: every problem becomes a :class:`CorpusIssue`
that names the file (and the line, where there is one) and the rest is read.
Only regular files are read (a FIFO, device or socket is an issue, never
waited on), and none larger than ``MAX_FILE_BYTES`` (checked before reading).
Text is decoded as UTF-8 (a BOM is dropped) and line endings are normalized to
``\\n``; chunk offsets refer to that normalized text.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Iterable

from blend import safeio

try:  # the engine's user-error base, when present
    from blend.errors import KVBlendError as _UserError
except Exception:  # pragma: no cover - engine not written yet
    _UserError = Exception

SUPPORTED_SUFFIXES: tuple[str, ...] = (".txt", ".md", ".jsonl")
MAX_FILE_BYTES = 1 << 30  # a corpus file is read whole: larger ones are refused (split them)
_BINARY_SNIFF_BYTES = 8192


class RetrievalError(_UserError):  # type: ignore[misc,valid-type]
    """A user-caused retrieval failure with a one-line message."""


class IssueKind(Enum):
    """Why (part of) a file was not ingested."""

    MISSING = "missing path"
    UNSUPPORTED = "unsupported file type"
    EMPTY = "empty"
    BINARY = "binary"
    NOT_UTF8 = "not UTF-8"
    BAD_JSON = "invalid JSON"
    NO_TEXT = "no text field"
    UNREADABLE = "unreadable"
    NOT_REGULAR = "not a regular file"
    TOO_LARGE = "too large"


@dataclass(frozen=True)
class CorpusIssue:
    """One problem with the input, named by file and (where known) line.

    Attributes:
        path: the file (or path argument) concerned.
        line: 1-based line number, or None when the whole file is concerned.
        kind: the category of problem.
        message: a human-readable explanation.
    """

    path: str
    line: int | None
    kind: IssueKind
    message: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line is not None else self.path
        return f"{where}: {self.kind.value}: {self.message}"


class CorpusError(RetrievalError):
    """Raised by the strict readers; carries the :class:`CorpusIssue`."""

    def __init__(self, issue: CorpusIssue) -> None:
        super().__init__(str(issue))
        self.issue = issue


@dataclass(frozen=True)
class Document:
    """One document of a file.

    Attributes:
        source: absolute path of the file it came from.
        line: 1-based JSONL line, or None for a whole .txt/.md file.
        text: the document text (UTF-8 decoded, ``\\n`` line endings).
    """

    source: str
    line: int | None
    text: str

    @property
    def ref(self) -> str:
        """``path`` or ``path:line`` for JSONL documents."""
        return f"{self.source}:{self.line}" if self.line is not None else self.source


@dataclass(frozen=True)
class FileRead:
    """The result of reading one file.

    Attributes:
        path: absolute path.
        sha256: hex digest of the raw bytes ("" if unreadable).
        documents: documents read (possibly empty).
        issues: problems found; a file with documents may still have issues (JSONL).
    """

    path: str
    sha256: str
    documents: tuple[Document, ...]
    issues: tuple[CorpusIssue, ...]


def expand_paths(paths: Iterable[str | os.PathLike[str]], skip: Iterable[str | os.PathLike[str]] = ()
                 ) -> tuple[list[str], list[CorpusIssue]]:
    """Turn path arguments into a sorted, de-duplicated list of files.

    Directories are walked recursively for supported suffixes (hidden entries
    skipped); a file named explicitly with another suffix is an issue, and so is
    anything that is not a regular file (a FIFO, device or socket: never opened)
    and a directory holding no supported file.

    Args:
        paths: files and/or directories.
        skip: folders a directory walk never enters (the index being written: its generations hold
            JSONL files a corpus walk would read back in as documents).

    Returns:
        (absolute file paths, issues for missing, unsupported or irregular arguments).
    """
    skipped = {os.path.realpath(d) for d in skip}
    files: list[str] = []
    issues: list[CorpusIssue] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if not p.exists():
            issues.append(CorpusIssue(str(raw), None, IssueKind.MISSING, "no such file or directory"))
        elif p.is_dir():
            before = len(files)
            for root, dirs, names in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".")
                                 and os.path.realpath(os.path.join(root, d)) not in skipped)
                for name in sorted(names):
                    if not name.startswith(".") and Path(name).suffix.lower() in SUPPORTED_SUFFIXES:
                        _add_regular(Path(root, name), files, issues)
            if len(files) == before and not any(i.path.startswith(str(p.resolve())) for i in issues):
                issues.append(CorpusIssue(str(p.resolve()), None, IssueKind.EMPTY,
                                          f"no {', '.join(SUPPORTED_SUFFIXES[:-1])} or {SUPPORTED_SUFFIXES[-1]} files "
                                          "in this directory"))
        elif p.suffix.lower() not in SUPPORTED_SUFFIXES:
            issues.append(
                CorpusIssue(str(p.resolve()), None, IssueKind.UNSUPPORTED, f"expected one of {', '.join(SUPPORTED_SUFFIXES)}")
            )
        else:
            _add_regular(p, files, issues)
    seen: set[str] = set()
    unique = [f for f in files if not (f in seen or seen.add(f))]
    return unique, issues


def _add_regular(p: Path, files: list[str], issues: list[CorpusIssue]) -> None:
    """Append ``p`` to ``files`` if it is (or links to) a regular file, else record an issue."""
    try:
        mode = os.stat(p).st_mode
    except OSError as e:
        issues.append(CorpusIssue(str(p), None, IssueKind.UNREADABLE, e.strerror or str(e)))
        return
    if stat.S_ISREG(mode):
        # under its own name (its folder resolved): a symlinked file indexed under its target's path never
        # left the index when the link was removed (the target lies outside the folder walked)
        files.append(str(p.absolute().parent.resolve() / p.name))
    else:
        issues.append(CorpusIssue(str(p.resolve()), None, IssueKind.NOT_REGULAR,
                                  f"{safeio.file_kind(mode)}, not a regular file"))


def _normalize(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def read_file(path: str | os.PathLike[str]) -> FileRead:
    """Read one .txt, .md or .jsonl file into documents, collecting issues.

    Args:
        path: the file.

    Returns:
        A :class:`FileRead`; never raises for bad content.
    """
    p = str(Path(path).expanduser().resolve())
    try:
        data = safeio.read_regular(p, MAX_FILE_BYTES)
    except FileNotFoundError:
        return FileRead(p, "", (), (CorpusIssue(p, None, IssueKind.MISSING, "no such file"),))
    except safeio.UnsafeFileError as e:
        kind = IssueKind.TOO_LARGE if isinstance(e, safeio.FileTooLargeError) else IssueKind.NOT_REGULAR
        return FileRead(p, "", (), (CorpusIssue(p, None, kind, str(e)),))
    except OSError as e:
        return FileRead(p, "", (), (CorpusIssue(p, None, IssueKind.UNREADABLE, e.strerror or str(e)),))
    digest = hashlib.sha256(data).hexdigest()
    if not data.strip():
        return FileRead(p, digest, (), (CorpusIssue(p, None, IssueKind.EMPTY, "file has no text"),))
    nul = data.find(b"\x00", 0, _BINARY_SNIFF_BYTES)
    if nul >= 0:
        msg = f"NUL byte at offset {nul}; not a text file"
        return FileRead(p, digest, (), (CorpusIssue(p, _line_of(data, nul), IssueKind.BINARY, msg),))
    if p.lower().endswith(".jsonl"):
        docs, issues = _read_jsonl(p, data)
        return FileRead(p, digest, tuple(docs), tuple(issues))
    try:
        text = _normalize(data.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        msg = f"invalid UTF-8 byte 0x{data[e.start]:02x} at offset {e.start}"
        return FileRead(p, digest, (), (CorpusIssue(p, _line_of(data, e.start), IssueKind.NOT_UTF8, msg),))
    if not text.strip():  # a BOM, or Unicode whitespace only
        return FileRead(p, digest, (), (CorpusIssue(p, None, IssueKind.EMPTY, "file has no text"),))
    return FileRead(p, digest, (Document(p, None, text),), ())


def _read_jsonl(path: str, data: bytes) -> tuple[list[Document], list[CorpusIssue]]:
    docs: list[Document] = []
    issues: list[CorpusIssue] = []
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            msg = f"invalid UTF-8 byte 0x{raw[e.start]:02x} at column {e.start + 1}"
            issues.append(CorpusIssue(path, lineno, IssueKind.NOT_UTF8, msg))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            issues.append(CorpusIssue(path, lineno, IssueKind.BAD_JSON, e.msg))
            continue
        except (ValueError, RecursionError) as e:  # an integer too long to convert; nesting too deep
            issues.append(CorpusIssue(path, lineno, IssueKind.BAD_JSON, f"{type(e).__name__}: {str(e)[:80]}"))
            continue
        text = obj.get("text") if isinstance(obj, dict) else None
        if not isinstance(text, str):
            what = "missing" if not isinstance(obj, dict) or "text" not in obj else f"not a string ({type(text).__name__})"
            issues.append(CorpusIssue(path, lineno, IssueKind.NO_TEXT, f"`text` field {what}"))
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate escape ("\ud800"): no UTF-8 text has it
            msg = f"`text` field holds the unpaired surrogate U+{ord(text[e.start]):04X} at character {e.start}"
            issues.append(CorpusIssue(path, lineno, IssueKind.NOT_UTF8, msg))
            continue
        if not text.strip():
            issues.append(CorpusIssue(path, lineno, IssueKind.EMPTY, "`text` field is empty"))
            continue
        docs.append(Document(path, lineno, _normalize(text)))
    if not docs and not issues:
        issues.append(CorpusIssue(path, None, IssueKind.EMPTY, "no documents"))
    return docs, issues
