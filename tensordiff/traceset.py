"""A trace set: many per-rank or per-shard trace files read as one trace (numpy + h5py only).

``tensordiff diff A_DIR B_DIR`` (or a glob) opens every ``*.h5`` / ``*.hdf5`` file of a directory
as one :class:`TraceSet`, an object with the interface the aligner and the diff use of
:class:`~tensordiff.trace.TraceReader` (``tokens``, ``sequences``, ``tensors``, ``token_rows``,
``read_at``, ``read_values_at``, ...). It holds the member readers open and delegates every
tensor read to the member that holds the row: no tensor data is copied or rewritten.

How members combine (docs/distributed.md):

- File names carry the ranks the SGLang plugin gives them (``serve.dp1.pp0.tp1.h5``: ``.dp<k>``,
  ``.pp<k>``, ``.tp<k>`` before the extension); a file without them is its own shard.
- Members that differ in DP rank, or are different shards, hold different tokens: their token
  tables are united, and a (sequence, position) recorded by two of them is refused.
- Members that differ in PP rank hold different layers of the same tokens: their tensors are
  joined; every stage 0..P-1 must be present for every shard.
- Members that differ only in TP rank are replicas where they hold the same tensor at the same
  token (replicated TP), and shards where they hold different tokens (DP attention). Replicated
  rows are compared bit for bit (:meth:`TraceSet.check_replicas`) and the lowest rank's are used;
  a difference is a :class:`ReplicaMismatch`, which the diff reports as a divergence. The same
  holds for a tensor that two PP stages both recorded.

Bad sets (mixed models or sides, duplicate DP tokens, a missing stage or rank, files that disagree
on a token id, an empty directory) raise one-line errors (exit code 2 in the CLI).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .dtypes import to_float32
from .errors import IncompatibleTracesError, UsageError
from .trace import TOKEN_DTYPE, TensorInfo, TraceReader, slot_rms
from .vocab import REGIMES

if TYPE_CHECKING:
    from typing_extensions import Self

TRACE_EXTENSIONS = (".h5", ".hdf5")
SEQ_BITS = 40                      # same key as the aligner: seq << 40 | position
POS_MASK = (1 << SEQ_BITS) - 1
AXES = ("dp", "pp", "tp")
_SUFFIX = re.compile(r"\.(dp|pp|tp)(\d{1,6})$")
_GLOB_CHARS = re.compile(r"[*?\[]")
MODEL_KEYS = ("hidden_size", "num_layers", "architecture", "dtype")
REPLICA_BLOCK_ROWS = 4096
# tensor attributes that every member holding a tensor must agree on
_INFO_KEYS = ("kind", "dtype", "width", "slot_count", "slot_width", "slot_labels", "raw_ids", "convention",
              "boundary", "token_offset", "role", "has_values", "has_sketch", "order")


# ----------------------------------------------------------------------------------------------
# Paths
# ----------------------------------------------------------------------------------------------


def is_set_spec(spec: str) -> bool:
    """Whether ``spec`` names a trace set (a directory or a glob pattern), not one file."""
    spec = os.fspath(spec)
    return os.path.isdir(spec) or (not os.path.exists(spec) and bool(_GLOB_CHARS.search(spec)))


def set_paths(spec: str) -> list[str]:
    """The member files of a set spec, sorted; one line of error when there are none."""
    spec = os.fspath(spec)
    if os.path.isdir(spec):
        paths = [os.path.join(spec, n) for n in os.listdir(spec)
                 if n.lower().endswith(TRACE_EXTENSIONS) and os.path.isfile(os.path.join(spec, n))]
        top = os.path.realpath(spec)
        for p in paths:  # never follow a link out of the input
            if os.path.islink(p) and os.path.dirname(os.path.realpath(p)) != top:
                raise UsageError(f"{os.path.basename(p)} is a symbolic link out of the set's directory; "
                                 "copy the file in, or name it on its own", spec)
        if not paths:
            raise UsageError("no trace files (*.h5, *.hdf5) in this directory (empty trace set)", spec)
    else:
        paths = [p for p in glob.glob(spec) if os.path.isfile(p)]
        if not paths:
            raise UsageError("no such file or directory, and no file matches it as a pattern (empty trace set)", spec)
    return sorted(paths, key=_member_sort_key)


def trace_paths(spec: str) -> list[str]:
    """Every file a trace spec stands for: the file itself, or the members of a set (for the probe)."""
    return set_paths(spec) if is_set_spec(spec) else [os.fspath(spec)]


def open_trace(spec: str) -> TraceReader:
    """A :class:`TraceReader` for a file, a :class:`TraceSet` for a directory or a glob.

    Typed as a reader: a set has the interface the aligner and the diff use of one (duck-typed;
    a Protocol naming that interface would let both be typed exactly)."""
    if is_set_spec(spec):
        return cast(TraceReader, TraceSet(spec))
    return TraceReader(spec)


def parse_ranks(path: str) -> tuple[str, dict[str, int]]:
    """``d/serve.dp1.pp0.tp1.h5`` -> (``d/serve``, {dp: 1, pp: 0, tp: 1}); the suffixes in any order."""
    root, ext = os.path.splitext(path)
    if ext.lower() not in TRACE_EXTENSIONS:
        root = path
    ranks: dict[str, int] = {}
    while True:
        m = _SUFFIX.search(root)
        if m is None:
            break
        axis = m.group(1)
        if axis in ranks:
            raise UsageError(f"the file name gives the {axis.upper()} rank twice", path)
        ranks[axis] = int(m.group(2))
        root = root[:m.start()]
    return root, ranks


def _member_sort_key(path: str) -> tuple[str, int, int, int]:
    try:
        base, ranks = parse_ranks(path)
    except UsageError:
        base, ranks = path, {}
    return (base, ranks.get("dp", -1), ranks.get("pp", -1), ranks.get("tp", -1))


# ----------------------------------------------------------------------------------------------
# Members and replica findings
# ----------------------------------------------------------------------------------------------


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


@dataclass
class ReplicaMismatch:
    """Replicated rows of one tensor that are not bit-identical: what the diff turns into a finding.

    ``axis``: ``tp`` (TP replicas) or ``pp`` (two PP stages recorded the same tensor). ``primary``
    is the file whose rows the set uses; ``replica`` the one that differs from it."""

    tensor: str
    order: float
    axis: str
    primary: str
    replica: str
    part: str                 # values or sketch
    rows: int                 # replicated rows compared
    differing: int            # of them, not bit-identical
    seq: str
    position: int
    token: int
    regime: str
    max_abs: float
    cos_min: float

    def sentence(self, side: str) -> str:
        what = "TP replicas" if self.axis == "tp" else "PP stages"
        return (f"{what} of {side} disagree: {self.tensor} in {os.path.basename(self.replica)} differs from "
                f"{os.path.basename(self.primary)} (the one compared) in {self.differing} of {self.rows} replicated "
                f"rows, first at token {self.token} (seq {self.seq}, position {self.position}); max abs "
                f"{self.max_abs:.3g}, cos {self.cos_min:.6f}: the replicas are not equal, so this side's verdict "
                "depends on which one is read")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ReplicaTask:
    """Replicated rows to compare, in member terms only (picklable: paths and row indices)."""

    tensor: str
    group: int                # which replicated (primary, replica) pair of files of this tensor
    part: str
    dtype: str
    primary: str
    replica: str
    rows_primary: np.ndarray
    rows_replica: np.ndarray
    start: int                # where these rows start in the group's replicated rows
    host: str | None = None   # the host that wrote the replica (for placement)


@dataclass
class ReplicaPartial:
    """What comparing one :class:`ReplicaTask` found (picklable)."""

    tensor: str
    group: int
    rows: int
    differing: int
    first: int                # index into the group's replicated rows of the first differing one, -1 if none
    max_abs: float
    cos_min: float


def compare_replica_rows(task: ReplicaTask, open_reader: Callable[[str], TraceReader]) -> ReplicaPartial:
    """Compare the stored bits of replicated rows; the size of any difference in float32."""
    rp, rr = open_reader(task.primary), open_reader(task.replica)
    differing, first, max_abs, cos_min = 0, -1, 0.0, 1.0
    n = len(task.rows_primary)
    for s0 in range(0, n, REPLICA_BLOCK_ROWS):
        ip = task.rows_primary[s0:s0 + REPLICA_BLOCK_ROWS]
        ir = task.rows_replica[s0:s0 + REPLICA_BLOCK_ROWS]
        a = np.ascontiguousarray(rp.read_at(task.tensor, task.part, ip))
        b = np.ascontiguousarray(rr.read_at(task.tensor, task.part, ir))
        uint = np.dtype(f"u{a.dtype.itemsize}")
        bad = (a.view(uint) != b.view(uint)).reshape(len(a), -1).any(axis=1)
        if not bad.any():
            continue
        if first < 0:
            first = task.start + s0 + int(np.argmax(bad))
        differing += int(bad.sum())
        if task.part == "values":
            fa, fb = to_float32(a[bad], task.dtype), to_float32(b[bad], task.dtype)
        else:
            fa, fb = np.asarray(a[bad], np.float32), np.asarray(b[bad], np.float32)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            d = np.abs(fa.astype(np.float64) - fb.astype(np.float64))
            fin = np.isfinite(d)
            if fin.any():
                max_abs = max(max_abs, float(d[fin].max()))
            num = np.einsum("ij,ij->i", fa.astype(np.float64), fb.astype(np.float64))
            den = np.sqrt(np.einsum("ij,ij->i", fa.astype(np.float64), fa.astype(np.float64))
                          * np.einsum("ij,ij->i", fb.astype(np.float64), fb.astype(np.float64)))
            cos = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.where(num == 0, 1.0, 0.0))
            cos = np.where(np.isfinite(cos), cos, -1.0)
        cos_min = min(cos_min, float(cos.min()))
    return ReplicaPartial(task.tensor, task.group, n, differing, first, max_abs, cos_min)


# ----------------------------------------------------------------------------------------------
# The set's view of one tensor
# ----------------------------------------------------------------------------------------------


@dataclass
class _Segment:
    member: int
    start: int                      # first virtual row of this segment
    rows: int
    sel: np.ndarray | None          # member rows (None: all of them, in order)

    def member_rows(self, local: np.ndarray) -> np.ndarray:
        return local if self.sel is None else self.sel[local]


@dataclass
class _Replicated:
    primary: int
    replica: int
    axis: str
    rows_primary: np.ndarray
    rows_replica: np.ndarray
    codes: np.ndarray               # set code of each replicated row (for the first mismatch)


@dataclass
class _PartShape:
    """Shape and dtype of a tensor part across the set (what callers read of an h5py dataset)."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    chunks: tuple[int, ...] | None = None


