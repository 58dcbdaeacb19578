"""The members of a trace set: one file each, with its ranks, shard and host, and the checks that
they are one recording (same side, model and sketch; every DP rank, PP stage and TP rank present;
names and the recorders' rank facts agreeing)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import IncompatibleTracesError
from ..trace import TraceReader
from .paths import AXES, parse_ranks

MODEL_KEYS = ("hidden_size", "num_layers", "architecture", "dtype")


@dataclass
class Member:
    """One file of a set: its reader, ranks, the shard it belongs to and the host that wrote it."""

    index: int
    path: str
    reader: TraceReader
    ranks: dict[str, int]
    shard: str                        # which token shard: the file's base name and DP rank
    host: str | None
    tok_offset: int = 0               # where its token rows start in the set's token table
    seq_map: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # its seq -> set seq
    codes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))    # set code of each token row

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def rank_text(self) -> str:
        return " ".join(f"{a}{self.ranks[a]}" for a in AXES if a in self.ranks) or "-"


def host_of(r: TraceReader) -> str | None:
    """The host that wrote a file: ``user_meta["host"]`` (or ``user_meta["ranks"]["host"]``)."""
    um = r.user_meta
    h = um.get("host")
    if h is None and isinstance(um.get("ranks"), dict):
        h = um["ranks"].get("host")
    return str(h)[:256] if isinstance(h, str) and h else None


def _list(xs: set[int]) -> str:
    return ", ".join(map(str, sorted(xs)))


def check_meta_ranks(m: Member) -> None:
    """A file renamed to another rank is refused: the name and the recorder's facts must agree."""
    facts = m.reader.user_meta.get("ranks")
    if not isinstance(facts, dict):
        return
    for axis in AXES:
        want = facts.get(f"{axis}_rank")
        size = facts.get(f"{axis}_size")
        if (axis in m.ranks and isinstance(want, int) and want != m.ranks[axis]
                and isinstance(size, int) and size > 1):
            raise IncompatibleTracesError(f"the file name says {axis}{m.ranks[axis]} but its recorder wrote "
                                          f"{axis}_rank {want}: a renamed file?", m.path)


def _facts(m: Member) -> dict[str, Any]:
    f = m.reader.user_meta.get("ranks")
    return f if isinstance(f, dict) else {}


def check_one_run(members: Sequence[Member], path: str) -> None:
    """The per-rank files of one engine run: the same run id where the recorders wrote one (the
    vLLM plugin: the engine's ``instance_id``), and all closed cleanly or none (a rank that died
    while the others finished would make a set of unequal parts)."""
    runs = {(str(_facts(m)["run"]), m.name) for m in members if _facts(m).get("run")}
    if len({r for r, _ in runs}) > 1:
        (ra, na), (rb, nb) = sorted(runs)[0], next(x for x in sorted(runs) if x[0] != sorted(runs)[0][0])
        raise IncompatibleTracesError(f"trace set mixes engine runs: {na} is from run {ra}, {nb} from run {rb}; "
                                      "give the files of one run", path)
    done = [m for m in members if m.reader.complete]
    cut = [m for m in members if not m.reader.complete]
    if done and cut:
        raise IncompatibleTracesError(f"{cut[0].name} was not closed cleanly (its process died while recording?) but "
                                      f"{done[0].name} was: the set's ranks would hold different parts of the run; "
                                      "name the complete files on their own to compare them", path)


def check_headers(members: Sequence[Member], path: str) -> None:
    """One side, one model, one sketch projection, one run."""
    check_one_run(members, path)
    first = members[0]
    r0 = first.reader
    for m in members[1:]:
        r = m.reader
        if r.side != r0.side:
            raise IncompatibleTracesError(f"trace set mixes sides: {m.name} is {r.side}, {first.name} is {r0.side}",
                                          path)
        for key in MODEL_KEYS:
            va, vb = r0.model.get(key), r.model.get(key)
            if va is not None and vb is not None and va != vb:
                raise IncompatibleTracesError(f"trace set mixes models: {m.name} has {key} {vb!r}, {first.name} has "
                                              f"{va!r}", path)
        if (r.sketch_seed, r.sketch_dim) != (r0.sketch_seed, r0.sketch_dim):
            raise IncompatibleTracesError(f"trace set mixes sketch projections: {m.name} has seed {r.sketch_seed} "
                                          f"dim {r.sketch_dim}, {first.name} seed {r0.sketch_seed} dim {r0.sketch_dim}",
                                          path)


