"""tensordiff: differential tensor-tracing debugger.

Record named tensors on two sides (training extractor vs serving engine), align them by token and
by slot, and name the first divergence: "slot 0 holds layer3 where embed was expected".

The core (trace format, aligner, metrics, report, CLI) needs numpy + h5py only; recorders need
torch; only the TUI imports textual.
"""

__version__ = "0.1.0"
