"""Errors that mean "bad input": the CLI turns every :class:`TensordiffError` into one line on
stderr and exit code 2. Each subclass names what was wrong, so a caller (or a test) can tell a
damaged file from two traces that cannot be compared from a mistyped flag.
"""

from __future__ import annotations


class TensordiffError(Exception):
    """Something tensordiff cannot use. The message is one line for a person; ``path`` names the
    file it concerns, when there is one, and is put in front of the message."""

    def __init__(self, message: str, path: str | None = None):
        self.path = path
        self.reason = message
        super().__init__(f"{path}: {message}" if path else message)


class TraceFileError(TensordiffError):
    """A trace file that is damaged, unsupported (schema, limits) or not a trace at all."""


class TraceBusyError(TraceFileError):
    """A trace that is still being recorded (its writer has not closed it)."""


class SourceFileError(TensordiffError):
    """A file to import (SpecForge, speculators, SGLang dumper, vLLM, TensorRT-LLM, Model-Optimizer)
    or another input that is not a trace (calibration, tolerance rules) that cannot be used."""


class IncompatibleTracesError(TensordiffError):
    """Two readable traces that cannot be compared: different models, no common tokens, no common
    tensor, mismatched shapes, nothing comparable."""


class UsageError(TensordiffError):
    """A flag, argument, environment value or configuration that is wrong, or an output path that
    cannot be written (or would overwrite an input)."""


class RecordingError(TensordiffError):
    """A recording that could not be made: the engine or model would not start or load."""


__all__ = ["TensordiffError", "TraceFileError", "TraceBusyError", "SourceFileError",
           "IncompatibleTracesError", "UsageError", "RecordingError"]
