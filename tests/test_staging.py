"""Staged recording (``Recorder(stage_bytes=...)``, the serve plugins' default on the CPU) writes
what the unstaged recorder writes: the same datasets row for row (values, rows, RMS, top-k tables
bit for bit; sketches within the rounding of a larger product), whatever the bound, with the
staged rows appended before a flush trigger commits (whole steps on disk), the bound on staged
bytes kept, the engine's tensors copied (a later in-place write does not reach the trace), and a
failed drain leaving what was written before readable.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensordiff.recorders import serving  # noqa: E402
from tensordiff.recorders.core import Recorder  # noqa: E402
from tensordiff.recorders.staging import Later, TopkJob, compute_jobs  # noqa: E402
from tensordiff.recorders.storage import topk_rows  # noqa: E402
from tensordiff.trace import TraceReader  # noqa: E402

pytestmark = pytest.mark.torch

H = 16
LABELS = ["layer1", "layer2", "layer3"]


def _record(path, stage_bytes: int, steps: int = 30, *, flush_rows=None, edit_after=False, seed=0):
    """A serve-like recording: a prefill of 3 requests, then decode steps of a few rows each:
    aux (remembered), draft_input (the same tensor: reused), an fc output in bf16, a sketch-only
    catalog state, top-k tables through jobs (logits and lm_head rows), and plain rows."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(40, H, generator=g)
    with Recorder(path, side="serve", model={"num_layers": 4, "hidden_size": H}, stage_bytes=stage_bytes,
                  values=["aux", "draft_input", "fc"], writer_kwargs={"flush_rows": flush_rows}) as rec:
        pos = {f"r{i}": 0 for i in range(3)}
        for step in range(steps):
            n_per = 9 if step == 0 else 1 + step % 3
            rows = []
            for rid in pos:
                p = np.arange(pos[rid], pos[rid] + n_per)
                rows.append(rec.add_tokens(rid, p, (p * 7 + step) % 40, regime="prefill" if step == 0 else "decode",
                                           step=step))
                pos[rid] += n_per
            rows = np.concatenate(rows)
            x = torch.randn(len(rows), 3 * H, generator=g)
            serving.packed(rec, "aux", x, rows, labels=LABELS, token_offset=0, role="aux", remember=True)
            if edit_after:
                x.mul_(2.0)  # the engine reuses its buffer: what was recorded must not change
            drows = rows.copy()
            if step % 2:
                drows[::4] = -1  # other rows than aux's: its sketch is not reused
            serving.packed(rec, "draft_input", x, drows, labels=LABELS, token_offset=1, reuse="aux")
            rec.record("fc", torch.randn(len(rows), H, generator=g).to(torch.bfloat16), rows, token_offset=1)
            rec.boundary(2, torch.randn(len(rows), H, generator=g), rows)
            logits = torch.randn(len(rows), 40, generator=g) * 3
            job = rec.topk_job(5, logits=logits)
            if edit_after:
                logits.zero_()
            rec.plain("target_topk", Later(job.width, lambda j=job: j.table), rows, role="target_topk")
            hjob = rec.topk_job(4, hidden=torch.randn(2, H, generator=g), head=(w, 33, None, None))
            rec.plain("head_topk", Later(hjob.width, lambda j=hjob: j.table), rows[:2], role="head_topk")
            rec.plain("steps", np.full((len(rows), 2), float(step)), np.where(np.arange(len(rows)) % 2, rows, -1),
                      role="steps")
        stats = rec.stats
    return stats


def _datasets(path):
    with h5py.File(path, "r") as f:
        return {f"{n}/{p}": f["tensors"][n][p][()] for n in f["tensors"] for p in f["tensors"][n]}