def _sizes(members: Sequence[Member], axis: str) -> set[int]:
    """The sizes of ``axis`` the recorders wrote (>1, for files whose names give that rank)."""
    out = set()
    for m in members:
        facts = m.reader.user_meta.get("ranks")
        v = facts.get(f"{axis}_size") if isinstance(facts, dict) else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 1 and axis in m.ranks:
            out.add(v)
    return out


def check_layout(members: Sequence[Member], path: str) -> None:
    """Every stage of every shard, every DP rank and every TP rank that the names and the
    recorders' facts promise is present; naming is consistent."""
    for axis in ("pp", "tp"):
        has = {axis in m.ranks for m in members}
        if len(has) > 1:
            named = next(m for m in members if axis in m.ranks)
            bare = next(m for m in members if axis not in m.ranks)
            raise IncompatibleTracesError(f"trace set mixes files with and without a {axis.upper()} rank "
                                          f"({named.name}, {bare.name})", path)
    for axis in AXES:
        sizes = _sizes(members, axis)
        if len(sizes) > 1:
            raise IncompatibleTracesError(f"trace set mixes recordings: the files say {axis}_size "
                                          f"{' and '.join(map(str, sorted(sizes)))}", path)
    # DP: per base name, ranks 0..D-1
    by_base: dict[str, set[int]] = {}
    for m in members:
        if "dp" in m.ranks:
            by_base.setdefault(parse_ranks(m.path)[0], set()).add(m.ranks["dp"])
    dp_sizes = _sizes(members, "dp")
    for base, ranks in by_base.items():
        want = max(dp_sizes | {max(ranks) + 1})
        missing = sorted(set(range(want)) - ranks)
        if missing:
            raise IncompatibleTracesError(f"trace set is missing DP rank {missing[0]} of "
                                          f"{os.path.basename(base)} (has {_list(ranks)}; expected 0..{want - 1})",
                                          path)
    # PP: per shard, stages 0..P-1, the same P everywhere
    stages: dict[str, set[int]] = {}
    for m in members:
        stages.setdefault(m.shard, set()).add(m.ranks.get("pp", 0))
    pp_sizes = _sizes(members, "pp")
    want_pp = max(pp_sizes | {max(max(s) for s in stages.values()) + 1})
    for shard, st in stages.items():
        missing = sorted(set(range(want_pp)) - st)
        if missing:
            raise IncompatibleTracesError(f"trace set is missing PP stage {missing[0]} of {os.path.basename(shard)} "
                                          f"(has stage{'s' if len(st) > 1 else ''} {_list(st)}; expected 0..{want_pp - 1})",
                                          path)
    # TP: per (shard, stage), ranks 0..T-1
    tps: dict[tuple[str, int], set[int]] = {}
    for m in members:
        if "tp" in m.ranks:
            tps.setdefault((m.shard, m.ranks.get("pp", 0)), set()).add(m.ranks["tp"])
    tp_sizes = _sizes(members, "tp")
    if tps:
        want_tp = max(tp_sizes | {max(max(s) for s in tps.values()) + 1})
        for (shard, pp), ranks in tps.items():
            missing = sorted(set(range(want_tp)) - ranks)
            if missing:
                stage = f" stage {pp}" if any("pp" in m.ranks for m in members) else ""
                raise IncompatibleTracesError(f"trace set is missing TP rank {missing[0]} of "
                                              f"{os.path.basename(shard)}{stage} (has {_list(ranks)}; expected "
                                              f"0..{want_tp - 1})", path)

