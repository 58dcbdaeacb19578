"""The preview of a large pair (:func:`tensordiff.diff.preview.preview_summary`) made in a child
process forked when the app is created, so that it is read on the second core while Textual
starts up and draws its first frame; in a thread of the app's own process, the preview and the
first frame take turns on the GIL.

The child is a fork: it already holds every module the preview needs, and it starts in a few
milliseconds. It writes the preview's summary file into a directory the parent made, reports the
number of aligned tokens on a pipe and leaves with ``os._exit`` (no atexit handler, no flush of
the parent's buffers, no terminal restore). The diff thread waits for its answer only up to a
deadline: a child that is late is killed, and one that fails or dies is no preview at once; the
diff goes on either way. Where ``os.fork`` is missing (not POSIX) there is no child, and the diff thread
makes the preview itself.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable

from ..diff.preview import PREVIEW_TOKENS, preview_summary


class PreviewProcess:
    """A forked child making the preview of ``path_a`` and ``path_b`` into ``dir/preview.h5``
    when either trace stores at least ``preview_from`` token rows."""

    def __init__(self, pid: int, fd: int, directory: str):
        self.pid, self._fd, self.dir = pid, fd, directory
        self.path = os.path.join(directory, "preview.h5")
        self._lock = threading.Lock()
        self._buf = b""
        self._done = False

    @classmethod
    def start(cls, path_a: str, path_b: str, preview_from: int) -> PreviewProcess | None:
        """Fork the child; None where the platform has no fork or the fork fails (the diff
        thread then makes the preview itself)."""
        if not hasattr(os, "fork") or not (os.path.isfile(path_a) and os.path.isfile(path_b)):
            return None
        directory = tempfile.mkdtemp(prefix="tensordiff-tui-preview-")
        r, w = os.pipe()
        parent = os.getpid()
        try:
            pid = os.fork()
        except OSError:
            os.close(r)
            os.close(w)
            shutil.rmtree(directory, ignore_errors=True)
            return None
        if pid == 0:   # the child: never returns
            _child(path_a, path_b, os.path.join(directory, "preview.h5"), preview_from, r, w, parent)
        os.close(w)
        return cls(pid, r, directory)

    def result(self, timeout: float, check: Callable[[], None] | None = None) -> int:
        """The preview's aligned tokens once the child has written it (0: no preview), waiting
        at most ``timeout`` seconds; ``check`` is called every 10 ms and may raise to cancel.
        A child still running at the deadline is killed: the diff does not wait for it."""
        end = time.perf_counter() + timeout
        while True:
            with self._lock:
                if self._done:
                    return 0
                n = self._read()
                if n is not None:
                    self._reap(kill=False)
                    return n
            left = end - time.perf_counter()
            if left <= 0:
                self.close()
                return 0
            if check is not None:
                check()
            try:
                select.select([self._fd], [], [], min(0.01, left))
            except (OSError, ValueError):   # closed by close() on another thread
                return 0

    def _read(self) -> int | None:
        """The child's count once its line is complete (None: not yet); 0 at end of file without
        one."""
        try:
            ready, _, _ = select.select([self._fd], [], [], 0.0)
            if not ready:
                return None
            chunk = os.read(self._fd, 64)
        except OSError:
            return 0
        if not chunk:
            return 0   # the child ended without a count: no preview
        self._buf += chunk
        if not self._buf.endswith(b"\n"):
            return None
        try:
            return max(0, int(self._buf))
        except ValueError:
            return 0

    def _reap(self, kill: bool) -> None:
        if self._done:
            return
        self._done = True
        if kill:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        try:
            os.close(self._fd)
        except OSError:
            pass

    def close(self) -> None:
        """Kill the child if it still runs, reap it; the directory stays until :meth:`remove`."""
        with self._lock:
            self._reap(kill=True)

    def remove(self) -> None:
        """Close, and remove the directory with the preview file."""
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _die_with(parent: int) -> None:
    """On Linux, be killed when the parent dies (a parent killed by SIGKILL cannot kill this child
    itself, and a preview stuck on a slow disk would outlive it). Linux sends the signal when the
    thread that forked ends: the app forks on the thread that runs it, which lives as long."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):   # not Linux: the child ends when its preview does
        pass
    if os.getppid() != parent:   # the parent died before the call above
        os._exit(1)


def _child(path_a: str, path_b: str, out: str, preview_from: int, r: int, w: int, parent: int) -> None:
    code = 1
    try:
        os.close(r)
        # the terminal's Ctrl-C is the parent's to handle; the parent kills this child when it quits
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _die_with(parent)
        n = 0
        if max(stored_tokens(path_a), stored_tokens(path_b)) >= preview_from:
            n = preview_summary(path_a, path_b, out, PREVIEW_TOKENS)
        os.write(w, f"{int(n)}\n".encode())
        code = 0
    except BaseException:  # noqa: BLE001, B036 - no preview; nothing of a child may reach the terminal
        code = 1
    finally:
        os._exit(code)


def stored_tokens(path: str) -> int:
    """The token rows a trace file stores (0: not a readable trace file, or a set)."""
    if not os.path.isfile(path):
        return 0
    import h5py

    try:
        with h5py.File(path, "r", locking=False) as f:
            tok = f.get("tokens")
            return int(tok.shape[0]) if isinstance(tok, h5py.Dataset) and tok.shape else 0
    except Exception:  # noqa: BLE001 - whatever a damaged file makes h5py raise: the diff reports it
        return 0