@pytest.mark.parametrize("stage_bytes", [1, 4096, 1 << 16, 1 << 30])
def test_staged_recording_writes_what_the_unstaged_one_writes(tmp_path, stage_bytes):
    """Row for row the same trace; draft_input's rows that repeat aux's bits (the same rows of the
    same tensor) take their values from aux's rows instead of storing them again."""
    _record(tmp_path / "a.h5", 0)
    stats = _record(tmp_path / "b.h5", stage_bytes)
    want, got = _datasets(tmp_path / "a.h5"), _datasets(tmp_path / "b.h5")
    ref = got.pop("draft_input/values_ref")
    own = got.pop("draft_input/values")
    assert (ref >= 0).sum() > 0 and len(own) == (ref < 0).sum() < len(ref)  # stored once
    with TraceReader(str(tmp_path / "b.h5")) as r:
        assert r.tensors["draft_input"].values_source == "aux"
        got["draft_input/values"] = r.read_values("draft_input", raw=True)
        np.testing.assert_array_equal(got["draft_input/values"][ref >= 0], got["aux/values"][ref[ref >= 0]])
    assert got.keys() == want.keys()
    for key, a in want.items():
        b = got[key]
        assert a.shape == b.shape and a.dtype == b.dtype, key
        if key.endswith("/sketch"):  # one product over many calls: float32 rounding of another summation
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5, err_msg=key)
        else:
            np.testing.assert_array_equal(b, a, err_msg=key)
    assert stats.sketch_reused > 0  # draft_input's repeats of aux's bits took aux's sketch
    with TraceReader(str(tmp_path / "b.h5")) as r:
        np.testing.assert_array_equal(r.read_sketch("draft_input"), got["draft_input/sketch"])


def test_a_drains_values_are_joined_once_for_the_rms_and_the_append(tmp_path, monkeypatch):
    """A tensor's staged values are joined once per drain: the append gets the very array whose
    RMS and sketch were computed (no second copy of every staged row); the trace is the same as
    the unstaged one's (test above)."""
    derived, appended = [], {}
    real_derive, real_append = Recorder._derive, Recorder._append_staged

    def derive(self, spec, entries):
        out = real_derive(self, spec, entries)
        derived.append(out)
        return out

    def append(self, name, spec, entries, *joined):
        if name == "fc" and len(entries) > 1:
            real = self.writer.append
            self.writer.append = lambda n, rows, vals, **kw: appended.setdefault(n, []).append(vals) or real(
                n, rows, vals, **kw)
            try:
                return real_append(self, name, spec, entries, *joined)
            finally:
                del self.writer.append
        return real_append(self, name, spec, entries, *joined)

    monkeypatch.setattr(Recorder, "_derive", derive)
    monkeypatch.setattr(Recorder, "_append_staged", append)
    _record(tmp_path / "b.h5", 1 << 30)
    assert appended["fc"] and all(any(v is d for d in derived) for v in appended["fc"])


def test_the_engines_tensors_are_copied(tmp_path):
    """Logits and states overwritten by the engine after the call: the trace has what the call saw."""
    _record(tmp_path / "a.h5", 0)
    _record(tmp_path / "b.h5", 1 << 30, edit_after=True)
    want, got = _datasets(tmp_path / "a.h5"), _datasets(tmp_path / "b.h5")
    np.testing.assert_array_equal(got["aux/values"], want["aux/values"])
    np.testing.assert_array_equal(got["target_topk/values"], want["target_topk/values"])
    # draft_input is recorded after the write: it holds the doubled values, not aux's, and refers
    # to no aux row
    assert (got["draft_input/values_ref"] == -1).all()
    np.testing.assert_array_equal(got["draft_input/values"], want["draft_input/values"] * 2)


def test_a_flush_trigger_appends_the_staged_rows_first(tmp_path):
    """flush_rows reached: the staged rows are appended before the add_tokens that flushes, so
    every flush commits whole steps (each committed token row has its tensor rows)."""
    path = tmp_path / "t.h5"
    flushes = []
    with Recorder(path, side="serve", model={"num_layers": 4, "hidden_size": H}, stage_bytes=1 << 30,
                  writer_kwargs={"flush_rows": 10, "flush_seconds": None}) as rec:
        rec.writer.on_flush = lambda w: flushes.append(dict(w.flushed["tensors"], tokens=w.flushed["tokens"]))
        for step in range(12):
            rows = rec.add_tokens("r", np.arange(step * 4, step * 4 + 4), np.arange(4), regime="decode", step=step)
            rec.record("s", torch.randn(4, H), rows)
            rec.plain("p", np.ones((4, 1)), rows, role="p")
    assert len(flushes) >= 4
    for fl in flushes[:-1]:
        assert fl["s"] == fl["p"] == fl["tokens"] > 0  # whole steps: no token row without its tensor rows


