"""tensordiff: differential tensor-tracing debugger.

Record named tensors on two sides (training extractor vs serving engine), align them by token and
by slot, and name the first divergence: "slot 0 holds layer3 where embed was expected".

The core (trace format, aligner, metrics, report, CLI) needs numpy + h5py only; recorders need
torch; only the TUI imports textual.
"""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # `import tensordiff` stays light: the loop (and torch, when it records) loads on first use.
    # By name, not an import statement: every module imports this package (for __version__), and
    # the package itself sits in no layer of the import contracts
    if name == "locate":
        import importlib

        return importlib.import_module("tensordiff.locator").locate
    raise AttributeError(f"module 'tensordiff' has no attribute {name!r}")
