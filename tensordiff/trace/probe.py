"""Opening untrusted files: a guard against the HDF5 library itself.

Some damage is beyond validation: a zeroed object header in a global heap sends HDF5's string
read into an endless loop in C, where no Python timeout or handler can act. :func:`probe` opens
and validates each trace in a forked child first; the caller meets only its verdict.

The child reports as it goes (one line each: the file it starts, its tensor count, a tick per
tensor read, the identity of the file it read, the first error), so the parent tells apart

- a file on which the library is stuck: no report for ``TENSORDIFF_OPEN_TIMEOUT`` seconds
  (default 60) -> "damaged";
- a valid file that is merely big: reports keep coming, but the whole open takes longer than its
  allowance, which grows with the file's structure (:func:`allowance`) -> "too slow to open";

and each file gets its own clock, so the error names the file that was being read. The identity
(device, inode, size, modification time) of each file the child checked is remembered in
:data:`~tensordiff.trace.validate.CHECKED`; a later :class:`~tensordiff.trace.TraceReader` of the
same path in this process refuses a file that is not that one (swapped in by a rename, or
modified since).
"""

from __future__ import annotations

import math
import os
import select
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .. import errors
from ..errors import TensordiffError, TraceFileError, UsageError
from .reader import TraceReader
from .validate import CHECKED, FileIdentity

PROBE_SECONDS = 60.0        # no report for this long: the HDF5 library is stuck (TENSORDIFF_OPEN_TIMEOUT)
MIN_TIMEOUT, MAX_TIMEOUT = 1.0, 86400.0
PER_TENSOR_SECONDS = 0.05   # allowance per tensor, on top of the stall timeout (measured ~3 ms each)
READ_BYTES_PER_SECOND = 200e6
TICK_SECONDS = 0.2          # the child reports at most this often


def open_timeout(env: dict[str, str] | None = None) -> float:
    """The stall timeout: ``TENSORDIFF_OPEN_TIMEOUT`` seconds if set (a number in 1..86400; anything
    else is a usage error, so no value can switch the guard off), else 60."""
    raw = (os.environ if env is None else env).get("TENSORDIFF_OPEN_TIMEOUT", "").strip()
    if not raw:
        return PROBE_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and MIN_TIMEOUT <= value <= MAX_TIMEOUT):
        raise UsageError(f"TENSORDIFF_OPEN_TIMEOUT={raw[:40]!r}: expected a number of seconds from "
                         f"{MIN_TIMEOUT:g} to {MAX_TIMEOUT:g}")
    return value


