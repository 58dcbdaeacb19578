"""Opening untrusted files: a guard against the HDF5 library itself.

Some damage is beyond validation: a zeroed object header in a global heap sends HDF5's string
read into an endless loop in C, where no Python timeout or handler can act. :func:`probe` opens
and validates each trace in a forked child first; the caller meets only its verdict.

The child reports as it goes (one line each: the file it starts, its tensor count, a tick per
tensor read, the identity of the file it read, the first error), so the parent tells apart

- a file on which the library is stuck: no report while the child spends ``TENSORDIFF_OPEN_TIMEOUT``
  seconds (default 60) of CPU time -> "damaged" (the library loops in C, so a stuck child burns
  CPU; a child that merely waits for a core on a loaded machine is not stuck: where ``/proc``
  gives no CPU times, or a child makes no report for ten times as long in wall time, the wall
  clock decides);
- a valid file that is merely big: reports keep coming (the last within the stall timeout), but
  the whole open takes longer than its allowance, which grows with the file's structure
  (:func:`allowance`) -> "too slow to open";

and each file gets its own clock, so the error names the file that was being read. The identity
(device, inode, size, modification time) of each file the child checked is remembered in
:data:`~tensordiff.trace.validate.CHECKED`; a later :class:`~tensordiff.trace.TraceReader` of the
same path in this process refuses a file that is not that one (swapped in by a rename, or
modified since).

Why one module of this size: the guarded open, its watcher and its child process are one protocol
(pipe, CPU-time rule, kill), read and tested as one.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import errors
from ..errors import TensordiffError, TraceFileError, UsageError
from .reader import TraceReader
from .validate import CHECKED, FileIdentity

PROBE_SECONDS = 60.0        # no report for this long: the HDF5 library is stuck (TENSORDIFF_OPEN_TIMEOUT)
MIN_TIMEOUT, MAX_TIMEOUT = 1.0, 86400.0
PER_TENSOR_SECONDS = 0.05   # allowance per tensor, on top of the stall timeout (far above what a tensor's checks take)
READ_BYTES_PER_SECOND = 200e6
TICK_SECONDS = 0.2          # the child reports at most this often
WALL_FACTOR = 10.0          # no report for this many stall timeouts of wall time: stuck, whatever the CPU says
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") and "SC_CLK_TCK" in os.sysconf_names else 100


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


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (every thread) from ``/proc``; None where there
    is no such file (not Linux) or it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        fields = stat[stat.rindex(b")") + 2:].split()   # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, ValueError, IndexError):
        return None


class _Clock:
    """How long a child has gone without a report: CPU seconds where ``/proc`` tells them, else wall
    seconds; past ``WALL_FACTOR`` stall timeouts of wall time it counts as stuck either way."""

    def __init__(self, pid: int, stall: float):
        self.pid, self.stall = pid, stall
        self.wall = time.monotonic()
        self.cpu = _cpu_seconds(pid)

    def reset(self, now: float) -> None:
        self.wall = now
        self.cpu = _cpu_seconds(self.pid)

    def stuck(self, now: float) -> bool:
        if now - self.wall > self.stall * WALL_FACTOR:
            return True
        if now - self.wall <= self.stall:   # never sooner than the wall clock's rule
            return False
        cpu = _cpu_seconds(self.pid) if self.cpu is not None else None
        if cpu is None or self.cpu is None:   # no CPU times: the wall clock's rule
            return True
        return cpu - self.cpu > self.stall


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


def _watch(pid: int, rfd: int, stall: float, expect: set[str] | None = None
           ) -> tuple[int | None | str, _FileState | None, list[str]]:
    """Follow the child's reports until it exits (its wait status), is stuck ("stuck") or runs
    past a file's allowance ("slow"); the file being read then, and every line it reported.
    ``expect``: the files a worker (:func:`run_watched`) opens; its clocks run only while it
    opens one of them (before, between and after, it runs the command's own code)."""
    lines: list[str] = []
    pending = b""
    state: _FileState | None = None
    clock = _Clock(pid, stall)   # since the last report
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
                if expect is not None and line.startswith("I"):
                    expect.discard(line[1:])
                    state = None   # that file is open: no clock until the next one starts
                if expect is not None and not expect:
                    state = None
            if not chunk:  # the child closed its end: it is exiting
                _, st = os.waitpid(pid, 0)
                return st, state, lines
            if state is not None:
                state.last_report = now
            clock.reset(now)
            continue
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:   # what it wrote just before exiting may still be in the pipe
            while select.select([rfd], [], [], 0)[0]:
                chunk = os.read(rfd, 65536)
                if not chunk:
                    break
                pending += chunk
            for raw in pending.split(b"\n"):
                if raw:
                    lines.append(raw.decode("utf-8", "replace"))
                    state = _follow(lines[-1], state, now)
            return st, state, lines
        if state is not None:
            if clock.stuck(now) and not _waiting(rfd):
                return _kill(pid, "stuck"), state, lines
            # too slow only while it visibly makes progress: a child gone silent is stuck or not
            # by its clock, not called valid-but-big because a loaded machine slowed its loop
            if now - clock.wall <= stall and now - state.started > allowance(stall, state.size, state.tensors):
                return _kill(pid, "slow"), state, lines
        elif expect is None and clock.stuck(now) and not _waiting(rfd):
            return _kill(pid, "stuck"), state, lines


def _waiting(rfd: int) -> bool:
    """Whether a report waits in the pipe. Asked after the clock (which reads the child's CPU
    time) says stuck: a watcher descheduled between its ``select`` and that reading (a loaded
    machine) meets a child that reported meanwhile, which is progress, not a stuck library."""
    return bool(select.select([rfd], [], [], 0)[0])


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


# ----------------------------------------------------------------------------------------------
# The watched run: the real open, in a worker this process watches (no second open)
# ----------------------------------------------------------------------------------------------


def run_watched(paths: Sequence[str | os.PathLike[str]], body: Callable[[], int],
                timeout: float | None = None) -> int:
    """Run ``body`` (a command's work: open the traces, compute, print) in a forked worker and
    watch that worker's own opens of ``paths`` as :func:`probe` watches its child's: a file on
    which the HDF5 library gets stuck, crashes it or opens too slowly gives the same one-line
    :class:`~tensordiff.errors.TraceFileError` here, and the worker is killed. Each file is
    opened once, by the worker (then its first and last row of every dataset are read, under
    the watch, as the probe's child does); :func:`probe` opened every file twice.

    Returns ``body``'s exit code; an error the worker raises is raised here as the same class
    (KeyboardInterrupt, BrokenPipeError and MemoryError likewise), so the caller handles it as
    it would have in-process. Without ``os.fork``, with TENSORDIFF_NO_PROBE=1, or when stdout
    or stderr is not a file descriptor (a test capturing them in memory), it is ``probe(paths)``
    then ``body()`` in this process."""
    stall = open_timeout() if timeout is None else float(timeout)
    if not runs_in_worker():
        t0 = time.perf_counter()
        probe(paths, stall)
        _timing("probe", time.perf_counter() - t0, "child process, every file opened twice")
        return body()
    names = [os.path.abspath(os.fspath(p)) for p in paths]
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    t0 = time.perf_counter()
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: never returns
        _worker(body, names, rfd, wfd)
    os.close(wfd)
    fork_s = time.perf_counter() - t0
    try:
        status, state, lines = _watch(pid, rfd, stall, expect=set(names))
    except BaseException:  # interrupted (Ctrl-C): a worker stuck in C would loop on forever
        _kill(pid, "interrupted")
        raise
    finally:
        os.close(rfd)
    return _worker_verdict(status, state, lines, names, stall, fork_s)


def runs_in_worker() -> bool:
    """Whether :func:`run_watched` runs its body in a forked worker (else in this process)."""
    return hasattr(os, "fork") and not probe_disabled() and _real_stdio()


def _real_stdio() -> bool:
    try:
        sys.stdout.fileno()
        sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is both
        return False
    return True


def _timing(stage: str, seconds: float, note: str) -> None:
    """``TENSORDIFF_TIMINGS=1``: one line per stage on stderr (for benchmarks/bench_diff.py)."""
    if os.environ.get("TENSORDIFF_TIMINGS", "").strip() in ("", "0"):
        return
    sys.stderr.write(f"tensordiff: timing: {stage} {seconds:.4f} s ({note})\n")
    sys.stderr.flush()


def _worker_verdict(status: int | None | str, state: _FileState | None, lines: list[str], names: list[str],
                    stall: float, fork_s: float) -> int:
    opened = {x[1:] for x in lines if x.startswith("I")}
    ended = any(x[:1] in "REKBMX" for x in lines)
    if isinstance(status, int) and os.WIFSIGNALED(status) and not ended and opened >= set(names):
        raise TensordiffError(f"the diff process was killed (signal {os.WTERMSIG(status)}) after it had opened "
                              "the traces")
    if status in ("stuck", "slow") or (isinstance(status, int) and os.WIFSIGNALED(status) and not ended):
        _verdict(status, state, [], names, stall)   # raises (stuck, slow, crashed in an open)
    last = next((x for x in reversed(lines) if x[:1] in "REKBMX"), None)
    assert isinstance(status, int)
    if last is None:   # exited without a word: a crash after its opens (the opens were fine)
        why = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"status {os.WEXITSTATUS(status)}"
        raise TraceFileError(f"the diff process ended without a result ({why})")
    tag, rest = last[:1], last[1:]
    if tag == "R":
        code, _, probe_s = rest.partition("\t")
        _timing("probe", fork_s + float(probe_s or 0), f"fork {fork_s:.4f} s + first/last rows under the watch "
                                                          f"{float(probe_s or 0):.4f} s; one open per file")
        return int(code)
    if tag == "K":
        raise KeyboardInterrupt
    if tag == "B":
        raise BrokenPipeError
    if tag == "M":
        raise MemoryError
    name, _, msg = rest.partition("\t")
    cls = getattr(errors, name, None)
    if tag == "E" and isinstance(cls, type) and issubclass(cls, TensordiffError):
        raise cls(msg)  # the message names the file already
    raise RuntimeError(f"{name}: {msg}" if msg else name)


class _Reporter:
    """In the worker: reports each open (``P`` start, ticks, ``I`` done) on the pipe, by wrapping
    :class:`TraceReader`'s constructor until every input file is open (an open of a path spelled
    otherwise is watched too: it only never counts as an input)."""

    def __init__(self, wfd: int, names: list[str]):
        self.wfd = wfd
        self.pending = set(names)
        self.last = 0.0
        self.probe_s = 0.0   # time spent only because of the watch (first/last rows, reports)
        self._orig: Any = None

    def say(self, line: str) -> None:
        t = time.perf_counter()
        os.write(self.wfd, line.encode("utf-8", "replace").replace(b"\n", b" ")[:4000] + b"\n")
        self.probe_s += time.perf_counter() - t

    def tick(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done == 0:
            self.say(f"N{total}")
        if now - self.last >= TICK_SECONDS:
            self.last = now
            self.say(f"T{done}")

    def install(self) -> None:
        orig = self._orig = TraceReader.__init__
        rep = self

        def init(reader: TraceReader, path: str | os.PathLike[str], *,
                 progress: Callable[[int, int], None] | None = None) -> None:
            p = os.path.abspath(os.fspath(path))
            if not rep.pending:   # every open until the inputs are all open is watched, named or not
                orig(reader, path, progress=progress)
                return
            try:
                size = os.path.getsize(p) if os.path.isfile(p) else 0
            except OSError:
                size = 0
            rep.say(f"P{size} {p}")

            def tick(done: int, total: int) -> None:
                rep.tick(done, total)
                if progress is not None:
                    progress(done, total)

            orig(reader, path, progress=tick)
            t = time.perf_counter()
            try:
                reader.touch()   # what the probe's child read: each chunk index at both ends
            except BaseException:
                reader.close()
                raise
            reader._progress = progress
            rep.probe_s += time.perf_counter() - t
            rep.say(f"I{p}")
            rep.pending.discard(p)
            if not rep.pending:
                rep.uninstall()

        TraceReader.__init__ = init  # type: ignore[method-assign, assignment]

    def uninstall(self) -> None:
        if self._orig is not None:
            TraceReader.__init__ = self._orig  # type: ignore[method-assign]
            self._orig = None


def _worker(body: Callable[[], int], names: list[str], rfd: int, wfd: int) -> None:
    """The forked worker: run the command's work with its opens reported, send how it ended
    (``R`` exit code, ``E`` an error, ``K``/``B``/``M``/``X``), exit."""
    code = 3
    try:
        os.close(rfd)
        _die_with_parent()
        rep = _Reporter(wfd, names)
        rep.install()
        try:
            code = body()
            msg = f"R{code}\t{rep.probe_s:.6f}"
        except TensordiffError as e:
            msg, code = "E" + type(e).__name__ + "\t" + " ".join(str(e).split()), 2
        except KeyboardInterrupt:
            msg, code = "K", 130
        except BrokenPipeError:
            msg, code = "B", 0
        except MemoryError:
            msg, code = "M", 2
        except Exception as e:  # noqa: BLE001 - the caller reports it as it would in-process
            if os.environ.get("TENSORDIFF_DEBUG"):
                traceback.print_exc()
            msg, code = "X" + type(e).__name__ + "\t" + " ".join(str(e).split()[:60]), 2
        rep.uninstall()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BrokenPipeError:
                with contextlib.suppress(OSError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
            except Exception:  # noqa: BLE001, S110 - nothing left to report it on
                pass
        rep.say(msg)
    except BaseException:  # noqa: BLE001 - the parent reports an ending without a result
        code = 3
    finally:
        os._exit(code)