@pytest.mark.parametrize("flush_rows", [4, 7, 10])
@pytest.mark.parametrize("pattern", ["staged", "alternating"])
def test_a_flush_never_splits_a_step_whose_token_rows_come_in_several_calls(tmp_path, pattern, flush_rows):
    """Each step adds its token rows in two calls (two regimes of one batch) and records after
    them: a flush due between the two calls waits for the next step's first, whether the step's
    tensor rows were staged or (every other step, "alternating") appended to the writer directly.
    Every flush commits whole steps: each tensor's rows of exactly the committed token rows."""
    path = tmp_path / "t.h5"
    flushes = []
    with Recorder(path, side="serve", model={"num_layers": 4, "hidden_size": H}, stage_bytes=1 << 30,
                  writer_kwargs={"flush_rows": flush_rows, "flush_seconds": None}) as rec:
        rec.writer.on_flush = lambda w: flushes.append((w.flushed["tokens"], dict(w.flushed["tensors"])))
        rec.writer.define_tensor("d", 4)
        rng = np.random.default_rng(flush_rows)
        ends = [0]
        for step in range(40):
            n1, n2 = int(rng.integers(1, 5)), int(rng.integers(1, 4))
            a = rec.add_tokens(f"p{step}", np.arange(n1), np.arange(n1), regime="prefill", step=step)
            b = rec.add_tokens(f"v{step}", np.arange(n2), np.arange(n2), regime="decode", step=step)
            rows = np.concatenate([a, b])
            if pattern == "staged" or step % 2 == 0:
                rec.record("s", torch.randn(len(rows), H), rows)
            else:
                rec.writer.append("d", rows, np.ones((len(rows), 4), np.float32))
            ends.append(ends[-1] + len(rows))
    with TraceReader(path) as r:
        n_all = len(r.tokens)
        rows = {name: r.token_rows(name) for name in r.tensors}
    inside = [f for f in flushes if 0 < f[0] < n_all]
    assert len(inside) >= 3
    for n_tok, counts in inside:
        assert n_tok in ends, n_tok   # at a step's end
        for name, idx in rows.items():
            assert counts.get(name, 0) == int((idx < n_tok).sum()), (n_tok, name)


def test_the_bound_is_kept(tmp_path):
    """Staged bytes never exceed the bound by more than one call."""
    path = tmp_path / "t.h5"
    bound = 10_000
    peak = 0
    with Recorder(path, side="serve", model={"num_layers": 4, "hidden_size": H}, stage_bytes=bound) as rec:
        for step in range(40):
            rows = rec.add_tokens("r", np.arange(step * 8, step * 8 + 8), np.arange(8), regime="decode", step=step)
            rec.record("s", torch.randn(8, 4 * H), rows)
            rec.topk_job(3, logits=torch.randn(8, 50))
            peak = max(peak, rec._staged_bytes)
    assert 0 < peak <= bound


def test_jobs_of_one_group_are_one_batch_and_equal_their_own_tables():
    torch.manual_seed(4)
    pending: list[TopkJob] = []
    m = torch.randperm(30) * 3
    xs = [torch.randn(n, 30) * 2 for n in (3, 1, 7)]
    jobs = [TopkJob(5, logits=x, id_map=m, pending=pending) for x in xs]
    other = TopkJob(2, logits=torch.randn(4, 12), pending=pending)  # another group
    calls = []
    import tensordiff.recorders.staging as st
    real = st.topk_rows
    try:
        st.topk_rows = lambda *a, **k: calls.append(a[0].shape) or real(*a, **k)
        _ = jobs[1].table  # the first read computes every pending job
    finally:
        st.topk_rows = real
    assert sorted(calls) == [(4, 12), (11, 30)] and not pending
    for j, x in zip(jobs, xs):
        assert j.width == 11 and j.done
        np.testing.assert_array_equal(j.table, topk_rows(x, 5, m).numpy())
    assert other.width == 5
    compute_jobs([])  # nothing pending: nothing to do


def test_a_failed_drain_keeps_what_was_written_and_says_so(tmp_path):
    path = tmp_path / "t.h5"
    rec = Recorder(path, side="serve", model={"num_layers": 4, "hidden_size": H}, stage_bytes=1 << 30)
    rows = rec.add_tokens("r", np.arange(4), np.arange(4), regime="decode")
    rec.record("s", torch.randn(4, H), rows)
    rec.flush()
    rows = rec.add_tokens("r", np.arange(4, 8), np.arange(4), regime="decode", step=1)
    rec.plain("bad", Later(3, lambda: np.zeros((2, 3))), rows, role="bad")  # 2 rows for 4: a caller's bug
    with pytest.raises(ValueError, match="bad: a staged table of shape"):
        rec.close()
    with TraceReader(str(path)) as r:
        assert r.tensors["s"].rows == 4
        assert "recording_error" in r.f.attrs and not r.f.attrs["complete"]


