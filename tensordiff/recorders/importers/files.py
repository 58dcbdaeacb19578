"""Reading the files an import is given, safely: regular files only (a FIFO cannot hang the
import), the header checked before anything is loaded or decompressed, ``torch.load`` with
``weights_only=True`` only (never arbitrary pickled objects), a gzip decompressed to a temporary
file under a ratio cap (no bombs), ``safetensors`` loaded as tensors only; directories expanded
without following symbolic links out of them. Every failure is one line
(:class:`~tensordiff.errors.SourceFileError`).
"""

from __future__ import annotations

import fnmatch
import gzip
import os
import pickle
import re
import stat
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Sequence

import torch

from ...errors import SourceFileError

_SHORT = 200

#: a .gz may decompress to at most this many times its size (plus 64 MiB): hidden states compress
#: less than 2x, so more is a bomb (2 MB of gzip holding 2 GiB of zeros)
GZ_MAX_RATIO = 64
GZ_SLACK = 64 << 20


def short(e: BaseException) -> str:
    """The first line of an exception's message, without terminal colours, at most 200 characters."""
    s = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().splitlines()
    s = s[0] if s else type(e).__name__
    return s[:_SHORT]


def natural_key(p: Path | str) -> list:
    """Sort key putting data_2 before data_10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p))]


def _looks_like_torch(head: bytes) -> bool:
    # torch.save writes a zip archive (PK..) or, in the legacy format, a pickle (protocol 2+: 0x80)
    return head[:2] == b"PK" or head[:1] == b"\x80"


def _open_regular(path: str) -> int:
    """A descriptor of ``path`` after checking it is a regular file (opened without blocking, so a
    FIFO named like a dump cannot hang the import)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, device or socket)"
        raise SourceFileError(f"is {kind}, not a torch file", path)
    return fd


def _gunzip_bounded(fh: Any, path: str, size: int) -> Any:
    """The decompressed stream of a gzip file, checked to start like a torch file before anything
    else is decompressed, then spooled to a temporary file (never all in memory) up to a cap."""
    limit = size * GZ_MAX_RATIO + GZ_SLACK
    with gzip.GzipFile(fileobj=fh, mode="rb") as gz:
        head = gz.read(2)
        if not _looks_like_torch(head):
            raise SourceFileError("not a torch checkpoint (neither torch.save's zip format nor a pickle, gzipped)", path)
        out = tempfile.TemporaryFile()
        try:
            out.write(head)
            total = len(head)
            while True:
                chunk = gz.read(1 << 20)
                if not chunk:
                    break
                total += len(chunk)
                if total > limit:
                    raise SourceFileError(f"decompresses to more than {limit >> 20} MiB ({GZ_MAX_RATIO}x its size): "
                                          "not hidden states (a gzip bomb?)", path)
                out.write(chunk)
            out.seek(0)
            return out
        except BaseException:
            out.close()
            raise


def load_torch_file(path: str | os.PathLike) -> Any:
    """``torch.load(weights_only=True)`` of a ``.pt``/``.ckpt`` file, or a gzip of one (``.gz``).
    Anything else, or a file holding objects other than tensors and plain containers, raises
    :class:`~tensordiff.errors.SourceFileError` with one line. The header is checked before
    anything is loaded or decompressed; a gzip is decompressed to a temporary file, bounded."""
    path = os.fspath(path)
    data: Any = None
    try:
        fd = _open_regular(path)
        with os.fdopen(fd, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if path.endswith(".gz"):
                data = _gunzip_bounded(fh, path, size)
            else:
                if not _looks_like_torch(fh.read(2)):
                    raise SourceFileError("not a torch checkpoint (neither torch.save's zip format nor a pickle)", path)
                fh.seek(0)
                return torch.load(fh, map_location="cpu", weights_only=True)
        return torch.load(data, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise SourceFileError("no such file", path) from None
    except IsADirectoryError:
        raise SourceFileError("is a directory, not a torch file", path) from None
    except PermissionError:
        raise SourceFileError("permission denied", path) from None
    except pickle.UnpicklingError as e:
        m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        what = f"it holds a {m.group(1)}" if m else short(e)
        raise SourceFileError(f"refused to load under torch.load(weights_only=True): {what}; only tensors and plain "
                              "containers are read, never arbitrary pickled objects", path) from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError, TypeError, AttributeError,
            KeyError, IndexError, UnicodeDecodeError, MemoryError, gzip.BadGzipFile) as e:
        raise SourceFileError(f"cannot load as a torch file, truncated or damaged ({short(e)})", path) from None
    finally:
        if data is not None:
            data.close()


def load_safetensors_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file`` (tensors only, never code); anything else raises
    :class:`SourceFileError` with one line."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
        if len(head) < 8 or int.from_bytes(head, "little") > os.path.getsize(path):
            raise SourceFileError("not a safetensors file (no header)", path)
        return load_file(path, device="cpu")
    except FileNotFoundError:
        raise SourceFileError("no such file", path) from None
    except IsADirectoryError:
        raise SourceFileError("is a directory, not a safetensors file", path) from None
    except PermissionError:
        raise SourceFileError("permission denied", path) from None
    except (SafetensorError, OSError, ValueError, RuntimeError, MemoryError) as e:
        raise SourceFileError(f"cannot load as a safetensors file, truncated or damaged ({short(e)})", path) from None


def inside(q: Path, root: Path, skipped: dict[str, str] | None) -> bool:
    """Whether ``q`` (found under the directory ``root``) really lies inside it: a symbolic link
    pointing out of the directory is not followed (noted in ``skipped``)."""
    try:
        q.resolve().relative_to(root.resolve())
        return True
    except (ValueError, OSError, RuntimeError):
        if skipped is not None:
            skipped[q.name] = "a symbolic link out of the directory, not followed"
        return False


def expand(sources: Sequence[str | os.PathLike], patterns: Sequence[str],
           skipped: dict[str, str] | None = None) -> list[Path]:
    """The files of ``sources``: a directory gives its files matching ``patterns`` (recursively,
    in natural order, none outside it), a file itself."""
    files: list[Path] = []
    for s in sources:
        p = Path(s)
        if p.is_dir():
            found = [q for q in p.rglob("*") if q.is_file() and any(fnmatch.fnmatch(q.name, pat) for pat in patterns)
                     and inside(q, p, skipped)]
            if not found:
                raise SourceFileError(f"no {' or '.join(patterns)} files in this directory", str(p))
            files.extend(sorted(found, key=natural_key))
        elif p.exists():
            files.append(p)
        else:
            raise SourceFileError("no such file or directory", str(p))
    return files
