"""When a serving engine cannot start: one line naming the cause and what to do, exit 2.

An engine (``sglang.Engine``) starts its scheduler in child processes. When a child fails (EAGLE-3
on an attention backend that cannot run it, SGLang's kernels missing), it logs its exception to
the stderr it inherited and sends SIGQUIT to the parent, whose SGLang handler kills the whole
process tree, itself included: exit 137, no message from tensordiff, a half-written trace left.

:class:`EngineGuard`, around the engine's start and run:

- keeps the last 64 KB of everything written to file descriptor 2 (by this process and by the
  children, which inherit it), passing it all through to the real stderr unchanged;
- installs its own SIGQUIT handler, and keeps the engine from replacing it while it starts, so a
  failed child raises :class:`EngineFailed` here instead of killing the process;
- turns a failure into :class:`~tensordiff.errors.RecordingError`: the last exception line the
  children logged (``ValueError: EAGLE is not supported in decode attention backend
  torch_native``), and a hint for the causes it knows.

vLLM's processes log with a prefix (``(EngineCore pid=12) ERROR 12-03 19:12:15 [core.py:1510]
AssertionError: ...``): the guard reads the message after it, and skips exceptions logged at
WARNING or below (ones the engine went on from).

Nothing here imports an engine.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import struct
import termios
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import RecordingError
from ..safety import sanitize_for_terminal

TAIL_BYTES = 64 << 10
_EXC_LINE = re.compile(r"^\s*((?:[A-Za-z_][\w.]*)?(?:Error|Exception|Interrupt))(?:: (.+))?\s*$")
# vLLM's log prefix: "(EngineCore pid=12) ERROR 12-03 19:12:15 [core.py:1510] " (the process tag
# and the level are optional); the message after it is what a line without a prefix would be
_LOG_PREFIX = re.compile(r"^\s*(?:\([\w.:-]+ pid=\d+\)\s*)?(?:(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+"
                         r"\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s?)?")


class EngineFailed(BaseException):
    """A child process of the engine failed (it sent SIGQUIT). A BaseException, so that the
    engine's own ``except Exception`` handlers do not swallow it."""


class _StderrTail:
    """fd 2 through a pipe: a thread copies everything to the real stderr and keeps a tail."""

    def __init__(self) -> None:
        self.tail = b""
        self._lock = threading.Lock()
        self._saved: int | None = None
        self._r: int | None = None

    def start(self) -> None:
        try:
            r, w = os.pipe()
            self._saved = os.dup(2)
            os.dup2(w, 2)
            os.close(w)
        except OSError:  # no fd 2 to redirect: run without a tail
            self._saved = None
            return
        self._r = r
        threading.Thread(target=self._pump, args=(r, self._saved), daemon=True,
                         name="tensordiff-stderr-tail").start()

    def _pump(self, r: int, out: int) -> None:
        # runs until every writer (this process and the engine's children) has closed the pipe
        try:
            while True:
                chunk = os.read(r, 65536)
                if not chunk:
                    break
                with self._lock:
                    self.tail = (self.tail + chunk)[-TAIL_BYTES:]
                try:
                    os.write(out, chunk)
                except OSError:
                    pass
        finally:
            self._r = None   # before the close: the number may be reused for another file
            os.close(r)
            os.close(out)

    def stop(self) -> None:
        """fd 2 is the real stderr again (children still running keep writing through the pipe)."""
        if self._saved is not None:
            try:
                os.dup2(self._saved, 2)
            except OSError:
                pass

    def drain(self, timeout: float = 1.0) -> None:
        """Wait (at most ``timeout``) until the pump has taken what is in the pipe: a child that
        wrote its exception and then signalled us may be read only after the signal arrives."""
        if self._r is None:
            return
        deadline = time.monotonic() + timeout
        quiet = 0
        while time.monotonic() < deadline and quiet < 2:
            try:
                pending = struct.unpack("i", fcntl.ioctl(self._r, termios.FIONREAD, b"\0\0\0\0"))[0]
            except OSError:  # the pump closed the pipe: everything was read
                return
            quiet = quiet + 1 if pending == 0 else 0
            time.sleep(0.01)   # twice quiet in a row: the last read has been appended

    def text(self) -> str:
        with self._lock:
            return self.tail.decode("utf-8", "replace")