@pytest.mark.parametrize("budget", [1, 50, 1 << 20])
def test_lm_head_jobs_rank_in_batches_and_equal_each_job_alone(monkeypatch, budget):
    """Jobs whose logits come from hidden rows: one product per job (in chunks of its own rows),
    their top-k ranked in batches of any size: bit for bit each job computed alone."""
    import tensordiff.recorders.staging as st

    monkeypatch.setattr(st, "HEAD_CHUNK_ROWS", 3)
    monkeypatch.setattr(st, "HEAD_BATCH_ELEMENTS", budget)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(37, H, generator=g)
    head = (w, 30, 0.5, 20.0)  # padded vocabulary, a logit scale, soft-capping
    hs = [torch.randn(n, H, generator=g) for n in (7, 1, 4)]
    alone = []
    for h in hs:
        j = TopkJob(6, hidden=h, head=head)
        compute_jobs([j])
        alone.append(j.table)
    pending: list[TopkJob] = []
    jobs = [TopkJob(6, hidden=h, head=head, pending=pending) for h in hs]
    compute_jobs(pending)
    for j, want in zip(jobs, alone):
        np.testing.assert_array_equal(j.table, want)
        assert j.table.shape == (len(want), 13) and (j.table[:, :6] < 30).all()


def test_a_large_products_logits_are_ranked_as_they_are_and_equal_the_batched_ranks(monkeypatch):
    """A product of HEAD_ALONE_ROWS rows or more (a prefill's) is ranked alone, not copied into a
    batch with the small ones around it; every job's table is still each job computed alone, in
    the order of its rows."""
    import tensordiff.recorders.staging as st

    monkeypatch.setattr(st, "HEAD_CHUNK_ROWS", 8)
    monkeypatch.setattr(st, "HEAD_ALONE_ROWS", 6)
    g = torch.Generator().manual_seed(9)
    w = torch.randn(40, H, generator=g)
    head = (w, 40, None, None)
    hs = [torch.randn(n, H, generator=g) for n in (2, 20, 3, 7, 1)]  # chunks 2 | 8 8 4 | 3 | 7 | 1
    alone = []
    for h in hs:
        j = TopkJob(5, hidden=h, head=head)
        compute_jobs([j])
        alone.append(j.table)
    shapes = []
    real = st.topk_rows
    monkeypatch.setattr(st, "topk_rows", lambda x, *a, **k: shapes.append(tuple(x.shape)) or real(x, *a, **k))
    pending: list[TopkJob] = []
    jobs = [TopkJob(5, hidden=h, head=head, pending=pending) for h in hs]
    compute_jobs(pending)
    assert shapes == [(2, 40), (8, 40), (8, 40), (4 + 3, 40), (7, 40), (1, 40)]
    for j, want in zip(jobs, alone):
        np.testing.assert_array_equal(j.table, want)


def test_a_private_snapshot_is_taken_again_without_comparing_its_bits(tmp_path, monkeypatch):
    """A remembered call's tensor given as the caller's private copy (``private=True``, staged as
    it is) and named again with all its rows: the staged copy is that very memory, so the rows refer
    to it without a bit comparison. Given without ``private`` (the recorder stages a copy), the
    same tensor's bits are compared with that copy first; both refer to the aux rows."""
    from tensordiff.recorders import core

    compared = []
    bits = core._bits
    monkeypatch.setattr(core, "_bits", lambda a: compared.append(a.shape) or bits(a))
    x = torch.randn(6, 3 * H, generator=torch.Generator().manual_seed(1))
    with Recorder(tmp_path / "p.h5", side="serve", model={"num_layers": 4, "hidden_size": H}, stage_bytes=1 << 20,
                  values=["aux", "draft_input"]) as rec:
        for step, private in enumerate((True, False)):
            rows = rec.add_tokens(f"r{step}", np.arange(6), np.arange(6), regime="prefill")
            serving.packed(rec, "aux", x, rows, labels=LABELS, token_offset=0, role="aux", remember=True, private=private)
            serving.packed(rec, "draft_input", x, rows, labels=LABELS, token_offset=1, reuse="aux")
            assert len(compared) == (0 if private else 2), compared
    got = _datasets(tmp_path / "p.h5")
    np.testing.assert_array_equal(got["draft_input/values_ref"], np.arange(12))
    with TraceReader(str(tmp_path / "p.h5")) as r:
        np.testing.assert_array_equal(r.read_values("draft_input", raw=True), np.concatenate([x.numpy()] * 2))


