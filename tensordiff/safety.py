"""Input and output safety shared by the CLI, the reports and the importers (stdlib only).

- :func:`sanitize_for_terminal` / :func:`sanitize_tree`: strings that came from a file, made safe
  to print: control characters (C0, DEL, C1), Unicode format characters (bidirectional overrides,
  zero-width marks) and line/paragraph separators are written as escapes (``\\x1b``, ``\\u202e``),
  so a crafted sequence key cannot erase or rewrite a line, set the clipboard (OSC 52) or reorder
  text. Text output only: the JSON output keeps the real values.
- :func:`check_output_path`: before any work, an output path must be a file in an existing,
  writable directory and must not be one of the command's inputs.
- :func:`read_regular_file_bounded`: read a small input (a calibration file) only when it is a
  regular file, and never more than a bound (FIFOs, devices, ``/dev/zero``: one line, exit 2).
- :func:`parse_json` / :func:`read_json_file`: the one reader of JSON a user hands us (configs,
  checkpoint headers, fingerprint and calibration files, trace attributes): bounded in size, in
  nesting depth (a header nested 100,000 deep is one line, not a ``RecursionError``) and in the
  digits of a number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
import unicodedata
from collections.abc import Iterable, Iterator
from enum import Enum
from typing import Any, TypeVar, cast

from .errors import SourceFileError, TensordiffError, UsageError

T = TypeVar("T")

_ESCAPED_CATEGORIES = {"Cc", "Cf", "Zl", "Zp"}


def _escape(ch: str) -> str:
    o = ord(ch)
    return f"\\x{o:02x}" if o <= 0xFF else (f"\\u{o:04x}" if o <= 0xFFFF else f"\\U{o:08x}")


def sanitize_for_terminal(s: str, keep: str = "") -> str:
    """``s`` with every control, format or separator character escaped (``keep``: characters left
    as they are, e.g. ``"\\n"`` for text whose line breaks are the program's own)."""
    if s.isprintable():  # nothing of those categories in it (the common case, checked in C)
        return s
    return "".join(_escape(c) if c not in keep and (unicodedata.category(c) in _ESCAPED_CATEGORIES) else c
                   for c in s)


def quoted(s: str, keep: int = 80) -> str:
    """``s`` quoted for one error line (``repr``: escapes included), at most ``keep`` characters of
    it: a value from a file, a flag or the environment may be of any length."""
    return repr(s) if len(s) <= keep else f"{s[:keep]!r}... ({len(s)} characters)"


def sanitize_tree(obj: Any) -> Any:
    """:func:`sanitize_for_terminal` applied to every string (and mapping key) of a plain value."""
    if isinstance(obj, str):
        return sanitize_for_terminal(obj)
    if isinstance(obj, dict):
        return {sanitize_tree(k): sanitize_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(sanitize_tree(v) for v in obj)
    return obj


def sanitize_record(obj: T) -> T:
    """:func:`sanitize_tree` for typed records: a dataclass comes back as a new one of its class
    with every string in it made safe to print (a newline from a file too: it must not start a
    line of its own); enums, numbers and ``None`` as they are. The record given is not changed."""
    if isinstance(obj, Enum):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: sanitize_record(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return cast(T, dataclasses.replace(obj, **changes))
    if isinstance(obj, str):
        return cast(T, sanitize_for_terminal(obj))
    if isinstance(obj, dict):
        return cast(T, {sanitize_record(k): sanitize_record(v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return cast(T, type(obj)(sanitize_record(v) for v in obj))
    return obj


def guard_console(console: Any) -> Any:
    """Install on a rich ``Console`` a render hook that escapes control characters in everything
    it renders (its own line breaks and styles excepted): no string from a file (a path, a label,
    a side's name, a sentence quoting them) reaches the terminal raw. Returns the console."""
    console.push_render_hook(_escaping_hook())
    return console


@contextlib.contextmanager
def guarded(console: Any) -> Iterator[Any]:
    """The console with :func:`guard_console`'s hook for the time of a ``with`` block, then as it was."""
    console.push_render_hook(_escaping_hook())
    try:
        yield console
    finally:
        console.pop_render_hook()


def _escaping_hook() -> Any:
    from rich.console import RenderHook
    from rich.segment import Segment

    class _Guarded:
        def __init__(self, renderable: Any):
            self.renderable = renderable

        def __rich_console__(self, console: Any, options: Any) -> Iterable[Any]:
            for seg in console.render(self.renderable, options):
                if seg.control or seg.text.isprintable() or seg.text == "\n":
                    yield seg
                else:
                    yield Segment(sanitize_for_terminal(seg.text, keep="\n"), seg.style, seg.control)

    class _Hook(RenderHook):
        def process_renderables(self, renderables: list[Any]) -> list[Any]:
            return [_Guarded(r) for r in renderables]

    return _Hook()


# -- output paths ------------------------------------------------------------------------------


def check_output_path(out: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str] | None],
                      what: str = "--out") -> str:
    """Refuse an output path before any work starts: its directory must exist and be writable, it
    must not be a directory, and it must not be (the same file as) one of ``inputs``. Returns it."""
    path = os.fspath(out)
    if not path:
        raise UsageError(f"{what}: an empty path")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"{what} {path}: the output directory {directory} does not exist")
    if os.path.isdir(path):
        raise UsageError(f"{what} {path}: is a directory; give a file name")
    for src in inputs:
        if src is None:
            continue
        s = os.fspath(src)
        if _same_file(path, s):
            raise UsageError(f"{what} {path} would overwrite an input of this command ({s}); choose another file")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise UsageError(f"{what} {path}: exists and is not writable")
    elif not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {path}: the directory {directory} is not writable")
    return path


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): compare where they would be
        return os.path.realpath(a) == os.path.realpath(b)


# -- small inputs ------------------------------------------------------------------------------

_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _open_regular(p: str, what: str) -> tuple[int, os.stat_result]:
    """A descriptor of ``p`` opened without blocking, and its stat, when it is a regular file;
    else :class:`~tensordiff.errors.SourceFileError` with one line."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise SourceFileError(f"{what}: no such file", p) from None
    except IsADirectoryError:
        raise SourceFileError(f"{what}: is a directory, not a file", p) from None
    except PermissionError:
        raise SourceFileError(f"{what}: permission denied", p) from None
    except OSError as e:
        raise SourceFileError(f"{what}: cannot read ({e.strerror or e})", p) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((k for test, k in _KINDS if test(st.st_mode)), "not a regular file")
            raise SourceFileError(f"{what}: is {kind}, not a regular file", p)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_regular_file_bounded(path: str | os.PathLike[str], limit: int, what: str = "file") -> bytes:
    """The bytes of ``path`` when it is a regular file of at most ``limit`` bytes; else
    :class:`~tensordiff.errors.SourceFileError` with one line. One descriptor, opened without
    blocking (a FIFO swapped in after the check cannot block the read either)."""
    p = os.fspath(path)
    fd, st = _open_regular(p, what)
    try:
        if st.st_size > limit:
            raise SourceFileError(f"{what}: {st.st_size} bytes, more than the {limit} this command reads", p)
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise SourceFileError(f"{what}: more than the {limit} bytes this command reads (it is still growing)", p)
        return b"".join(chunks)
    except OSError as e:
        raise SourceFileError(f"{what}: cannot read ({e.strerror or e})", p) from None
    finally:
        os.close(fd)


def read_regular_file_head(path: str | os.PathLike[str], n: int, what: str = "file") -> bytes:
    """The first ``n`` bytes (fewer in a shorter file) of ``path`` when it is a regular file, as
    :func:`read_regular_file_bounded` checks it: a file's magic, read before choosing its reader."""
    p = os.fspath(path)
    fd, _ = _open_regular(p, what)
    try:
        return os.read(fd, n)
    except OSError as e:
        raise SourceFileError(f"{what}: cannot read ({e.strerror or e})", p) from None
    finally:
        os.close(fd)


# -- JSON --------------------------------------------------------------------------------------

#: containers nested deeper than this are refused: the JSON tensordiff reads (model configs,
#: safetensors headers, fingerprint and calibration files, trace attributes) nests a few levels;
#: Python's reader and every walk over the value recurse once per level
MAX_JSON_DEPTH = 64
#: the JSON text of a model config (or another small file read whole)
MAX_CONFIG_BYTES = 16 << 20


def parse_json(raw: bytes | str, what: str, path: str | None = None, *,
               error: type[TensordiffError] = SourceFileError, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The value of the JSON text ``raw``, or ``error`` (one line naming ``what`` and ``path``):
    not UTF-8, not JSON, a number of more digits than Python converts, or containers nested
    deeper than ``max_depth``."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        doc = json.loads(text)
    except RecursionError:
        raise error(f"{what} is JSON nested deeper than {max_depth} levels", path) from None
    except UnicodeDecodeError:
        raise error(f"{what} is not UTF-8 text", path) from None
    except ValueError as e:   # json.JSONDecodeError, or an integer of too many digits
        raise error(f"{what} is not valid JSON ({str(e).splitlines()[0][:200]})", path) from None
    if json_depth(doc, max_depth) > max_depth:
        raise error(f"{what} is JSON nested deeper than {max_depth} levels", path)
    return doc


def json_depth(doc: Any, stop: int) -> int:
    """How deep ``doc``'s containers nest (a scalar: 0), counted without recursion; stops counting
    past ``stop``."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if d > stop:
                return d
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def read_json_file(path: str | os.PathLike[str], what: str, limit: int = MAX_CONFIG_BYTES, *,
                   error: type[TensordiffError] = SourceFileError) -> Any:
    """:func:`read_regular_file_bounded` then :func:`parse_json`: a JSON file a user hands us."""
    raw = read_regular_file_bounded(path, limit, what)
    return parse_json(raw, what, os.fspath(path), error=error)
