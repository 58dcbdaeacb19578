"""The diff, end to end: open two traces, check they describe the same model, align tokens and
pair tensors (:mod:`tensordiff.align`), find what each packed slot holds
(:mod:`tensordiff.identity`), stream the numerics block by block (:mod:`tensordiff.numerics`),
hand each block to the sinks (the TUI's summary file), and order the findings
(:mod:`tensordiff.findings`). Progress is reported through a callback, which may raise to cancel.

A is the reference (what was expected, usually the train side), B the side under test.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
from numpy.typing import NDArray

from . import acceptance, noise, noise_io
from .align import (
    RowMaps,
    SideTokens,
    TokenAlignment,
    align_tokens,
    pair_tensors,
    sample_indices,
)
from .catalog import IdentitySearch, SlotScores, noise_floors
from .errors import IncompatibleTracesError, TensordiffError
from .findings import (
    Details,
    DiffResult,
    Finding,
    GapDetails,
    IdentityDetails,
    Kind,
    MissingDetails,
    NonfiniteDetails,
    NumericDetails,
    PairingDetails,
    PairStats,
    RecoveredDetails,
    ReplicaDetails,
    Severity,
    ShiftDetails,
    SlotRow,
    TokenMismatchDetails,
    order_findings,
)
from .identity import IdentityVerdict, NoiseFloor
from .numerics import BlockMetrics, PairAccumulator, WorstTokens, rows_per_block
from .slots import judge_slot
from .tolerances import ToleranceBook, allow_failed
from .trace import TensorInfo, TraceReader
from .traceset import open_trace
from .vocab import REGIMES, parse_label

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import Self

BLOCK_ROWS = 4096
IDENTITY_SAMPLE = 256
BOUNDARY_SAMPLE = 64   # sampled tokens of a disagreeing boundary's identity search
#: score a disagreeing boundary's identity search in a thread while the numeric pass goes on
#: (Differ._start_identity); False: after it, in this thread (the same verdicts, for the tests)
OVERLAP_IDENTITY = True

Codes = NDArray[np.int64]
T = TypeVar("T")


class DiffSink(Protocol):
    """Receives every compared block: ``m`` the per-token metrics [n, k] of tensor pair (ia, ib) at
    aligned indices ``blk``, ``bad`` the tokens that fail. The summary file is one."""

    def write(self, ia: TensorInfo, ib: TensorInfo, k: int, blk: Codes, m: dict[str, np.ndarray],
              bad: np.ndarray) -> None: ...

    def close(self) -> None: ...


#: makes a sink once the tokens are aligned
SinkFactory = Callable[[TokenAlignment, TraceReader, TraceReader], DiffSink]


def summary_sink(path: str) -> SinkFactory:
    """The sink that writes the per-token summary file the TUI reads."""
    def make(al: TokenAlignment, ra: TraceReader, rb: TraceReader) -> DiffSink:
        from .summary import SummaryWriter
        return SummaryWriter(path, al, ra, rb)
    return make


@dataclass
class DiffOptions:
    tolerances: ToleranceBook = field(default_factory=ToleranceBook)
    block_rows: int = BLOCK_ROWS
    identity_sample: int = IDENTITY_SAMPLE
    summary_path: str | None = None       # shorthand for a summary_sink in ``sinks``
    progress: Callable[[str, int, int], None] | None = None   # (stage, done, total); may raise to cancel
    sinks: list[SinkFactory] = field(default_factory=list)
    numeric: Any = None   # a backend of tensordiff.parallel running the numeric pass; None: this process


class Differ:
    def __init__(self, path_a: str, path_b: str, options: DiffOptions | None = None):
        self.opt = options or DiffOptions()
        self.ra = open_trace(path_a)  # a file, or a trace set (directory or glob)
        try:
            self.rb = open_trace(path_b)
        except TensordiffError:
            self.ra.close()
            raise
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensordiff-read")
        # identity searches of disagreeing boundaries, scored while the numeric pass runs (see
        # _start_identity); the lock keeps their reads and the block reader's apart
        self._id_pool: ThreadPoolExecutor | None = None
        self._early: dict[tuple[str, str], tuple[Codes, Future[SlotScores]]] = {}
        self._early_done = [0, 0]   # (candidates, of) the running search has laid out: for progress
        self._stopping = threading.Event()
        self._read_lock: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        self.early_identities = 0   # searches whose scores came from the identity thread (tests)

    def close(self) -> None:
        self._stopping.set()   # a search still running (the diff stopped early) stops at its next candidate
        if self._id_pool is not None:
            self._id_pool.shutdown(wait=True, cancel_futures=True)
            self._id_pool = None
        self._pool.shutdown(wait=True)
        self.ra.close()
        self.rb.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _progress(self, stage: str, done: int, total: int) -> None:
        if self.opt.progress:
            self.opt.progress(stage, done, total)

    # -- checks --------------------------------------------------------------------------------

    def _check_models(self) -> None:
        ha, hb = self.ra.hidden_size, self.rb.hidden_size
        if ha is not None and hb is not None and ha != hb:
            raise IncompatibleTracesError(
                f"traces of models with different hidden sizes ({ha} in {os.path.basename(self.ra.path)}, "
                f"{hb} in {os.path.basename(self.rb.path)}): not the same model")
        na, nb = self.ra.num_layers, self.rb.num_layers
        if na is not None and nb is not None and na != nb:
            raise IncompatibleTracesError(f"traces of models with different layer counts ({na} vs {nb}): not the same model")
        for r in (self.ra, self.rb):
            h = r.hidden_size
            for i in r.tensors.values():
                if i.kind == "packed" and h:
                    if i.width % h:
                        raise IncompatibleTracesError(f"packed tensor {i.name!r} has width {i.width}, not a multiple "
                                                      f"of the hidden size {h}", r.path)
                    if i.slot_width != h:
                        raise IncompatibleTracesError(f"packed tensor {i.name!r} has slot width {i.slot_width} but the "
                                                      f"hidden size is {h}", r.path)

    # -- main ----------------------------------------------------------------------------------

    def run(self) -> DiffResult:
        ra, rb = self.ra, self.rb
        self._check_models()
        self._early.clear()
        self._progress("aligning tokens", 0, 1)
        self.sa, self.sb = SideTokens(ra), SideTokens(rb)
        al = align_tokens(ra, rb, (self.sa, self.sb))
        self._progress("aligning tokens", 1, 1)
        self.al = al
        self.maps = RowMaps(al, ra, rb, self.sa, self.sb)
        self._both_memo: dict[tuple[int, int], tuple[Codes, Codes, NDArray[np.bool_], Codes]] = {}
        pairs, findings = pair_tensors(ra, rb)
        # predictions (top-k tables, verify steps) are not states: tensordiff.acceptance compares them
        pairs = [(a, b) for a, b in pairs if not (acceptance.is_prediction(a) or acceptance.is_prediction(b))]
        findings = [f for f in findings if not (f.tensor in ra.tensors and acceptance.is_prediction(ra.tensors[f.tensor])
                                                or f.tensor in rb.tensors and acceptance.is_prediction(rb.tensors[f.tensor]))]
        for ia, ib in pairs:
            if ia.width != ib.width and not (ia.kind == ib.kind == "packed" and ia.slot_width == ib.slot_width):
                raise IncompatibleTracesError(f"tensor {ia.name}: width {ia.width} in A but {ib.width} in B "
                                              "(mismatched shapes)")
        if not pairs:
            raise IncompatibleTracesError("the traces share no tensor to compare (no common names, boundaries or "
                                          "packed inputs)")
        self.search = IdentitySearch(ra, rb, self.maps, self._progress)
        # the noise model (measured where both sides recorded a catalog state) sets every token's
        # default tolerance before the numeric pass
        self.noise = noise_io.measure(ra, rb, self.maps, pairs, self._depth)
        self.opt.tolerances.noise = noise_io.tolerance_fn(self.noise)
        findings += self._token_findings(al)
        findings += self._replica_findings()
        for ia, ib in pairs:   # rows a side recorded twice for one token
            depth = max((d for d in (self._depth(ia, s) for s in range(ia.slot_count)) if d is not None), default=None)
            findings += noise_io.duplicate_findings(ra, ra.side, ia, self.noise, depth, ra.sequences)
            findings += noise_io.duplicate_findings(rb, rb.side, ib, self.noise, depth, rb.sequences)
        factories = list(self.opt.sinks) + ([summary_sink(self.opt.summary_path)] if self.opt.summary_path else [])
        sinks = [make(al, ra, rb) for make in factories]
        if self.opt.numeric is not None:
            self.opt.numeric.start(self, pairs)
        self._done = 0
        self._total = max(sum(min(a.rows, b.rows, len(al)) for a, b in pairs), 1)  # for the progress bar
        worst = WorstTokens()
        try:  # numerics of every pair first: the agreeing boundaries give identity its noise floor
            streamed = self._stream_pairs(pairs, sinks, worst)
        finally:
            for sink in sinks:
                sink.close()
        self.search.floor_of = self._noise_floors(streamed)
        slot_table: list[SlotRow] = []
        for sp in streamed:
            findings += sp.findings
            if sp.acc is not None:
                findings += self._judge_pair(sp, slot_table)
        self._drain_early()
        stats = [sp.stats for sp in streamed]
        compared = [p for p in stats if p.compared]
        if not compared:
            why = "; ".join(f"{p.label}: {p.not_compared}" for p in stats[:4])
            raise IncompatibleTracesError(f"nothing compared: none of the {len(stats)} paired tensors could be "
                                          f"compared ({why}{'; ...' if len(stats) > 4 else ''})")
        self.opt.tolerances.check_rules_used([p.label for p in stats])   # a --tol rule matching nothing: exit 2
        findings = allow_failed(findings, stats, self.opt.tolerances.allow_failed)
        findings = acceptance.add_finding(ra, rb, al, self.maps, order_findings(findings), stats)
        return DiffResult(
            path_a=ra.path, path_b=rb.path, side_a=ra.side, side_b=rb.side, findings=findings,
            slot_table=slot_table, pairs=stats,
            sequences=al.seq_pairs, gaps=al.gaps, shifts={str(k): v for k, v in al.shifts.items()},
            tokens_aligned=len(al), worst_tokens=worst.items(), summary_path=self.opt.summary_path,
        )

    def _token_findings(self, al: TokenAlignment) -> list[Finding]:
        """Shifts, gaps and recovered traces: what the token tables say before any tensor."""
        ra, rb = self.ra, self.rb
        out = []
        nonzero = {s: n for s, n in al.shifts.items() if s != 0}
        if nonzero:
            s, n = max(nonzero.items(), key=lambda kv: kv[1])
            pair = next(p for p in al.seq_pairs if p["shift"] == s)
            out.append(Finding(Kind.TOKEN_SHIFT, Severity.DIVERGENCE, seq=pair["a"], order=-2.0,
                               details=ShiftDetails(shift=s, sequences=n, of=sum(al.shifts.values()),
                                                    side_a=ra.side, side_b=rb.side)))
        for m in al.mismatches:
            out.append(Finding(Kind.TOKEN_MISMATCH, Severity.DIVERGENCE, seq=m["seq"], order=-1.5,
                               position=m["positions"][0][0], details=TokenMismatchDetails(
                                   seq=m["seq"], seq_b=m["seq_b"], positions=m["positions"], count=m["count"],
                                   tokens_a=m["tokens_a"], tokens_b=m["tokens_b"], side_a=ra.side, side_b=rb.side)))
        # gaps: one note per (side, reason), with counts (the JSON's "gaps" keeps every sequence)
        groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for g in al.gaps:
            groups.setdefault((g["side"], g["reason"]), []).append(g)
        for (side, reason), gs in groups.items():
            g0 = gs[0]
            out.append(Finding(Kind.GAP, Severity.INFO, seq=g0["seq"], order=-1.0, details=GapDetails(
                seq=g0["seq"], side=side, side_name=ra.side if side == "a" else rb.side, positions=g0["positions"],
                count=sum(g["count"] for g in gs), reason=reason, sequences=len(gs), seqs=[g["seq"] for g in gs[:8]])))
        # a trace recovered from a killed recording: say so (its missing tail shows up as gaps)
        for r in (ra, rb):
            note = getattr(r, "recovered_note", None)
            if note:
                out.append(Finding(Kind.RECOVERED, Severity.INFO, order=-3.0,
                                   details=RecoveredDetails(side=r.side, path=r.path, note=note)))
        return out

    def _replica_findings(self) -> list[Finding]:
        """Rows a trace set holds twice (TP copies, a PP overlap) that differ: never hidden."""
        out = []
        for r in (self.ra, self.rb):
            if not hasattr(r, "check_replicas"):
                continue
            be = self.opt.numeric
            found = be.check_replicas(r, self._progress) if be is not None else r.check_replicas(self._progress)
            out += [Finding(Kind.REPLICA, Severity.DIVERGENCE, tensor=m.tensor, order=m.order, seq=m.seq,
                            position=m.position, token=m.token, regime=m.regime, details=ReplicaDetails(
                                side=r.side, axis=m.axis, primary=m.primary, replica=m.replica, part=m.part,
                                rows=m.rows, differing=m.differing, max_abs=m.max_abs, cos_min=m.cos_min))
                    for m in found]
        return out

    # -- one tensor pair -----------------------------------------------------------------------

    def _stream_pairs(self, pairs: list[tuple[TensorInfo, TensorInfo]], sinks: list[DiffSink],
                      worst: WorstTokens) -> list[_Streamed]:
        """Every pair's numerics, in pair order. In this process one read-ahead stream runs across
        all pairs (the reader thread reads the next pair's first block while this one's last is
        measured), and each block's sub-blocks are shared between this thread and a helper
        thread per further core (:class:`~tensordiff.numerics.BlockMetrics`)."""
        setups = [self._pair_setup(ia, ib) for ia, ib in pairs]
        local = self.opt.numeric is None
        lanes = _compute_lanes() if local else 1
        self._lane_pool = ThreadPoolExecutor(lanes - 1, thread_name_prefix="tensordiff-metrics") if lanes > 1 else None
        self._lanes = lanes
        jobs = [(j, sp.ia, sp.ib, job) for j, (sp, job) in enumerate(setups) if job is not None]
        shared = _prefetch(self._block_reader_all(jobs), self._pool) if local and jobs else None
        self._shared = shared
        overlap = local and OVERLAP_IDENTITY
        if overlap:   # identity of a disagreeing boundary overlaps the rest of the numeric pass
            lock = threading.Lock()
            self._read_lock = self.search.read_lock = lock
        try:
            for j, (sp, job) in enumerate(setups):
                if job is None:
                    continue
                self._shared_pair = j
                basis, k, depth, idx, ma, mb = job
                early = sp if overlap and sp.ia.kind != "packed" and sp.ib.kind != "packed" else None
                sp.acc = self._stream(sp.ia, sp.ib, basis, k, depth, idx, ma, mb, sinks, worst, early)
                _fill_stats(sp.stats, sp.acc)
        finally:
            self._shared = None
            if shared is not None:
                shared.close()
            if self._lane_pool is not None:
                self._lane_pool.shutdown(wait=True)
            self._lane_pool, self._lanes = None, 1
        return [sp for sp, _ in setups]

    def _stream_pair(self, ia: TensorInfo, ib: TensorInfo, sinks: list[DiffSink], worst: WorstTokens) -> _Streamed:
        """Pairing checks, the basis, and the streamed numerics of one tensor pair."""
        sp, job = self._pair_setup(ia, ib)
        if job is not None:
            basis, k, depth, idx, ma, mb = job
            sp.acc = self._stream(ia, ib, basis, k, depth, idx, ma, mb, sinks, worst)
            _fill_stats(sp.stats, sp.acc)
        return sp

    def _pair_setup(self, ia: TensorInfo, ib: TensorInfo) -> tuple[_Streamed, _Job | None]:
        """Pairing checks and the basis of one tensor pair, and what its numerics need (None:
        not compared, with the finding that says why)."""
        # the row maps' shared inverses (read only), and one ``both`` mask and index per pair of
        # them: all pairs are set up before streaming, and at 1M tokens per-pair copies cost
        # ~25 MB a pair (issue 12)
        ma, mb = self.maps.inverse("a", ia.name), self.maps.inverse("b", ib.name)
        memo = self._both_memo
        hit = memo.get((id(ma), id(mb)))
        if hit is None or hit[0] is not ma or hit[1] is not mb:
            both_new = (ma >= 0) & (mb >= 0)
            hit = memo[(id(ma), id(mb))] = (ma, mb, both_new, np.flatnonzero(both_new))
        both, both_idx = hit[2], hit[3]
        k = min(ia.slot_count, ib.slot_count)
        label = ia.label if ia.name == ib.name else f"{ia.name} ~ {ib.name}"
        depth = [self._depth(ia, s) for s in range(k)]
        st = PairStats(name_a=ia.name, name_b=ib.name, label=label, order=ia.order, slots=k, dtype_a=ia.dtype,
                       dtype_b=ib.dtype, depth=depth)
        sp = _Streamed(ia, ib, st, both, self._pairing_findings(ia, ib))
        basis = self._basis(ia, ib, ma, mb, both, label, sp.findings)
        if basis is None:
            st.compared = False
            st.not_compared = sp.findings[-1].details.get("reason_text") or "not comparable"
            return sp, None
        st.basis = sp.basis = basis
        return sp, (basis, k, depth, both_idx, ma, mb)

    def _depth(self, info: TensorInfo, slot: int) -> float | None:
        """How deep a tensor's state is (for the default tolerance): a boundary's index, the layer
        count for final_norm, a packed slot's claimed state; None when unknown."""
        L = self.ra.num_layers if self.ra.num_layers is not None else self.rb.num_layers
        if info.kind == "boundary" and info.boundary is not None:
            return float(info.boundary)
        if info.kind == "final_norm":
            return float(L) if L is not None else None
        labels = info.slot_labels or []
        if slot < len(labels):
            try:
                b = parse_label(labels[slot])
            except ValueError:
                return float(L) if L is not None else None
            return float(b if b is not None else (L or 0))
        return float(L) if L is not None else None

    def _noise_floors(self, streamed: list[_Streamed]) -> Callable[[str], NoiseFloor]:
        """The 1 - cos (and rel) that each state recorded on both sides shows across them (99th
        percentile over its tokens), for the identity search; states in between take the larger
        of their nearest measured neighbours; none measured: the default tolerance's allowance."""
        measured: dict[str, tuple[float, float, float, int]] = {}  # label -> (depth, 1-cos, rel, tokens)
        for sp in streamed:
            ia, ib, acc = sp.ia, sp.ib, sp.acc
            if acc is None or ia.kind not in ("boundary", "final_norm") or ia.label != ib.label or acc.tokens == 0:
                continue
            oc, rel = acc.quantile(0, 0.99)
            if np.isfinite(oc):
                measured[ia.label] = (self._depth(ia, 0) or 0.0, oc, rel, acc.tokens)
        dtype_a = next((i.dtype for i in self.ra.tensors.values()), "float32")
        dtype_b = next((i.dtype for i in self.rb.tensors.values()), "float32")
        return noise_floors(measured, self.ra.num_layers or self.rb.num_layers, dtype_a, dtype_b)

    def _judge_pair(self, sp: _Streamed, slot_table: list[SlotRow]) -> list[Finding]:
        """Identity of the slots (packed tensors, both sides) and every slot's findings."""
        ia, ib, acc, st = sp.ia, sp.ib, sp.acc, sp.stats
        assert acc is not None
        k = st.slots
        identity_a: dict[int, IdentityVerdict] = {}
        identity_b: dict[int, IdentityVerdict] = {}
        if ia.kind == "packed" or ib.kind == "packed":
            sample = sample_indices(sp.both, self.opt.identity_sample)
            identity_a = self.search.identify("a", ia, list(range(k)), sample)
            identity_b = self.search.identify("b", ib, list(range(k)), sample)
        out: list[Finding] = []
        for s in range(k):
            out += self._slot_findings(sp, s, acc, identity_a, identity_b, slot_table)
        return out

    def _pairing_findings(self, ia: TensorInfo, ib: TensorInfo) -> list[Finding]:
        out = []
        sa, sb = self.ra.side, self.rb.side
        if ia.slot_count != ib.slot_count:
            out.append(Finding(Kind.PAIRING, Severity.DIVERGENCE, tensor=ia.name, order=ia.order,
                               details=PairingDetails(what="slots", value_a=ia.slot_count, value_b=ib.slot_count,
                                                      side_a=sa, side_b=sb)))
        # the token pairing of a draft's input matters only against another draft input: a target's
        # aux capture (role "aux", offset 0) holds the same states at row t as a draft input does
        if ia.token_offset != ib.token_offset and ia.role == ib.role:
            out.append(Finding(Kind.PAIRING, Severity.DIVERGENCE, tensor=ia.name, order=ia.order,
                               details=PairingDetails(what="token_offset", value_a=ia.token_offset,
                                                      value_b=ib.token_offset, side_a=sa, side_b=sb)))
        return out

    def _basis(self, ia: TensorInfo, ib: TensorInfo, ma: Codes, mb: Codes, both: NDArray[np.bool_], label: str,
               findings: list[Finding]) -> str | None:
        """What the pair is compared on (full values, else sketches), or None with a warning that
        says why not, naming both sides' rows or sketch settings."""
        ra, rb = self.ra, self.rb
        basis = "values" if (ia.has_values and ib.has_values) else "sketch"
        reason = text = None
        if not both.any():
            reason = "no_common_token"
            text = (f"{ra.side} has rows at {int((ma >= 0).sum())} aligned tokens, {rb.side} at "
                    f"{int((mb >= 0).sum())}, none in common")
        elif basis == "sketch" and not (ia.has_sketch and ib.has_sketch and ra.sketch_seed == rb.sketch_seed
                                        and ra.sketch_dim == rb.sketch_dim):
            reason = "no_basis"

            def kept(r: TraceReader, i: TensorInfo) -> str:
                what = "full values" if i.has_values else "no full values"
                sk = f"sketches (seed {r.sketch_seed}, dim {r.sketch_dim})" if i.has_sketch else "no sketches"
                return f"{r.side} keeps {what} and {sk}"
            text = f"{kept(ra, ia)}; {kept(rb, ib)}"
        if reason is None:
            return basis
        findings.append(Finding(Kind.MISSING, Severity.WARNING, tensor=ia.name, order=ia.order,
                                details=MissingDetails(reason=reason, label=label, reason_text=text or "")))
        return None

    def _stream(self, ia: TensorInfo, ib: TensorInfo, basis: str, k: int, depth: list[float | None], idx: Codes,
                ma: Codes, mb: Codes, sinks: list[DiffSink], worst: WorstTokens,
                early: _Streamed | None = None) -> PairAccumulator:
        """Numerics over the aligned tokens in blocks: each block's per-token metrics come from
        this process (reads one block ahead in a thread) or from a backend's workers
        (``DiffOptions.numeric``, tensordiff.parallel), and are accumulated here in block order.
        ``early``: a pair of boundaries whose identity search starts (:meth:`_start_identity`)
        at its first failing token, when the judging step is certain to run it."""
        tols = [self.opt.tolerances.for_tensor(ia.name, ia.dtype, ib.dtype, s if k > 1 else None, depth[s])
                for s in range(k)]
        acc = PairAccumulator(tols, self.al.regime_b)
        numeric = self.opt.numeric
        blocks = (numeric.blocks(self, ia, ib, basis, k, idx, ma, mb) if numeric is not None
                  else self._metrics(ia, ib, basis, k, idx, ma, mb))
        for blk, m in blocks:
            bad = acc.add(blk, m)
            if early is not None and any(f is not None for f in acc.first_fail):
                self._start_identity(early)   # a slot fails: _slot_findings will ask what B holds
                early = None
            worst.offer(ia.name, blk, m, self._token_entry)
            for sink in sinks:
                sink.write(ia, ib, k, blk, m, bad)
            self._done += len(blk)
            self._progress("comparing tensors", min(self._done, self._total), self._total)
        return acc

    def _metrics(self, ia: TensorInfo, ib: TensorInfo, basis: str, k: int, idx: Codes, ma: Codes, mb: Codes
                 ) -> Iterator[tuple[Codes, dict[str, np.ndarray]]]:
        """Per-token metrics of each block of aligned rows, computed in this process: from the
        stream shared by all pairs while :meth:`_stream_pairs` runs, else read one block ahead."""
        sw = ia.slot_width if basis == "values" else self.ra.sketch_dim
        bm = BlockMetrics(k, sw, pool=getattr(self, "_lane_pool", None), lanes=getattr(self, "_lanes", 1))
        shared = getattr(self, "_shared", None)
        if shared is not None:
            blocks: Iterator[tuple[Codes, np.ndarray, np.ndarray]] = _take_pair(shared, self._shared_pair, len(idx))
        else:
            blocks = (item[1:4] for item in _prefetch(self._block_reader_all([(0, ia, ib, (basis, k, [], idx, ma, mb))]),
                                                      self._pool))
        for blk, a_raw, b_raw in blocks:
            if basis == "values":  # stored form (bf16 bits); converted in cache-sized pieces
                m = bm.compute_stored(a_raw, ia.dtype, b_raw, ib.dtype)
            else:
                a = np.asarray(a_raw, np.float32)[:, :k * sw]
                b = np.asarray(b_raw, np.float32)[:, :k * sw]
                m = bm.compute(np.ascontiguousarray(a), np.ascontiguousarray(b))
            yield blk, m

    def _slot_findings(self, sp: _Streamed, s: int, acc: PairAccumulator, identity_a: dict[int, IdentityVerdict],
                       identity_b: dict[int, IdentityVerdict], slot_table: list[SlotRow]) -> list[Finding]:
        """The findings of one slot: NaN/Inf, what it holds, labels, numerics."""
        ia, ib, st, k = sp.ia, sp.ib, sp.stats, sp.stats.slots
        out: list[Finding] = []
        slotted = k > 1 or ib.kind == "packed"
        subject = f"slot {s} of {ib.name}" if slotted else ib.label
        slot_arg = s if slotted else None
        nf = acc.first_nonfinite[s]
        if nf is not None:
            out.append(self._token_finding(Kind.NONFINITE, ia, slot_arg, nf.token_index, NonfiniteDetails(
                subject=subject, nonfinite_a=int(acc.nonfinite_a[s]), nonfinite_b=int(acc.nonfinite_b[s]),
                row_a=nf.nonfinite_a, row_b=nf.nonfinite_b, side_a=self.ra.side, side_b=self.rb.side)))
        ff = acc.first_fail[s]
        at = ff.token_index if ff is not None else int(np.flatnonzero(sp.both)[0])
        identity_finding = None
        if s in identity_b:
            claimed_a = ia.slot_labels[s] if ia.slot_labels else (ia.label if ia.kind != "packed" else None)
            claimed_b = ib.slot_labels[s] if ib.slot_labels else (ib.label if ib.kind != "packed" else None)

            def place(kind: Kind, side: str, det: IdentityDetails, sev: Severity) -> Finding:
                f = self._token_finding(kind, ia, s, at, det)
                f.severity = sev
                return f
            j = judge_slot(ib.name, s, claimed_a, claimed_b, identity_a.get(s), identity_b[s],
                           (self.ra.side, self.rb.side), bool(acc.failing[s]), st.cos_mean[s], st.rel_max[s], place,
                           ia.order, ib.order, ia.name)
            slot_table.append(j.row)
            out += j.findings
            identity_finding = j.identity
        tol = acc.tolerances[s]
        judged = noise.SlotJudgement()
        if tol.source == self.noise.source and sp.basis == "values":   # not a --tol rule or calibration
            judged = noise_io.judge(self.noise, acc, s, st.depth[s] if s < len(st.depth) else None)
            jump = noise_io.boundary_jump(self.noise, ia.label) if ia.kind in ("boundary", "final_norm") else None
            if jump is not None and not judged.part:   # this state leaves the trend of the states before it
                judged = (noise.SlotJudgement("scale", float(np.exp(jump.level.bias)), jump.bias_limit)
                          if jump.why == "scale" else noise.SlotJudgement("level", jump.level.q50,
                                                                          noise.JUMP * jump.predicted))
        if (acc.failing[s] and ff is not None) or judged.part:
            hit = ff if ff is not None else None
            det = NumericDetails(
                subject=subject, cos=hit.cos if hit else float(st.cos_min[s]), rel=hit.rel if hit else float(st.rel_max[s]),
                maxabs=hit.maxabs if hit else float(st.maxabs[s]), failing=int(acc.failing[s]), tokens=acc.tokens,
                tolerance=tol.to_dict(), basis=sp.basis)
            state = (ia.slot_labels[s] if ia.slot_labels and s < len(ia.slot_labels) else ia.label)
            noise_io.annotate(det, self.noise, judged, state, ia.label)
            f = self._token_finding(Kind.NUMERIC, ia, slot_arg, hit.token_index if hit else at, det)
            if identity_finding is not None:
                f.severity = Severity.INFO
                assert isinstance(f.details, NumericDetails)
                f.details.explained = True
            elif ia.kind != "packed":
                f = self._boundary_identity(ia, ib, sp.both, hit.token_index if hit else at) or f
            out.append(f)
        return out

    def _start_identity(self, sp: _Streamed) -> None:
        """Score the identity search of a boundary pair that fails (what :meth:`_boundary_identity`
        will ask) in a thread of its own while the numeric pass goes on: numpy releases the GIL,
        and the numeric pass leaves part of a second core idle. Only the scores are computed
        there; the decision waits for the noise floors, which need every pair's numerics, so
        the verdict is the sequential one whatever the threads' timing."""
        if self._id_pool is None:
            self._id_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensordiff-identity")
        sample = sample_indices(sp.both, BOUNDARY_SAMPLE)
        fut = self._id_pool.submit(self.search.score, "b", sp.ib, [0], sample, self._early_progress)
        self._early[(sp.ia.name, sp.ib.name)] = (sample, fut)

    def _early_progress(self, stage: str, done: int, total: int) -> None:
        """The progress of a search scored in the identity thread: counted for the diff's own
        progress (reported from its thread), and the point where a stopped diff stops it."""
        if self._stopping.is_set():
            raise _Stopped
        self._early_done[:] = [done, total]

    def _early_scores(self, ia: TensorInfo, ib: TensorInfo, sample: Codes) -> SlotScores | None:
        """The scores :meth:`_start_identity` computed for this search (waited for, reporting
        progress, which may cancel), or None when none was started for these tokens."""
        hit = self._early.get((ia.name, ib.name))
        if hit is None or not np.array_equal(hit[0], sample):
            return None
        fut = hit[1]
        while not wait_futures([fut], timeout=0.05).done:
            done, total = self._early_done
            self._progress("identifying slots", done, max(total, 1))
        found = fut.result()
        self.early_identities += 1
        return found

    def _drain_early(self) -> None:
        """Every search started early has been used (or the diff failed); wait for any left."""
        for _, fut in self._early.values():
            with contextlib.suppress(Exception):
                fut.result()
        self._early.clear()

    def _boundary_identity(self, ia: TensorInfo, ib: TensorInfo, both: NDArray[np.bool_], at: int) -> Finding | None:
        """A boundary that disagrees: does it hold another recorded state?"""
        sample = sample_indices(both, BOUNDARY_SAMPLE)
        found = self._early_scores(ia, ib, sample)
        idt = (self.search.decide(found) if found is not None else self.search.identify("b", ib, [0], sample))[0]
        if idt.outcome not in ("holds", "scaled") or (idt.best == ia.label and idt.outcome == "holds" and not idt.offset):
            return None
        return self._token_finding(Kind.SLOT_IDENTITY, ib, None, at, IdentityDetails(
            outcome=idt.outcome, subject=ib.name, boundary_side=self.rb.side, held=idt.best, expected=ia.label,
            offset=idt.offset, scale=idt.scale, score=idt.score, margin=idt.margin, runner_up=idt.runner_up,
            closest=idt.closest, cos=idt.evidence.cos, candidates=idt.candidates, evidence=idt.evidence))

    def block_rows_of(self, ia: TensorInfo, ib: TensorInfo, part: str) -> int:
        """Rows per block of a pair: about :data:`~tensordiff.numerics.BLOCK_BYTES` of stored
        data per side, at most ``block_rows`` (every backend cuts the same blocks)."""
        da, db = self.ra._ds[ia.name][part], self.rb._ds[ib.name][part]
        return rows_per_block(max(_row_bytes(da), _row_bytes(db)), self.opt.block_rows)

    def _block_reader_all(self, jobs: list[tuple[int, TensorInfo, TensorInfo, _Job]]
                          ) -> Iterator[tuple[int, Codes, np.ndarray, np.ndarray, bool]]:
        """``(pair, aligned indices, rows of A, rows of B, last of its pair)``: the blocks of every job in order, in
        stored form. Two buffer sets of bytes alternate (the block being compared is never the
        one being read), reused across pairs of any width; they grow only for a wider block."""
        bufs: list[list[np.ndarray]] = [[np.empty(0, np.uint8), np.empty(0, np.uint8)] for _ in range(2)]
        i = 0
        for j, ia, ib, (basis, _k, _depth, idx, ma, mb) in jobs:
            part = "values" if basis == "values" else "sketch"
            with self._read_lock:   # the readers' open datasets are shared with the identity thread
                n = self.block_rows_of(ia, ib, part)
                da, db = self.ra._ds[ia.name][part], self.rb._ds[ib.name][part]
            for s0 in range(0, len(idx), n):
                blk = idx[s0:s0 + n]
                pair_bufs = bufs[i % 2]
                outs = [_typed(pair_bufs, side, len(blk), ds) for side, ds in ((0, da), (1, db))]
                i += 1
                with self._read_lock:
                    got_a = self.ra.read_at(ia.name, part, ma[blk], out=outs[0])
                    got_b = self.rb.read_at(ib.name, part, mb[blk], out=outs[1])
                yield (j, blk, got_a, got_b, s0 + n >= len(idx))

    def _token_entry(self, ti: int) -> dict[str, Any]:
        return self.al.entry(ti, self.ra.sequences, self.rb.sequences, REGIMES)

    def _token_finding(self, kind: Kind, info: TensorInfo, slot: int | None, ti: int, details: Details) -> Finding:
        e = self._token_entry(ti)
        details.token_index = ti
        return Finding(kind, Severity.DIVERGENCE, tensor=info.name, slot=slot, order=info.order, seq=e["seq"],
                       position=e["position"], position_b=e["position_b"], token=e["token"], regime=e["regime"],
                       details=details)