def test_rows_referring_to_a_source_are_appended_after_it_in_a_batch(tmp_path):
    """A batch that staged draft_input's rows (referring to aux rows) before that batch's aux rows:
    the drafter's pass on step s is staged after a drain, before step s+1's aux. The batch appends
    aux first, so every reference names a row already written."""
    x0 = torch.randn(4, 3 * H, generator=torch.Generator().manual_seed(2))
    x1 = torch.randn(3, 3 * H, generator=torch.Generator().manual_seed(3))
    with Recorder(tmp_path / "o.h5", side="serve", model={"num_layers": 4, "hidden_size": H}, stage_bytes=1 << 20,
                  values=["aux", "draft_input"]) as rec:
        r0 = rec.add_tokens("a", np.arange(4), np.arange(4), regime="prefill")
        serving.packed(rec, "aux", x0, r0, labels=LABELS, token_offset=0, role="aux", remember=True)
        rec.write_staged()
        serving.packed(rec, "draft_input", x0, r0, labels=LABELS, token_offset=1, reuse="aux")  # staged before aux's next rows
        r1 = rec.add_tokens("b", np.arange(3), np.arange(3), regime="prefill")
        serving.packed(rec, "aux", x1, r1, labels=LABELS, token_offset=0, role="aux", remember=True)
        serving.packed(rec, "draft_input", x1, r1, labels=LABELS, token_offset=1, reuse="aux")
    with TraceReader(str(tmp_path / "o.h5")) as r:
        assert r.complete
        np.testing.assert_array_equal(r.read_values("draft_input", raw=True), np.concatenate([x0.numpy(), x1.numpy()]))


@pytest.mark.parametrize("stage_bytes", [500, 1000, 2000])
@pytest.mark.parametrize("sizes", [[8, 2, 2], [1, 2, 3, 1, 2, 3]])
def test_rows_by_reference_are_appended_after_the_source_rows_they_refer_to(tmp_path, stage_bytes, sizes):
    """A drain right after aux's rows leaves a batch that begins with draft_input (its rows refer to
    the aux rows just written) and then stages new aux rows and draft_input rows referring to them:
    the batch appends aux first (draft_input first referred to rows not yet written: the recorder
    failed and the trace was left unclosed, as on a real EAGLE-3 serve run whose draft was accepted)."""
    def record(path, bound):
        g = torch.Generator().manual_seed(0)
        with Recorder(path, side="serve", model={"num_layers": 4, "hidden_size": H}, stage_bytes=bound,
                      values=["aux", "draft_input"]) as rec:
            pos = 0
            for step, n in enumerate(sizes):
                rows = rec.add_tokens("r", np.arange(pos, pos + n), np.arange(n) % 40, regime="decode", step=step)
                pos += n
                x = torch.randn(n, 3 * H, generator=g)
                serving.packed(rec, "aux", x, rows, labels=LABELS, token_offset=0, role="aux", remember=True)
                serving.packed(rec, "draft_input", x, rows, labels=LABELS, token_offset=1, reuse="aux")

    record(tmp_path / "a.h5", 0)
    record(tmp_path / "b.h5", stage_bytes)
    with TraceReader(str(tmp_path / "a.h5")) as a, TraceReader(str(tmp_path / "b.h5")) as b:
        assert b.complete and b.tensors["draft_input"].values_source == "aux"
        for name in ("aux", "draft_input"):
            np.testing.assert_array_equal(b.token_rows(name), a.token_rows(name))
            np.testing.assert_array_equal(b.read_values(name, raw=True), a.read_values(name, raw=True))


