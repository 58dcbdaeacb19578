"""The weight step each cached prefix was computed under, as an engine recorder tracks it for the
``/prefix_cache`` record (:mod:`tensordiff.trace.prefix_cache`).

The engine says how many leading tokens of a request came from its prefix cache (SGLang's
``cached_tokens``, vLLM's ``num_cached_tokens``); which weights computed that KV it does not say.
The recorder knows which positions every request computed and the weight step in force then, so
it keeps a radix tree of token prefixes with, per position, the weight step whose pass computed
it (computed, not reused: a reused prefix keeps the step of the pass that wrote it). A flush of the
engine's cache empties the tree. The tree only grows between flushes, bounded by
:data:`MAX_TOKENS` positions (past it, it restarts empty and says so: a prefix computed before
then reads as step -1, unknown).

Engine-agnostic and torch-free: the engine plugins call :meth:`PrefixSteps.served` at a request's
first result, :meth:`PrefixSteps.progress` at each later one, :meth:`PrefixSteps.finished` at its
end and :meth:`PrefixSteps.flush` when the cache is emptied, and write :meth:`PrefixSteps.take`'s
lines.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

#: positions the tree holds at most before it restarts (8 bytes each: token and step)
MAX_TOKENS = 1 << 24


class _Node:
    __slots__ = ("toks", "steps", "kids")

    def __init__(self, toks: array[int], steps: array[int]) -> None:
        self.toks, self.steps = toks, steps
        self.kids: dict[int, _Node] = {}


def _common(a: array[int], b: Sequence[int], i: int, end: int) -> int:
    """How many leading tokens of ``a`` equal ``b[i:end]``."""
    n = min(len(a), end - i)
    m = 0
    while m < n and a[m] == b[i + m]:
        m += 1
    return m


class StepTree:
    """Token prefixes and, per position, the weight step whose pass computed its KV."""

    def __init__(self) -> None:
        self.root = _Node(array("i"), array("i"))
        self.tokens = 0

    def lookup(self, ids: Sequence[int], n: int) -> list[int]:
        """The step of each of positions 0..n-1 of ``ids`` (-1 where the tree does not hold it)."""
        out: list[int] = []
        node, i = self.root, 0
        while i < n:
            child = node.kids.get(int(ids[i]))
            if child is None:
                break
            m = _common(child.toks, ids, i, n)
            out.extend(child.steps[:m])
            i += m
            if m < len(child.toks):
                break
            node = child
        out.extend([-1] * (n - i))
        return out

    def write(self, ids: Sequence[int], start: int, end: int, step: int) -> None:
        """Positions start..end-1 of ``ids`` computed under ``step`` (the path to them made where
        missing, its positions at -1)."""
        node, i = self.root, 0
        while i < end:
            t = int(ids[i])
            child = node.kids.get(t)
            if child is None:
                toks = array("i", (int(x) for x in ids[i:end]))
                node.kids[t] = _Node(toks, array("i", (step if p >= start else -1 for p in range(i, end))))
                self.tokens += end - i
                return
            m = _common(child.toks, ids, i, end)
            if m < len(child.toks):   # split: the child keeps the shared part
                lower = _Node(child.toks[m:], child.steps[m:])
                lower.kids = child.kids
                child.toks, child.steps, child.kids = child.toks[:m], child.steps[:m], {lower.toks[0]: lower}
            for j in range(max(start - i, 0), m):
                child.steps[j] = step
            i += m
            node = child


def _runs(steps: list[int]) -> list[list[int]]:
    """[[start, end, step], ...] of the equal runs of ``steps``."""
    out: list[list[int]] = []
    for p, s in enumerate(steps):
        if out and out[-1][2] == s and out[-1][1] == p:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1, s])
    return out


class PrefixSteps:
    """Per request: the cached prefix's steps at its first result, the steps its own positions
    were computed under as it runs, written into the tree as it goes."""

    def __init__(self) -> None:
        self.tree = StepTree()
        self.live: dict[str, dict[str, Any]] = {}
        self.lines: list[dict[str, Any]] = []
        self.last_flush = -1

    def served(self, key: str, ids: Sequence[int], cached: int, step: int) -> None:
        """A request's first result: its prompt ``ids`` computed from position ``cached`` on under
        ``step``, positions 0..cached-1 taken from the cache."""
        cached = max(0, min(int(cached), len(ids)))
        steps = self.tree.lookup(ids, cached)
        self.lines.append({"seq": key, "cached_tokens": cached, "weight_step": int(step), "kv_steps": _runs(steps),
                           "last_flush_forward_step": self.last_flush})
        self.tree.write(ids, cached, len(ids), int(step))
        self.live[key] = {"kv": len(ids), "marks": [], "step": int(step), "step0": int(step)}

    def progress(self, key: str, kv_len: int, step: int) -> None:
        """A later result of a request: its KV now covers ``kv_len`` positions; those past the
        last result's were computed under ``step``."""
        r = self.live.get(key)
        if r is None:
            return
        if step != r["step"]:
            r["marks"].append((r["kv"], int(step)))
            r["step"] = int(step)
        r["kv"] = max(r["kv"], int(kv_len))

    def finished(self, key: str, ids: Sequence[int], prompt_len: int) -> None:
        """A request's end: its positions after the prompt (``ids``: prompt and output) written
        into the tree under the steps they ran with."""
        r = self.live.pop(key, None)
        if r is None:
            return
        end = min(r["kv"], len(ids))
        cur = r["step0"]
        for p, s in r["marks"]:
            if p <= prompt_len:
                cur = s
        cuts = [(prompt_len, cur)] + [(p, s) for p, s in r["marks"] if p > prompt_len]
        for (p, s), nxt in zip(cuts, [c[0] for c in cuts[1:]] + [end]):
            if p < min(nxt, end):
                self.tree.write(ids, p, min(nxt, end), s)
        if self.tree.tokens > MAX_TOKENS:
            self.tree = StepTree()
            self.lines.append({"restart": True, "forward_step": -1})

    def flush(self, forward_step: int, step: int) -> None:
        """The engine emptied its cache before forward pass ``forward_step``."""
        self.tree = StepTree()
        self.last_flush = int(forward_step)
        self.lines.append({"flush": True, "forward_step": int(forward_step), "weight_step": int(step)})

    def take(self) -> list[dict[str, Any]]:
        out, self.lines = self.lines, []
        return out