class _Stopped(Exception):
    """Raised in the identity thread when the diff has stopped (nothing waits for its result)."""


@dataclass
class _Streamed:
    """One tensor pair after its numerics: what the judging step needs."""

    ia: TensorInfo
    ib: TensorInfo
    stats: PairStats
    both: NDArray[np.bool_]
    findings: list[Finding]
    acc: PairAccumulator | None = None
    basis: str = "values"


def _fill_stats(st: PairStats, acc: PairAccumulator) -> None:
    st.tokens = acc.tokens
    st.tolerance = [t.to_dict() for t in acc.tolerances]
    st.cos_min = [float(x) for x in acc.cos_min]
    st.cos_mean = acc.cos_mean()
    st.rel_max = [float(x) for x in acc.rel_max]
    st.maxabs = [float(x) for x in acc.maxabs]
    st.failing = [int(x) for x in acc.failing]
    st.nonfinite_a = [int(x) for x in acc.nonfinite_a]
    st.nonfinite_b = [int(x) for x in acc.nonfinite_b]
    st.by_regime = dict(acc.by_regime)


#: what a compared pair's numerics need: basis, slots, depth per slot, aligned indices, row maps
_Job = tuple[str, int, list[float | None], Codes, Codes, Codes]
MAX_LANES = 4   # threads measuring one block at most (the reader thread takes a core of its own)