@pytest.mark.parametrize("dropped", [False, True], ids=["all_rows", "rows_dropped"])
def test_a_private_snapshot_reused_by_the_same_object_is_referred_to_without_a_second_copy(tmp_path, monkeypatch,
                                                                                           dropped):
    """draft_input on the very aux snapshot the remembered call staged (both calls private: nobody
    writes it) refers to aux's rows with no copy of the kept rows and no bit comparison; the same
    call without ``private`` still compares the bits of a copy. The trace is the same either way."""
    import tensordiff.recorders.core as core_mod

    x = torch.randn(6, 3 * H, generator=torch.Generator().manual_seed(4))
    compared = []
    bits = core_mod._bits
    monkeypatch.setattr(core_mod, "_bits", lambda a: (compared.append(a.shape), bits(a))[1])

    def record(path, private):
        compared.clear()
        with Recorder(path, side="serve", model={"num_layers": 4, "hidden_size": H}, stage_bytes=1 << 20,
                      values=["aux", "draft_input"]) as rec:
            rows = rec.add_tokens("r", np.arange(6), np.arange(6), regime="decode")
            if dropped:
                rows[[1, 4]] = -1
            serving.packed(rec, "aux", x, rows, labels=LABELS, token_offset=0, role="aux", remember=True, private=True)
            serving.packed(rec, "draft_input", x, rows, labels=LABELS, token_offset=1, reuse="aux", private=private)
            entries = rec._staged["draft_input"]
            assert entries[0].same is rec._staged["aux"][0] and entries[0].data is rec._staged["aux"][0].data
        return list(compared)

    assert record(tmp_path / "fast.h5", True) == []
    assert record(tmp_path / "checked.h5", False) != [] or not dropped
    with TraceReader(str(tmp_path / "fast.h5")) as a, TraceReader(str(tmp_path / "checked.h5")) as b:
        assert a.tensors["draft_input"].values_source == "aux"
        for name in ("aux", "draft_input"):
            np.testing.assert_array_equal(a.token_rows(name), b.token_rows(name))
            assert a.read_values(name, raw=True).tobytes() == b.read_values(name, raw=True).tobytes()
            assert a.read_rms(name).tobytes() == b.read_rms(name).tobytes()
    with h5py.File(tmp_path / "fast.h5") as f:
        assert (f["tensors/draft_input/values_ref"][()] >= 0).all()


@pytest.mark.parametrize("keep", [1 << 20, 0], ids=["kept", "fresh"])
def test_a_drains_join_buffer_is_kept_for_the_next_drain_and_the_trace_is_the_same(tmp_path, monkeypatch, keep):
    """Each drain joins a tensor's staged rows into a buffer kept from the drain before (the same
    array, within JOIN_KEEP_BYTES for all tensors together; beyond it a fresh join): the trace is
    the one the unstaged recorder writes, bit for bit, after many drains wrote over the buffer."""
    import tensordiff.recorders.core as core_mod

    monkeypatch.setattr(core_mod, "JOIN_KEEP_BYTES", keep)
    g = torch.Generator().manual_seed(8)
    xs = [torch.randn(n, 3 * H, generator=g) for n in (5, 2, 3, 1, 4, 2, 6, 3, 2, 2, 1, 3)]
    seen = []

    def record(path, bound):
        with Recorder(path, side="serve", model={"num_layers": 4, "hidden_size": H}, stage_bytes=bound,
                      values=["aux"]) as rec:
            pos = 0
            for step, x in enumerate(xs):
                rows = rec.add_tokens("r", np.arange(pos, pos + len(x)), np.arange(len(x)), regime="decode", step=step)
                pos += len(x)
                serving.packed(rec, "aux", x, rows, labels=LABELS, token_offset=0, role="aux", private=step % 2 == 0)
                if bound and step % 4 == 3:
                    rec.write_staged()
                    seen.append(rec._join_bufs.get("aux"))

    record(tmp_path / "a.h5", 0)
    record(tmp_path / "b.h5", 1 << 20)
    if keep:
        # drains of 11, 15 and 8 rows: the buffer grows once (to twice its rows), then is written over
        assert seen[0] is not None and seen[1] is not seen[0] and seen[2] is seen[1] and len(seen[1]) == 22
    else:
        assert seen == [None] * len(seen)
    with TraceReader(str(tmp_path / "a.h5")) as a, TraceReader(str(tmp_path / "b.h5")) as b:
        np.testing.assert_array_equal(a.token_rows("aux"), b.token_rows("aux"))
        assert a.read_values("aux", raw=True).tobytes() == b.read_values("aux", raw=True).tobytes()
        assert a.read_values("aux", raw=True).tobytes() == np.concatenate([x.numpy() for x in xs]).tobytes()
        assert a.read_rms("aux").tobytes() == b.read_rms("aux").tobytes()