class _VirtualTensor:
    def __init__(self, info: TensorInfo, segments: list[_Segment], replicated: list[_Replicated],
                 parts: dict[str, _PartShape]):
        self.info = info
        self.segments = segments
        self.starts = np.array([s.start for s in segments], np.int64)
        self.replicated = replicated
        self.parts = parts


def _last_per_code(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique codes and, for each, the index of its last occurrence."""
    rev = codes[::-1]
    uniq, first_rev = np.unique(rev, return_index=True)
    return uniq, len(codes) - 1 - first_rev


# ----------------------------------------------------------------------------------------------
# The set
# ----------------------------------------------------------------------------------------------


class TraceSet:
    """Many trace files read as one trace; see the module docstring for how they combine."""

    def __init__(self, spec: str | Sequence[str]):
        if isinstance(spec, (str, os.PathLike)):
            self.path = os.fspath(spec)
            paths = set_paths(self.path)
        else:
            paths = sorted((os.fspath(p) for p in spec), key=_member_sort_key)
            if not paths:
                raise UsageError("an empty trace set (no files given)")
            self.path = os.path.commonpath(paths) if len(paths) > 1 else paths[0]
        self.members: list[Member] = []
        try:
            for i, p in enumerate(paths):
                base, ranks = parse_ranks(p)
                r = TraceReader(p)
                self.members.append(Member(i, p, r, ranks, shard="", host=_host_of(r)))
                self._check_meta_ranks(self.members[-1])
                self.members[-1].shard = base + (f".dp{ranks['dp']}" if "dp" in ranks else "")
            self._check_headers()
            self._check_layout()
            self._merge_tokens()
            self._merge_tensors()
        except BaseException:
            self.close()
            raise
        self._replica_result: list[ReplicaMismatch] | None = None

    # -- construction --------------------------------------------------------------------------

    def _check_meta_ranks(self, m: Member) -> None:
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

    def _check_headers(self) -> None:
        first = self.members[0]
        r0 = first.reader
        for m in self.members[1:]:
            r = m.reader
            if r.side != r0.side:
                raise IncompatibleTracesError(f"trace set mixes sides: {m.name} is {r.side}, {first.name} is {r0.side}",
                                              self.path)
            for key in MODEL_KEYS:
                va, vb = r0.model.get(key), r.model.get(key)
                if va is not None and vb is not None and va != vb:
                    raise IncompatibleTracesError(f"trace set mixes models: {m.name} has {key} {vb!r}, {first.name} has "
                                                  f"{va!r}", self.path)
            if (r.sketch_seed, r.sketch_dim) != (r0.sketch_seed, r0.sketch_dim):
                raise IncompatibleTracesError(f"trace set mixes sketch projections: {m.name} has seed {r.sketch_seed} "
                                              f"dim {r.sketch_dim}, {first.name} seed {r0.sketch_seed} dim {r0.sketch_dim}",
                                              self.path)

    def _sizes(self, axis: str) -> set[int]:
        out = set()
        for m in self.members:
            facts = m.reader.user_meta.get("ranks")
            v = facts.get(f"{axis}_size") if isinstance(facts, dict) else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 1 and axis in m.ranks:
                out.add(v)
        return out

    def _check_layout(self) -> None:
        """Every stage of every shard, every DP rank and every TP rank that the names and the
        recorders' facts promise is present; naming is consistent."""
        for axis in ("pp", "tp"):
            has = {axis in m.ranks for m in self.members}
            if len(has) > 1:
                named = next(m for m in self.members if axis in m.ranks)
                bare = next(m for m in self.members if axis not in m.ranks)
                raise IncompatibleTracesError(f"trace set mixes files with and without a {axis.upper()} rank "
                                              f"({named.name}, {bare.name})", self.path)
        for axis in AXES:
            sizes = self._sizes(axis)
            if len(sizes) > 1:
                raise IncompatibleTracesError(f"trace set mixes recordings: the files say {axis}_size "
                                              f"{' and '.join(map(str, sorted(sizes)))}", self.path)
        # DP: per base name, ranks 0..D-1
        by_base: dict[str, set[int]] = {}
        for m in self.members:
            if "dp" in m.ranks:
                by_base.setdefault(parse_ranks(m.path)[0], set()).add(m.ranks["dp"])
        dp_sizes = self._sizes("dp")
        for base, ranks in by_base.items():
            want = max(dp_sizes | {max(ranks) + 1})
            missing = sorted(set(range(want)) - ranks)
            if missing:
                raise IncompatibleTracesError(f"trace set is missing DP rank {missing[0]} of "
                                              f"{os.path.basename(base)} (has {_list(ranks)}; expected 0..{want - 1})",
                                              self.path)
        # PP: per shard, stages 0..P-1, the same P everywhere
        stages: dict[str, set[int]] = {}
        for m in self.members:
            stages.setdefault(m.shard, set()).add(m.ranks.get("pp", 0))
        pp_sizes = self._sizes("pp")
        want_pp = max(pp_sizes | {max(max(s) for s in stages.values()) + 1})
        for shard, st in stages.items():
            missing = sorted(set(range(want_pp)) - st)
            if missing:
                raise IncompatibleTracesError(f"trace set is missing PP stage {missing[0]} of {os.path.basename(shard)} "
                                              f"(has stage{'s' if len(st) > 1 else ''} {_list(st)}; expected 0..{want_pp - 1})",
                                              self.path)
        # TP: per (shard, stage), ranks 0..T-1
        tps: dict[tuple[str, int], set[int]] = {}
        for m in self.members:
            if "tp" in m.ranks:
                tps.setdefault((m.shard, m.ranks.get("pp", 0)), set()).add(m.ranks["tp"])
        tp_sizes = self._sizes("tp")
        if tps:
            want_tp = max(tp_sizes | {max(max(s) for s in tps.values()) + 1})
            for (shard, pp), ranks in tps.items():
                missing = sorted(set(range(want_tp)) - ranks)
                if missing:
                    stage = f" stage {pp}" if any("pp" in m.ranks for m in self.members) else ""
                    raise IncompatibleTracesError(f"trace set is missing TP rank {missing[0]} of "
                                                  f"{os.path.basename(shard)}{stage} (has {_list(ranks)}; expected "
                                                  f"0..{want_tp - 1})", self.path)

    def _merge_tokens(self) -> None:
        seq_index: dict[str, int] = {}
        self.sequences: list[str] = []
        parts = []
        offset = 0
        for m in self.members:
            r = m.reader
            smap = np.empty(len(r.sequences), np.int64)
            for i, key in enumerate(r.sequences):
                j = seq_index.get(key)
                if j is None:
                    j = seq_index[key] = len(self.sequences)
                    self.sequences.append(key)
                smap[i] = j
            m.seq_map = smap
            t = r.tokens
            tok = np.zeros(len(t), TOKEN_DTYPE)
            for col in TOKEN_DTYPE.names or ():
                tok[col] = t[col]
            if len(t):
                tok["seq"] = smap[t["seq"]]
            m.codes = (tok["seq"].astype(np.int64) << SEQ_BITS) | tok["position"].astype(np.int64)
            m.tok_offset = offset
            offset += len(t)
            parts.append(tok)
        if len(self.sequences) >= 1 << (62 - SEQ_BITS):
            raise IncompatibleTracesError(f"trace set has {len(self.sequences)} sequences; too many for one trace",
                                          self.path)
        self.tokens = np.concatenate(parts) if parts else np.empty(0, TOKEN_DTYPE)
        # canonical token of each code per member (the last row wins, as in one file)
        canon = []
        for m in self.members:
            if len(m.codes):
                uniq, last = _last_per_code(m.codes)
                canon.append((uniq, m.reader.tokens["token"][last].astype(np.int64), m))
        self._check_shards_disjoint(canon)
        self._check_tokens_agree(canon)

    def _check_shards_disjoint(self, canon: list[tuple[np.ndarray, np.ndarray, Member]]) -> None:
        shards = sorted({m.shard for _, _, m in canon})
        if len(shards) < 2:
            return
        sid = {s: i for i, s in enumerate(shards)}
        codes, owner = [], []
        for s in shards:
            u = np.unique(np.concatenate([c for c, _, m in canon if m.shard == s]))
            codes.append(u)
            owner.append(np.full(len(u), sid[s], np.int64))
        c, o = np.concatenate(codes), np.concatenate(owner)
        order = np.argsort(c, kind="stable")
        c, o = c[order], o[order]
        dup = np.flatnonzero((c[1:] == c[:-1]) & (o[1:] != o[:-1]))
        if len(dup):
            j = int(dup[0])
            code = int(c[j])
            n = len(dup)
            a, b = shards[int(o[j])], shards[int(o[j + 1])]
            raise IncompatibleTracesError(
                f"duplicate tokens across DP ranks or shards: sequence {self.sequences[code >> SEQ_BITS]} position "
                f"{code & POS_MASK} is in {os.path.basename(a)} and {os.path.basename(b)} ({n} token"
                f"{'s' if n > 1 else ''} in two shards); the token tables of DP ranks must not overlap", self.path)

    def _check_tokens_agree(self, canon: list[tuple[np.ndarray, np.ndarray, Member]]) -> None:
        if len(canon) < 2:
            return
        c = np.concatenate([u for u, _, _ in canon])
        t = np.concatenate([tk for _, tk, _ in canon])
        who = np.concatenate([np.full(len(u), m.index, np.int64) for u, _, m in canon])
        order = np.lexsort((who, c))
        c, t, who = c[order], t[order], who[order]
        bad = np.flatnonzero((c[1:] == c[:-1]) & (t[1:] != t[:-1]))
        if len(bad):
            j = int(bad[0])
            code = int(c[j])
            ma, mb = self.members[int(who[j])], self.members[int(who[j + 1])]
            raise IncompatibleTracesError(
                f"files of the set disagree on a token: sequence {self.sequences[code >> SEQ_BITS]} position "
                f"{code & POS_MASK} is token {int(t[j])} in {ma.name} but {int(t[j + 1])} in {mb.name} "
                f"({len(bad)} such tokens): not one recording", self.path)

    def _merge_tensors(self) -> None:
        names: dict[str, list[Member]] = {}
        for m in self.members:
            for name in m.reader.tensors:
                names.setdefault(name, []).append(m)
        self.tensors: dict[str, TensorInfo] = {}
        self._vt: dict[str, _VirtualTensor] = {}
        self._ds: dict[str, dict[str, _PartShape]] = {}
        self._rows_cache: dict[str, np.ndarray] = {}
        for name, holders in names.items():
            vt = self._virtual_tensor(name, holders)
            self._vt[name] = vt
            self.tensors[name] = vt.info
            self._ds[name] = vt.parts

    def _virtual_tensor(self, name: str, holders: list[Member]) -> _VirtualTensor:
        first = holders[0]
        i0 = first.reader.tensors[name]
        for m in holders[1:]:
            i = m.reader.tensors[name]
            for key in _INFO_KEYS:
                va, vb = getattr(i0, key), getattr(i, key)
                if va != vb:
                    raise IncompatibleTracesError(f"tensor {name!r} differs between {first.name} and {m.name} ({key} "
                                                  f"{va!r} vs {vb!r}): not one recording", self.path)
        segments: list[_Segment] = []
        replicated: list[_Replicated] = []
        # per shard: codes already held (sorted) and where the primary row of each lives
        held: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        start = 0
        for m in holders:
            r = m.reader
            trow = r.token_rows(name)
            codes = m.codes[trow] if len(trow) else np.zeros(0, np.int64)
            prev = held.get(m.shard)
            sel: np.ndarray | None = None
            if prev is not None and len(codes):
                pc, pm, pr = prev
                pos = np.searchsorted(pc, codes)
                pos_c = np.minimum(pos, max(len(pc) - 1, 0))
                dup = (pc[pos_c] == codes) if len(pc) else np.zeros(len(codes), bool)
                if dup.any():
                    # the replica's last row per code against the primary's last row per code
                    dup_idx = np.flatnonzero(dup)
                    uc, last = _last_per_code(codes[dup_idx])
                    rep_rows = dup_idx[last]
                    ppos = np.searchsorted(pc, uc)
                    prim_members, prim_rows = pm[ppos], pr[ppos]
                    for pmi in np.unique(prim_members):
                        s = prim_members == pmi
                        pmem = self.members[int(pmi)]
                        axis = "tp" if pmem.ranks.get("pp", 0) == m.ranks.get("pp", 0) else "pp"
                        replicated.append(_Replicated(int(pmi), m.index, axis, prim_rows[s], rep_rows[s], uc[s]))
                    sel = np.flatnonzero(~dup)
            n = len(codes) if sel is None else len(sel)
            if n:
                segments.append(_Segment(m.index, start, n, sel))
                start += n
            # what this member now holds for its shard
            mine = codes if sel is None else codes[sel]
            mine_rows = np.arange(len(codes), dtype=np.int64) if sel is None else sel
            if len(mine):
                uc, last = _last_per_code(mine)
                new = (uc, np.full(len(uc), m.index, np.int64), mine_rows[last])
                if prev is None:
                    held[m.shard] = new
                else:
                    c = np.concatenate([prev[0], new[0]])
                    order = np.argsort(c, kind="stable")
                    held[m.shard] = (c[order], np.concatenate([prev[1], new[1]])[order],
                                     np.concatenate([prev[2], new[2]])[order])
        info = dataclasses.replace(i0, rows=start)
        parts: dict[str, _PartShape] = {}
        for part in ("values", "sketch", "rms"):
            dsets = [m.reader._ds[name].get(part) for m in holders]
            if all(d is not None for d in dsets):
                d0 = dsets[0]
                assert d0 is not None
                parts[part] = _PartShape((start,) + tuple(d0.shape[1:]), d0.dtype, getattr(d0, "chunks", None))
        parts["rows"] = _PartShape((start,), np.dtype(np.int64))
        return _VirtualTensor(info, segments, replicated, parts)

    # -- the reader interface ------------------------------------------------------------------

    @property
    def _r0(self) -> TraceReader:
        return self.members[0].reader

    @property
    def side(self) -> str:
        return self._r0.side

    @property
    def schema(self) -> int:
        return int(self._r0.schema)

    @property
    def sketch_seed(self) -> int:
        return int(self._r0.sketch_seed)

    @property
    def sketch_dim(self) -> int:
        return int(self._r0.sketch_dim)

    @property
    def model(self) -> dict[str, Any]:
        return dict(self._r0.model)

    @property
    def versions(self) -> dict[str, Any]:
        return dict(self._r0.versions)

    @property
    def user_meta(self) -> dict[str, Any]:
        """The metadata every member agrees on (rank facts and hosts differ: they are in the index)."""
        common = dict(self._r0.user_meta)
        for m in self.members[1:]:
            um = m.reader.user_meta
            common = {k: v for k, v in common.items() if k in um and um[k] == v}
        return common

    @property
    def producer(self) -> str:
        return "; ".join(dict.fromkeys(m.reader.producer for m in self.members if m.reader.producer))

    @property
    def created(self) -> str:
        c = [m.reader.created for m in self.members if m.reader.created]
        return min(c) if c else ""

    @property
    def complete(self) -> bool:
        return all(m.reader.complete for m in self.members)

    @property
    def recovered_note(self) -> str | None:
        notes = [(m, m.reader.recovered_note) for m in self.members if getattr(m.reader, "recovered_note", None)]
        if not notes:
            return None
        return (f"{len(notes)} of {len(self.members)} files were not closed cleanly: "
                + "; ".join(f"{m.name}: {n}" for m, n in notes))

    @property
    def file_size(self) -> int:
        return sum(int(m.reader.file_size) for m in self.members)

    @property
    def hidden_size(self) -> int | None:
        return self._r0.hidden_size

    @property
    def num_layers(self) -> int | None:
        return self._r0.num_layers

    def token_rows(self, name: str) -> np.ndarray:
        """Set token-table row of every (set) row of tensor ``name``."""
        rows = self._rows_cache.get(name)
        if rows is None:
            vt = self._vt[name]
            parts = []
            for seg in vt.segments:
                m = self.members[seg.member]
                tr = m.reader.token_rows(name)
                parts.append((tr if seg.sel is None else tr[seg.sel]) + m.tok_offset)
            rows = np.concatenate(parts) if parts else np.zeros(0, np.int64)
            self._rows_cache[name] = rows
        return rows

    def locate(self, name: str, idx: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Where set rows ``idx`` of ``name`` live: (member index, positions in ``idx``, member rows),
        one entry per member, positions ascending."""
        vt = self._vt[name]
        idx = np.asarray(idx, dtype=np.int64)
        if len(idx) == 0:
            return []
        if len(idx) and (idx.min() < 0 or idx.max() >= vt.info.rows):
            raise IndexError(f"rows of {name} out of range")
        seg_of = np.searchsorted(vt.starts, idx, side="right") - 1
        if (seg_of == seg_of[0]).all():
            seg = vt.segments[int(seg_of[0])]
            return [(seg.member, np.arange(len(idx)), seg.member_rows(idx - seg.start))]
        out: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        for si in np.unique(seg_of):
            seg = vt.segments[int(si)]
            pos = np.flatnonzero(seg_of == si)
            out.setdefault(seg.member, []).append((pos, seg.member_rows(idx[pos] - seg.start)))
        res = []
        for mi, lst in out.items():
            pos = np.concatenate([p for p, _ in lst])
            rows = np.concatenate([r for _, r in lst])
            order = np.argsort(pos, kind="stable")
            res.append((mi, pos[order], rows[order]))
        return res

    def read_at(self, name: str, part: str, idx: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``name/part`` at set row indices (any order, repeats allowed), stored form;
        each member reads its own rows."""
        shape = self._ds[name].get(part)
        if shape is None or part == "rows":
            raise IncompatibleTracesError(f"tensor {name!r} has no {part}", self.path)
        idx = np.asarray(idx, dtype=np.int64)
        where = self.locate(name, idx)
        if len(where) == 1:
            mi, _, rows = where[0]
            return self.members[mi].reader.read_at(name, part, rows, out=out)
        n = len(idx)
        tail = tuple(shape.shape[1:])
        if out is not None and out.dtype == shape.dtype and out.size >= n * int(np.prod(tail, dtype=np.int64)):
            dest = out.reshape(-1)[:n * int(np.prod(tail, dtype=np.int64))].reshape((n,) + tail)
        else:
            dest = np.empty((n,) + tail, shape.dtype)
        for mi, pos, rows in where:
            dest[pos] = self.members[mi].reader.read_at(name, part, rows)
        return dest

    def read_values_at(self, name: str, idx: np.ndarray, *, raw: bool = False,
                       out: np.ndarray | None = None) -> np.ndarray:
        block = self.read_at(name, "values", idx)
        return block if raw else to_float32(block, self.tensors[name].dtype, out)

    def _range(self, name: str, start: int, stop: int | None) -> np.ndarray:
        n = self.tensors[name].rows
        lo, hi, _ = slice(start, stop).indices(n)
        return np.arange(lo, max(lo, hi), dtype=np.int64)

    def read_values(self, name: str, start: int = 0, stop: int | None = None, *, raw: bool = False) -> np.ndarray:
        return self.read_values_at(name, self._range(name, start, stop), raw=raw)

    def read_sketch(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        return np.asarray(self.read_at(name, "sketch", self._range(name, start, stop)), dtype=np.float32)

    def read_rms(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        if "rms" not in self._ds[name]:
            return slot_rms(self.read_values(name, start, stop), self.tensors[name].slot_width)
        return np.asarray(self.read_at(name, "rms", self._range(name, start, stop)), dtype=np.float32)

    def has_part(self, name: str, part: str) -> bool:
        return part in self._ds.get(name, {})

    def touch(self) -> None:
        for m in self.members:
            t = getattr(m.reader, "touch", None) or m.reader._touch  # renamed in the trace package
            t()

    _touch = touch

    def close(self) -> None:
        for m in self.members:
            m.reader.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- replicas ------------------------------------------------------------------------------

    @property
    def replicated_rows(self) -> int:
        return sum(len(rp.rows_primary) for vt in self._vt.values() for rp in vt.replicated)

    def replica_tasks(self, block_rows: int = 1 << 16) -> list[ReplicaTask]:
        """The replica comparisons, in pieces of at most ``block_rows`` rows (for worker pools)."""
        tasks = []
        for name, vt in self._vt.items():
            info = vt.info
            part = "values" if info.has_values else "sketch"
            for g, rp in enumerate(vt.replicated):
                n = len(rp.rows_primary)
                for s0 in range(0, n, block_rows):
                    tasks.append(ReplicaTask(name, g, part, info.dtype, self.members[rp.primary].path,
                                             self.members[rp.replica].path, rp.rows_primary[s0:s0 + block_rows],
                                             rp.rows_replica[s0:s0 + block_rows], s0,
                                             self.members[rp.replica].host))
        return tasks

    def replica_mismatches(self, partials: Sequence[ReplicaPartial]) -> list[ReplicaMismatch]:
        """Merge partial comparisons (in any order) into one mismatch per (tensor, replica file)
        whose rows are not all bit-identical to the primary's, in forward order."""
        groups: dict[tuple[str, int], list[ReplicaPartial]] = {}
        for p in partials:
            groups.setdefault((p.tensor, p.group), []).append(p)
        out: list[ReplicaMismatch] = []
        for (name, g), mine in groups.items():
            differing = sum(p.differing for p in mine)
            if not differing:
                continue
            vt = self._vt[name]
            rp = vt.replicated[g]
            first = min(p.first for p in mine if p.first >= 0)
            code = int(rp.codes[first])
            m = self.members[rp.replica]
            tok = m.reader.tokens
            trow = int(m.reader.token_rows(name)[int(rp.rows_replica[first])])
            out.append(ReplicaMismatch(
                tensor=name, order=vt.info.order, axis=rp.axis, primary=self.members[rp.primary].path,
                replica=m.path, part="values" if vt.info.has_values else "sketch",
                rows=sum(p.rows for p in mine), differing=differing, seq=self.sequences[code >> SEQ_BITS],
                position=code & POS_MASK, token=int(tok["token"][trow]), regime=REGIMES[int(tok["regime"][trow])],
                max_abs=max(p.max_abs for p in mine), cos_min=min(p.cos_min for p in mine)))
        out.sort(key=lambda x: (x.order, x.tensor, x.replica))
        return out

    def check_replicas(self, progress: Callable[[str, int, int], None] | None = None) -> list[ReplicaMismatch]:
        """Compare every replicated row (serially, in this process); cached."""
        if self._replica_result is None:
            readers = {m.path: m.reader for m in self.members}
            tasks = self.replica_tasks()
            partials = []
            for i, t in enumerate(tasks):
                if progress is not None:
                    progress("checking replicas", i, len(tasks))
                partials.append(compare_replica_rows(t, readers.__getitem__))
            self._replica_result = self.replica_mismatches(partials)
        return self._replica_result

    # -- index and summary ---------------------------------------------------------------------

    def index(self) -> dict[str, Any]:
        """Which file holds which sequences, tensors, ranks, and the host that wrote it."""
        layout = {a: len({m.ranks[a] for m in self.members if a in m.ranks}) for a in AXES}
        files = []
        for m in self.members:
            r = m.reader
            keys = [r.sequences[i] for i in np.unique(r.tokens["seq"])] if len(r.tokens) else []
            files.append({
                "path": m.path, "file": m.name, "ranks": dict(m.ranks), "shard": os.path.basename(m.shard),
                "host": m.host, "bytes": int(r.file_size), "complete": bool(r.complete),
                "token_rows": len(r.tokens), "sequences": len(keys), "sequence_keys": keys[:1000],
                "tensors": sorted(r.tensors, key=lambda n: (r.tensors[n].order, n)),
            })
        replicas = []
        for name, vt in self._vt.items():
            for rp in vt.replicated:
                replicas.append({"tensor": name, "axis": rp.axis, "primary": self.members[rp.primary].name,
                                 "replica": self.members[rp.replica].name, "rows": len(rp.rows_primary)})
        distinct = len(np.unique(np.concatenate([m.codes for m in self.members]))) if len(self.tokens) else 0
        return {"files": files, "layout": layout, "shards": len({m.shard for m in self.members}),
                "token_rows": len(self.tokens), "distinct_tokens": distinct,
                "hosts": sorted({m.host for m in self.members if m.host}), "replicas": replicas,
                "replica_check": ("every replicated row is compared bit for bit by `tensordiff diff`"
                                  if replicas else "no replicated rows")}

    def summary(self) -> dict[str, Any]:
        """What ``tensordiff info`` shows: the reader's summary of the merged trace plus the index."""
        t = self.tokens
        regimes = {REGIMES[c]: int(n) for c, n in zip(*np.unique(t["regime"], return_counts=True))} if len(t) else {}
        seqs = []
        if len(t):
            order = np.argsort(t["seq"], kind="stable")
            sq = t["seq"][order]
            cuts = np.flatnonzero(np.diff(sq)) + 1
            for part in np.split(order, cuts)[:1000]:
                pos = t["position"][part]
                seqs.append({"key": self.sequences[int(t["seq"][part[0]])], "rows": len(part),
                             "positions": [int(pos.min()), int(pos.max())]})
        tensors = []
        for info in sorted(self.tensors.values(), key=lambda i: (i.order, i.name)):
            entry: dict[str, Any] = {"name": info.name, "kind": info.kind, "label": info.label, "dtype": info.dtype,
                                     "shape": [info.rows, info.width], "order": info.order, "values": info.has_values,
                                     "sketch": info.has_sketch, "role": info.role}
            if info.slot_count > 1 or info.slot_labels:
                entry.update(slots=info.slot_count, slot_width=info.slot_width, slot_labels=info.slot_labels,
                             raw_ids=info.raw_ids, convention=info.convention)
            if info.token_offset:
                entry["token_offset"] = info.token_offset
            if info.attrs:
                entry["attrs"] = info.attrs
            tensors.append(entry)
        return {
            "path": self.path, "schema": self.schema, "side": self.side, "producer": self.producer,
            "created": self.created, "complete": self.complete, "recovered": self.recovered_note,
            "model": self.model, "versions": self.versions, "user_meta": self.user_meta,
            "sketch": {"seed": self.sketch_seed, "dim": self.sketch_dim},
            "tokens": {"rows": len(t), "sequences": len(self.sequences), "regimes": regimes},
            "sequences": seqs, "tensors": tensors, "set": self.index(),
        }


def _host_of(r: TraceReader) -> str | None:
    """The host that wrote a file: ``user_meta["host"]`` (or ``user_meta["ranks"]["host"]``)."""
    um = r.user_meta
    h = um.get("host")
    if h is None and isinstance(um.get("ranks"), dict):
        h = um["ranks"].get("host")
    return str(h)[:256] if isinstance(h, str) and h else None


def _list(xs: set[int]) -> str:
    return ", ".join(map(str, sorted(xs)))


def index_lines(index: dict[str, Any]) -> Iterator[str]:
    """The index of a set as plain text lines (``tensordiff info`` prints them after the summary)."""
    lay = index["layout"]
    shape = ", ".join(f"{a.upper()}={n}" for a, n in lay.items() if n) or "no rank suffixes"
    hosts = index["hosts"]
    yield (f"trace set: {len(index['files'])} files, {index['shards']} token shard{'s' if index['shards'] != 1 else ''}"
           f" ({shape}), {index['distinct_tokens']} distinct tokens in {index['token_rows']} token rows; hosts: "
           f"{', '.join(hosts) if hosts else 'not recorded'}")
    for f in index["files"]:
        keys = f["sequence_keys"]
        shown = ", ".join(keys[:3]) + (f" +{f['sequences'] - 3} more" if f["sequences"] > 3 else "")
        tens = f["tensors"]
        tshown = ", ".join(tens[:4]) + (f" +{len(tens) - 4} more" if len(tens) > 4 else "")
        ranks = " ".join(f"{a}{f['ranks'][a]}" for a in AXES if a in f["ranks"]) or "-"
        yield (f"  {f['file']}: ranks {ranks}, host {f['host'] or '-'}, {f['token_rows']} token rows in "
               f"{f['sequences']} sequences ({shown or '-'}); tensors {tshown or '-'}"
               + ("" if f["complete"] else "; NOT closed cleanly"))
    reps = index["replicas"]
    if reps:
        rows = sum(r["rows"] for r in reps)
        yield (f"  replicas: {len(reps)} (tensor, file) pairs, {rows} rows held twice; {index['replica_check']}")