def _compute_lanes() -> int:
    """Threads that measure each block: the cores this process may use, at most MAX_LANES."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_LANES, cores))


def _row_bytes(ds: Any) -> int:
    return int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize


def _typed(bufs: list[np.ndarray], side: int, rows: int, ds: Any) -> np.ndarray:
    """A [rows, ...] array of ``ds``'s dtype over the byte buffer of one side (grown if short)."""
    need = rows * _row_bytes(ds)
    if bufs[side].size < need:
        bufs[side] = np.empty(need, np.uint8)
    return bufs[side][:need].view(ds.dtype).reshape((rows,) + tuple(ds.shape[1:]))


def _take_pair(shared: Iterator[tuple[int, Codes, np.ndarray, np.ndarray, bool]], pair: int, rows: int
               ) -> Iterator[tuple[Codes, np.ndarray, np.ndarray]]:
    """The blocks of pair ``pair`` from the stream shared by all pairs, up to its last one (the
    stream's next item is the next pair's and stays there)."""
    if rows == 0:
        return
    for j, blk, a, b, last in shared:
        if j != pair:  # the stream and the pairs went out of step: a bug, never a wrong figure
            raise RuntimeError(f"block stream out of step: a block of pair {j} where pair {pair} was due")
        yield blk, a, b
        if last:
            return


def _prefetch(gen: Iterator[T], pool: ThreadPoolExecutor) -> Iterator[T]:
    """Run a block generator one block ahead in a thread: HDF5 reads (which hold h5py's lock)
    overlap the numpy metrics of the previous block (which release the GIL) on a second core."""
    it = iter(gen)
    fut = pool.submit(next, it, None)
    while True:
        item = fut.result()
        if item is None:
            return
        fut = pool.submit(next, it, None)
        yield item


def diff_traces(path_a: str, path_b: str, options: DiffOptions | None = None) -> DiffResult:
    """Diff two traces: A the reference, B under test."""
    with Differ(path_a, path_b, options) as d:
        return d.run()