class EngineGuard:
    """See the module docstring. ``hints``: (regular expression on the cause, what to do)."""

    def __init__(self, engine: str, hints: Sequence[tuple[str, str]] = (), default_hint: str = ""):
        self.engine = engine
        self.hints = list(hints)
        self.default_hint = default_hint or f"see {engine}'s messages above"
        self._tail = _StderrTail()
        self._old_handler: Any = None
        self._real_signal: Callable[..., Any] | None = None
        self.failed = False
        self.children_before: set[int] = set()

    # -- context -------------------------------------------------------------------------------

    def __enter__(self) -> EngineGuard:
        self.children_before = set(_children())
        self._tail.start()
        if threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGQUIT, self._on_sigquit)
            real = signal.signal
            self._real_signal = real

            def keep_ours(sig: int, handler: Any) -> Any:  # the engine may not replace ours while it starts
                if sig == signal.SIGQUIT:
                    return real(sig, self._on_sigquit)
                return real(sig, handler)

            signal.signal = keep_ours  # type: ignore[assignment, unused-ignore]
        return self

    def started(self) -> None:
        """The engine is up: it may set signal handlers again (ours for SIGQUIT stays)."""
        if self._real_signal is not None:
            signal.signal = self._real_signal  # type: ignore[assignment, unused-ignore]
            self._real_signal = None

    def __exit__(self, *exc: object) -> None:
        self.started()
        if self._old_handler is not None:
            signal.signal(signal.SIGQUIT, self._old_handler)
            self._old_handler = None
        self._tail.stop()

    def _on_sigquit(self, signum: int, frame: Any) -> None:
        self.failed = True
        raise EngineFailed()

    # -- failures ------------------------------------------------------------------------------

    def cause(self) -> str | None:
        """The first exception line the engine's processes wrote to stderr, if any: the root
        cause comes first; what the teardown raises after it (a half-written trace, a closed
        pipe) comes later and is not the cause."""
        self._tail.drain()
        code = ""   # the last source line of the traceback being read: what a bare exception failed on
        for line in self._tail.text().splitlines():
            p = _LOG_PREFIX.match(line)
            if p is not None and p.group(1) in ("DEBUG", "INFO", "WARNING"):
                continue  # an exception an engine logged and went on from (vLLM's warm-up) is no cause
            text = line[p.end():] if p is not None else line
            m = _EXC_LINE.match(text)
            if m and "Traceback" not in line:
                name = m.group(1).rsplit(".", 1)[-1]
                if m.group(2):
                    return f"{name}: {m.group(2).strip()}"
                if code:  # a bare `assert`: the line it failed on says what
                    return f"{name} ({code})"
                continue
            t = text.strip()
            if t and not t.startswith(("File ", "Traceback")) and set(t) - set("^~ "):
                code = t[:200]
        return None

    def error(self, exc: BaseException | None, while_: str = "start") -> RecordingError:
        """The one-line error for a failure (``exc``: what was raised here, if anything)."""
        cause: str | None
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            cause = f"the module {exc.name!r} is not installed"
        else:
            cause = self.cause()
            if cause is None and exc is not None and not isinstance(exc, EngineFailed):
                text = str(exc).strip().splitlines()
                cause = f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__
        if cause is None:
            cause = "one of its processes failed"
        hint = next((h for pat, h in self.hints if re.search(pat, cause)), self.default_hint)
        verb = "could not start" if while_ == "start" else "failed while recording"
        return RecordingError(sanitize_for_terminal(f"the {self.engine} engine {verb}: {cause[:400]}; {hint}"))


def _children() -> dict[int, Any]:
    try:
        import psutil  # type: ignore[import-untyped, unused-ignore]

        return {c.pid: c for c in psutil.Process().children(recursive=True)}
    except Exception:  # noqa: BLE001 - no psutil (it comes with the engines), or the process table moved
        return {}


def kill_children(keep: set[int] | frozenset[int] = frozenset()) -> None:
    """Kill the processes this one started, but those in ``keep`` (running before the engine):
    an engine that failed half-way leaves some."""
    for pid, child in _children().items():
        if pid not in keep:
            try:
                child.kill()
            except Exception:  # noqa: BLE001 - gone already
                pass
