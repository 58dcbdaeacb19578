"""What ``tensordiff locate`` found: the final sentence first, then the chain of evidence, each
link a sentence with its numbers and the commands that produced it (text, or JSON with
``--json``).

Example (the trained tiny Llama, a port whose layer 3 down projection is scaled by 1.05)::

    the cause is inside layer 3's MLP: layer3.mlp_out (scale): it is scaled by 1.05 at every token
    and channel; look at a scale in that op's weights or a constant factor after it; confirmed by
    grafting layer4 from A: nothing after it diverges; the weights of layer 3 differ: ...
    1. record both sides and diff: layer4 diverges from token 35 ...
       $ tensordiff record train --model ... --out DIR/a.h5 ...
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FORMAT", "Evidence", "LocateResult"]

FORMAT = "tensordiff.locate/1"


@dataclass(frozen=True)
class Evidence:
    """One link of the chain: what a step showed, with its numbers, and its commands."""

    step: str
    sentence: str
    commands: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "sentence": self.sentence, "commands": list(self.commands)}


@dataclass
class LocateResult:
    verdict: str                       # the final sentence, the report's first line
    exit_code: int                     # 0 agree, 1 a divergence found (located or not)
    out_dir: str
    layer: int | None = None           # the decoder layer the cause is inside
    op: str | None = None              # its first op out of the noise (layer3.mlp_out)
    kind: str | None = None            # what kind of difference (the signature), or "numeric"
    confirmed: bool | None = None      # the grafts: inside that layer (None: not run)
    weights_equal: bool | None = None  # that layer's parameters (None: not compared)
    config_diffs: list[str] = field(default_factory=list)
    op_graph: str | None = None        # the zoomed layer op by op
    evidence: list[Evidence] = field(default_factory=list)
    traces: dict[str, str] = field(default_factory=dict)
    html: str | None = None            # --html: the last diff's report

    def text(self) -> str:
        out = [self.verdict]
        for i, e in enumerate(self.evidence, 1):
            out.append(f"{i}. {e.step}: {e.sentence}")
            out.extend(f"   $ {c}" for c in e.commands)
        if self.op_graph:
            out.append(self.op_graph)
        if self.html:
            out.append(f"HTML report of the last diff: {self.html}")
        return "\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = _jsonable({
            "format": FORMAT, "verdict": self.verdict, "exit_code": self.exit_code, "out_dir": self.out_dir,
            "layer": self.layer, "op": self.op, "kind": self.kind, "confirmed": self.confirmed,
            "weights_equal": self.weights_equal, "config_diffs": self.config_diffs, "op_graph": self.op_graph,
            "evidence": [e.to_dict() for e in self.evidence], "traces": self.traces, "html": self.html})
        return out


def _jsonable(x: Any) -> Any:
    """NaN/Inf are not JSON: null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x
