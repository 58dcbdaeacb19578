"""The stages a diff reports its progress in, and the callback that receives them.

A progress callback is called as ``progress(stage, done, total)``; it may raise to cancel the
diff (the TUI does when its user quits). :class:`Stage` is a ``str`` enum, so a callback that
prints the stage prints its words."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum


class Stage(str, Enum):
    ALIGNING = "aligning tokens"
    CHECKING_REPLICAS = "checking replicas"
    COMPARING = "comparing tensors"
    IDENTIFYING = "identifying slots"
    TRIAGING_STEPS = "triage steps"

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


#: ``(stage, done, total)``; may raise to cancel
Progress = Callable[[Stage, int, int], None]

__all__ = ["Progress", "Stage"]
