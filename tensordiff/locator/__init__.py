"""``tensordiff locate``: from two models to the op in one command (the loop of docs/ports.md, run
for the user). :func:`tensordiff.locate` is its Python API; torch is imported only when a side is
recorded."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .result import LocateResult

__all__ = ["locate"]


def locate(a: str, b: str, prompts: str, out: str, *, dtype_a: str | None = None, dtype_b: str | None = None,
           name_rules: tuple[str, ...] = (), resume: bool = False, progress: bool = False,
           echo: bool = False, engine_args: tuple[str, ...] = (), html: str | None = None) -> LocateResult:
    """Run the loop on A (the reference) and B: each an HF model directory, a trace,
    ``module:pkg.mod:factory``, or ``sglang:DIR`` / ``vllm:DIR``; traces go to ``out``
    (``engine_args``: KEY=VALUE for every engine recording; ``html``: the last diff's report). Returns the :class:`LocateResult`
    (``.verdict`` the final sentence, ``.text()`` the report, ``.to_dict()`` its JSON).
    ``echo``: print each step's command on stderr as it runs."""
    import os
    import sys

    from .loop import LocateOptions, run_locate

    def say(line: str) -> None:
        sys.stderr.write(line + "\n")

    return run_locate(LocateOptions(a=str(a), b=str(b), prompts=str(prompts), out=os.path.abspath(str(out)),
                                    dtype_a=dtype_a, dtype_b=dtype_b, name_rules=tuple(name_rules), resume=resume,
                                    progress=progress, echo=say if echo else None, engine_args=tuple(engine_args),
                                    html=html))