def probe_disabled(env: dict[str, str] | None = None) -> bool:
    """``TENSORDIFF_NO_PROBE=1`` skips the child (for platforms or debuggers where forking is a
    problem); only 1/0 (true/false, yes/no) are accepted."""
    raw = (os.environ if env is None else env).get("TENSORDIFF_NO_PROBE", "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise UsageError(f"TENSORDIFF_NO_PROBE={raw[:40]!r}: expected 1 or 0")


def allowance(stall: float, size: int, tensors: int) -> float:
    """How long opening one file may take in all, while it keeps making progress."""
    return stall + tensors * PER_TENSOR_SECONDS + size / READ_BYTES_PER_SECOND


@dataclass
class _FileState:
    path: str
    started: float
    last_report: float
    size: int
    tensors: int = 0
    done: int = 0


def probe(paths: Sequence[str | os.PathLike[str]], timeout: float | None = None) -> None:
    """Open and validate each trace in a forked child process first, and raise
    :class:`~tensordiff.errors.TraceFileError` if that child crashes, gets stuck (no progress for
    ``timeout`` seconds: TENSORDIFF_OPEN_TIMEOUT, default 60) or needs more than the file's
    allowance; any error the child meets is raised as the same class here.

    Some damaged files make the HDF5 library loop forever or crash (a corrupted global heap sends
    a variable-length string read into an endless loop, for one), deep in C code where no Python
    timeout or exception handler can reach. The child meets such a file instead of the caller;
    the CLI runs this before it opens its inputs (``info``, ``diff``, ``tui``, ``calibrate``). It
    costs one extra open per trace. Without ``os.fork`` (or with TENSORDIFF_NO_PROBE=1) it does
    nothing."""
    stall = open_timeout() if timeout is None else float(timeout)
    if not hasattr(os, "fork") or probe_disabled():
        return
    names = [os.fspath(p) for p in paths]
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns
        _child(names, rfd, wfd)
    os.close(wfd)
    try:
        status, state, lines = _watch(pid, rfd, stall)
    except BaseException:  # interrupted (Ctrl-C): a child stuck in C would loop on forever
        _kill(pid, "interrupted")
        raise
    finally:
        os.close(rfd)
    _verdict(status, state, lines, names, stall)


def _watch(pid: int, rfd: int, stall: float) -> tuple[int | None | str, _FileState | None, list[str]]:
    """Follow the child's reports until it exits (its wait status), is stuck ("stuck") or runs
    past a file's allowance ("slow"); the file being read then, and every line it reported."""
    lines: list[str] = []
    pending = b""
    state: _FileState | None = None
    started = time.monotonic()
    while True:
        ready = select.select([rfd], [], [], 0.05)[0]
        now = time.monotonic()
        if ready:
            chunk = os.read(rfd, 65536)
            pending += chunk
            *complete, pending = pending.split(b"\n")
            for raw in complete:
                line = raw.decode("utf-8", "replace")
                lines.append(line)
                state = _follow(line, state, now)
            if not chunk:  # the child closed its end: it is exiting
                _, st = os.waitpid(pid, 0)
                return st, state, lines
            if state is not None:
                state.last_report = now
            continue
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            return st, state, lines
        if state is not None:
            if now - state.last_report > stall:
                return _kill(pid, "stuck"), state, lines
            if now - state.started > allowance(stall, state.size, state.tensors):
                return _kill(pid, "slow"), state, lines
        elif now - started > stall:
            return _kill(pid, "stuck"), state, lines


def _kill(pid: int, why: str) -> str:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    return why


def _follow(line: str, state: _FileState | None, now: float) -> _FileState | None:
    tag, rest = line[:1], line[1:]
    if tag == "P":
        size, _, path = rest.partition(" ")
        return _FileState(path=path, started=now, last_report=now, size=int(size or 0))
    if state is not None and tag == "N":
        state.tensors = int(rest or 0)
    elif state is not None and tag == "T":
        state.done = int(rest or 0)
    return state


def _verdict(status: int | None | str, state: _FileState | None, lines: list[str], names: list[str],
             stall: float) -> None:
    last = state.path if state is not None else (names[0] if names else "")
    if status == "stuck":
        raise TraceFileError(f"reading the file's structure made no progress in {stall:.0f} s: the file is damaged "
                             "(the HDF5 library loops on some damaged structures)", last)
    if status == "slow" and state is not None:
        took = time.monotonic() - state.started
        raise TraceFileError(f"too slow to open: {state.done} of {state.tensors} tensors read in {took:.0f} s "
                             f"(the file is valid so far, only big; allow more with TENSORDIFF_OPEN_TIMEOUT, now "
                             f"{stall:.0f} s)", last)
    assert isinstance(status, int)
    if os.WIFSIGNALED(status):
        raise TraceFileError(f"the HDF5 library crashed reading this file (signal {os.WTERMSIG(status)}): "
                             "the file is damaged", last)
    for line in lines:
        if line.startswith("I"):
            path, _, ident = line[1:].rpartition("\t")
            dev, ino, size, mtime = (int(x) for x in ident.split())
            CHECKED[os.path.abspath(path)] = FileIdentity(dev, ino, size, mtime)
    err = next((x[1:] for x in lines if x.startswith("E")), None)
    if os.WEXITSTATUS(status) == 2 and err:
        name, _, msg = err.partition("\t")
        cls = getattr(errors, name, None)
        if not (isinstance(cls, type) and issubclass(cls, TensordiffError)):
            cls = TraceFileError
        raise cls(msg)  # the message names the file already


def _die_with_parent() -> None:
    """Linux: the kernel kills this child when its parent dies (a parent killed by a timeout or
    SIGKILL must not leave a child looping in the HDF5 library)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _child(paths: list[str], rfd: int, wfd: int) -> None:
    """The forked child: open each trace, report progress and the first error on ``wfd``, exit."""
    code = 3
    try:
        os.close(rfd)
        _die_with_parent()
        code = 0
        last = [0.0]

        def say(line: str) -> None:
            os.write(wfd, line.encode("utf-8", "replace").replace(b"\n", b" ")[:4000] + b"\n")

        def tick(done: int, total: int) -> None:
            now = time.monotonic()
            if done == 0:
                say(f"N{total}")
            if now - last[0] >= TICK_SECONDS:
                last[0] = now
                say(f"T{done}")

        for p in paths:
            try:
                size = os.path.getsize(p) if os.path.isfile(p) else 0
            except OSError:
                size = 0
            say(f"P{size} {p}")
            try:
                with TraceReader(p, progress=tick) as r:
                    r.touch()
                    i = r.identity
                    say(f"I{p}\t{i.dev} {i.ino} {i.size} {i.mtime_ns}")
            except TensordiffError as e:
                say("E" + type(e).__name__ + "\t" + " ".join(str(e).split()))
                code = 2
                break
    except BaseException:  # noqa: BLE001 - the caller's own open will meet and report it
        code = 3
    finally:
        os._exit(code)
