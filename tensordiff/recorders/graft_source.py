"""The other side's recorded state a graft takes (``record train --graft OTHER.h5:STATE`` and the
plugins' ``TENSORDIFF_GRAFT``): the spec read, the trace opened and checked (the state is a state
name, the trace has it with full values), and its rows indexed by sequence and position.

Imports neither torch nor an engine: ``record serve`` checks the spec with it before it starts one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .. import names as canon
from ..safety import quoted

__all__ = ["GraftSource", "open_graft_source"]


@dataclass
class GraftSource:
    reader: Any                 # the open TraceReader of OTHER.h5
    path: str                   # its absolute path
    state: str                  # the state name (``layer4``, ``layer3.mlp_out``)
    st: canon.State
    # (sequence key, position) -> (row among the state's token rows, token id)
    index: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)

    def close(self) -> None:
        self.reader.close()


def open_graft_source(spec: str, flag: str = "--graft") -> GraftSource:
    """``OTHER.h5:STATE`` opened and checked; a ValueError of one line (starting with ``flag``)
    says what is wrong."""
    from ..trace import TraceReader

    path, sep, state = spec.rpartition(":")
    if not sep or not path or not state:
        raise ValueError(f"{flag} takes OTHER.h5:STATE, not {quoted(spec)}")
    st = canon.maybe_state(state)
    if st is None:
        raise ValueError(f"{flag}: {quoted(state)} is not a state name (embed, layer<b>, final_norm or layer<b>.<tap>)")
    try:
        r = TraceReader(path)
    except Exception as e:   # any reason the file does not open: one line
        raise ValueError(f"{flag}: cannot read {path} ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if state not in r.tensors:
        r.close()
        raise ValueError(f"{flag}: {path} has no tensor {state}")
    if not r.has_part(state, "values"):
        r.close()
        raise ValueError(f"{flag}: {path} keeps {state} as sketches only; record it with --values all "
                         "(or --zoom for a tap)")
    tok = r.tokens
    rows = r.token_rows(state)
    seqs = list(r.sequences)
    index = {(str(seqs[int(tok["seq"][t])]), int(tok["position"][t])): (i, int(tok["token"][t]))
             for i, t in enumerate(rows)}
    return GraftSource(reader=r, path=os.path.abspath(path), state=state, st=st, index=index)
