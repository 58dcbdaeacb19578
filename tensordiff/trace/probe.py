"""Opening untrusted files: a guard against the HDF5 library itself.

Some damage is beyond validation: a zeroed object header in a global heap sends HDF5's string
read into an endless loop in C, where no Python timeout or handler can act. :func:`probe` opens
and validates each trace in a forked child first; the caller meets only its verdict.
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Sequence

from .. import errors
from ..errors import TensordiffError, TraceFileError
from .reader import TraceReader

PROBE_SECONDS = 60.0  # plus the time to read the whole file at 200 MB/s; TENSORDIFF_OPEN_TIMEOUT overrides


def probe(paths: Sequence[str | os.PathLike[str]], timeout: float | None = None) -> None:
    """Open and validate each trace in a forked child process first, and raise
    :class:`~tensordiff.errors.TraceFileError` if that child crashes or does not finish in time.

    Some damaged files make the HDF5 library loop forever or crash (a corrupted global heap sends
    a variable-length string read into an endless loop, for one), deep in C code where no Python
    timeout or exception handler can reach. The child meets such a file instead of the caller;
    the CLI runs this before it opens its inputs (``info``, ``diff``, ``tui``, ``calibrate``). It
    costs one extra open per trace. Without ``os.fork`` (or with TENSORDIFF_NO_PROBE=1) it does
    nothing."""
    if not hasattr(os, "fork") or os.environ.get("TENSORDIFF_NO_PROBE"):
        return
    names = [os.fspath(p) for p in paths]
    if timeout is None:
        env = os.environ.get("TENSORDIFF_OPEN_TIMEOUT")
        if env:
            timeout = float(env)
        else:
            size = sum(os.path.getsize(p) for p in names if os.path.isfile(p))
            timeout = PROBE_SECONDS + size / 200e6
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns
        _child(names, rfd, wfd)
    os.close(wfd)
    buf = b""
    deadline = time.monotonic() + timeout
    status = None
    try:
        while True:
            done, st = os.waitpid(pid, os.WNOHANG)
            buf += _drain_fd(rfd)
            if done:
                status = st
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                break
            time.sleep(0.002 if time.monotonic() - deadline + timeout < 0.2 else 0.02)
        buf += _drain_fd(rfd)
    finally:
        os.close(rfd)
    lines = buf.decode("utf-8", "replace").splitlines()
    last = next((x[1:] for x in reversed(lines) if x.startswith("P")), names[0] if names else "")
    err = next((x[1:] for x in lines if x.startswith("E")), None)
    if status is None:
        raise TraceFileError(f"reading the file's structure did not finish in {timeout:.0f} s: the file is damaged "
                             "(the HDF5 library loops on some damaged structures)", last)
    if os.WIFSIGNALED(status):
        raise TraceFileError(f"the HDF5 library crashed reading this file (signal {os.WTERMSIG(status)}): "
                             "the file is damaged", last)
    code = os.WEXITSTATUS(status)
    if code == 2 and err:
        name, _, msg = err.partition("\t")
        cls = getattr(errors, name, None)
        if not (isinstance(cls, type) and issubclass(cls, TensordiffError)):
            cls = TraceFileError
        raise cls(msg)  # the message names the file already


def _child(paths: list[str], rfd: int, wfd: int) -> None:
    """The forked child: open each trace, report progress and the first error on ``wfd``, exit."""
    code = 3
    try:
        os.close(rfd)
        code = 0
        for p in paths:
            os.write(wfd, b"P" + p.encode("utf-8", "surrogateescape").replace(b"\n", b" ") + b"\n")
            try:
                with TraceReader(p) as r:
                    r.touch()
            except TensordiffError as e:
                msg = type(e).__name__ + "\t" + " ".join(str(e).split())
                os.write(wfd, b"E" + msg.encode("utf-8", "replace")[:4000] + b"\n")
                code = 2
                break
    except BaseException:  # noqa: BLE001 - the caller's own open will meet and report it
        code = 3
    finally:
        os._exit(code)


def _drain_fd(fd: int) -> bytes:
    out = b""
    while select.select([fd], [], [], 0)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
    return out
