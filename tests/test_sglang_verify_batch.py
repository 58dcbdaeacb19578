"""The SGLang plugin's verify commit and draft-extend bookkeeping work on the whole batch with array
operations; checked here against the per-request loop they replaced (restated below as the
reference, on the same stand-in recorder), over random batches: accept lengths out of range, an
``accept_index`` that is absent, the first rows of each block, a path through the block, or wrong
for some request (too few rows, a row outside the block); requests stopped by max_new_tokens;
draft chains of the right length, of another length, missing; predictions on and off.

Compared: the token rows each request adds (request, positions, ids, in order), the trace row of
every verify row, the pass the draft extend is matched against, the dropped-row count, the
``spec_verify`` and ``spec_chain`` tables and their rows, the chains left, the warnings; for the
draft extend, the filler rows past each accept length, the shift check's counts and the row each
request's next draft chain starts from.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensordiff.conventions import SPEC_CHAIN, SPEC_VERIFY  # noqa: E402
from tensordiff.recorders.sglang import forward, verify  # noqa: E402
from tensordiff.recorders.prediction_tables import PassTable  # noqa: E402
from tensordiff.recorders.sglang.state import STATE, Pass  # noqa: E402
from tensordiff.recorders.staging import Later  # noqa: E402

pytestmark = pytest.mark.torch


class _Job:
    """A computed top-k job: its table and width (what the plugin's tables and chains read)."""

    def __init__(self, table):
        self.table = table
        self.width = table.shape[1]


class _Rec:
    def __init__(self):
        self.n = 0
        self.tokens = []
        self.plain_calls = []

    def add_tokens(self, rid, pos, ids, regime, step):
        self.tokens.append((rid, np.asarray(pos).tolist(), np.asarray(ids).tolist(), regime, step))
        out = np.arange(self.n, self.n + len(pos), dtype=np.int64)
        self.n += len(pos)
        return out

    def add_token_runs(self, rids, counts, pos, ids, regime, step):
        out, off = [], 0
        for rid, c in zip(rids, counts):
            if c:
                out.append(self.add_tokens(rid, pos[off:off + c], ids[off:off + c], regime, step))
                off += c
        return np.concatenate(out)

    def plain(self, name, values, rows, **kw):
        if isinstance(values, Later):
            assert values.width == values.value().shape[1]
            values = values.value()
        self.plain_calls.append((name, np.asarray(values).copy(), np.asarray(rows).copy(), kw.get("attrs")))
        return len(rows)


@pytest.fixture
def st(monkeypatch):
    for name, value in (("warned", set()), ("model", {"num_layers": 4}), ("dropped_rows", 0), ("spec_k", None),
                        ("verify_steps", 0), ("spec_chain", True), ("last_target", None), ("chain", {}),
                        ("shift_checked", 0), ("shift_mismatched", 0)):
        monkeypatch.setattr(STATE, name, value)
    monkeypatch.setattr(verify, "record_aux", lambda hs, rows: None)
    monkeypatch.setattr(verify, "record_topk", lambda *a, **k: None)
    return STATE


def _case(seed: int):
    """A random verify pass, its result and batch, and the draft chains held for it."""
    rng = np.random.default_rng(seed)
    bs, c = int(rng.integers(1, 7)), int(rng.integers(1, 5))
    n = bs * c
    segs = [(f"r{i}", i * c, c) for i in range(bs)]
    pos = np.concatenate([np.arange(c) + int(rng.integers(5, 40)) for _ in range(bs)]).astype(np.int64)
    ids = rng.integers(0, 100, n).astype(np.int64)
    acc = rng.integers(-1, c + 2, bs)
    kind = rng.choice(["none", "first", "path", "broken"])
    acc_index = None
    if kind != "none":
        acc_index = np.full((bs, c), -1, dtype=np.int64)
        for i, (_, s, _) in enumerate(segs):
            a = int(min(max(acc[i], 0), c))
            block = np.arange(s, s + c) if kind == "first" else s + rng.permutation(c)
            acc_index[i, :a] = block[:a]
            if kind == "broken" and a and rng.random() < 0.5:
                if rng.random() < 0.5:
                    acc_index[i, a - 1] = -1  # too few rows
                else:
                    acc_index[i, 0] = (s + c) % n if bs > 1 else n + 3  # a row outside the block
    reqs = []
    for i in range(bs):
        r = SimpleNamespace(rid=f"r{i}" if rng.random() < 0.9 else "other",
                            origin_input_ids=list(range(int(pos[i * c]))),
                            sampling_params=SimpleNamespace(max_new_tokens=int(rng.integers(0, 4))
                                                            if rng.random() < 0.5 else None))
        reqs.append(r)
    if rng.random() < 0.2:
        reqs = reqs[:-1]
    w = 7
    pred = rng.standard_normal((n, w)) if rng.random() < 0.8 else None
    if pred is not None:
        pred[:, -1] = 0.0  # the logsumexp column: the batch version's log-probs are logit - lse, exactly lp here
    lp = rng.standard_normal(n) if rng.random() < 0.8 else None
    if pred is None:
        lp = None  # the plugin gathers the next tokens' logits only where the pass has a top-k table
    chains = {}
    for i in range(bs):
        u = rng.random()
        if u < 0.7:
            chains[f"r{i}"] = [rng.standard_normal(5) for _ in range(c - 1)]
        elif u < 0.85:
            chains[f"r{i}"] = [rng.standard_normal(5) for _ in range(c)]
    result = SimpleNamespace(accept_lens=torch.from_numpy(acc), logits_output=SimpleNamespace(hidden_states=None),
                             accept_index=None if acc_index is None else torch.from_numpy(acc_index))
    keys = (np.array([s[0] for s in segs for _ in range(c)], dtype=object), pos, ids)
    return segs, keys, pred, lp, chains, result, SimpleNamespace(reqs=reqs)


def _reference_commit(p, result, batch, st):
    """The per-request loop the batch version replaced (same recorder, same tables)."""
    acc = result.accept_lens.numpy().astype(np.int64)
    bs = len(p.segments)
    reqs = list(batch.reqs)
    acc_index = result.accept_index
    if acc_index is not None:
        acc_index = acc_index.numpy().astype(np.int64).reshape(bs, -1)
    rid_rows, pos, ids = p.keys
    n = len(p.rows)
    view_rows, view_ids, view_pos = np.full(n, -1), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    steps, chains = [], []
    for i, (rid, s, c) in enumerate(p.segments):
        a = int(min(max(acc[i], 0), c))
        if acc_index is not None:
            path = acc_index[i][acc_index[i] >= 0][:a]
            if len(path) != a or (len(path) and (path.min() < s or path.max() >= s + c)):
                st.warned.add("accept-index")
                path = np.arange(s, s + a)
        else:
            path = np.arange(s, s + a)
        sel = path
        req = reqs[i] if i < len(reqs) and str(getattr(reqs[i], "rid", rid)) == rid else None
        if req is not None:
            limit = verify.position_limit(req)
            if limit is not None:
                sel = sel[pos[sel] < limit]
        st.dropped_rows += c - len(sel)
        if len(sel):
            p.rows[sel] = st.rec.add_tokens(rid, pos[sel], ids[sel], regime="target_verify", step=p.step)
        if st.spec_chain and c > 1 and p.rows[s] >= 0:
            k = c - 1
            ad = min(max(a - 1, 0), k)
            row = np.full(3 + 3 * k, np.nan)
            row[0], row[1], row[2] = ad, k, (ad if ad < k else -1)
            row[3:3 + k] = ids[s + 1:s + c]
            if p.pred is not None:
                row[3 + k:3 + 2 * k] = p.pred[s:s + k, 0]
            if p.lp_next is not None:
                row[3 + 2 * k:] = p.lp_next[s:s + k]
            steps.append((int(p.rows[s]), row))
            chain = st.chain.pop(rid, None)
            if chain is not None and len(chain) == c - 1 and p.pred is not None:
                chains.append((int(p.rows[s]), np.concatenate([np.stack(chain).reshape(-1),
                                                              p.pred[s:s + c - 1].reshape(-1)])))
        view_rows[s:s + len(path)] = p.rows[path]
        view_ids[s:s + len(path)] = ids[path]
        view_pos[s:s + len(path)] = pos[path]
    if steps:
        st.rec.plain(SPEC_VERIFY, np.stack([v for _, v in steps]), np.array([r for r, _ in steps]))
    if chains:
        st.rec.plain(SPEC_CHAIN, np.stack([v for _, v in chains]), np.array([r for r, _ in chains]))
    return view_rows, view_pos, view_ids


def _pass(segs, keys, pred, lp, batch: bool):
    """The verify pass: the reference loop reads numpy tables (``pred``, ``lp_next``), the batch
    version a :class:`PassTable` and the logits of the next tokens (``logit_next``)."""
    p = Pass(hs=None, rows=np.full(len(keys[1]), -1, dtype=np.int64), keys=keys, segments=segs, step=3,
             regime="target_verify")
    if batch:
        p.pred = None if pred is None else PassTable(_Job(pred), len(keys[1]), None)
        p.logit_next = lp
    else:
        p.pred, p.lp_next = pred, lp
    return p


@pytest.mark.parametrize("seed", range(60))
def test_verify_commit_is_the_per_request_loop(st, monkeypatch, seed):
    segs, keys, pred, lp, chains, result, batch = _case(seed)

    def run(fn, batch: bool):
        rec = _Rec()
        monkeypatch.setattr(STATE, "rec", rec)
        held = {k: [(_Job(a[None]), 0) for a in v] if batch else list(v) for k, v in chains.items()}
        monkeypatch.setattr(STATE, "chain", held)
        monkeypatch.setattr(STATE, "warned", set())
        monkeypatch.setattr(STATE, "dropped_rows", 0)
        p = _pass(segs, keys, pred, lp, batch)
        view = fn(p)
        return rec, p, view, dict(STATE.chain), set(STATE.warned), STATE.dropped_rows

    got = run(lambda p: (verify.commit_verify(p, result, batch), STATE.last_target)[1], True)
    want = run(lambda p: _reference_commit(p, result, batch, STATE), False)
    (rec, p, view, left, warned, dropped), (rec0, p0, view0, left0, warned0, dropped0) = got, want
    assert rec.tokens == rec0.tokens
    np.testing.assert_array_equal(p.rows, p0.rows)
    np.testing.assert_array_equal(view.rows, view0[0])
    if (p.rows >= 0).any():  # the view's keys matter where a row is kept
        np.testing.assert_array_equal(view.keys[1], view0[1])
        np.testing.assert_array_equal(view.keys[2], view0[2])
    assert dropped == dropped0
    assert ("accept-index" in warned) == ("accept-index" in warned0)
    assert left.keys() == left0.keys()
    calls = {name: (v, r, a) for name, v, r, a in rec.plain_calls}
    calls0 = {name: (v, r) for name, v, r, _ in rec0.plain_calls}
    assert calls.keys() == calls0.keys()
    for name, (v, r) in calls0.items():
        np.testing.assert_array_equal(calls[name][0], v)
        np.testing.assert_array_equal(calls[name][1], r)
    if SPEC_CHAIN in calls:
        a = calls[SPEC_CHAIN][2]
        assert (a["K"], a["draft_width"], a["target_width"]) == (segs[0][2] - 1, 5, 7)


def test_some_verify_cases_are_not_trivial():
    """The random cases above reach the paths that matter: rows dropped, chains recorded, a wrong
    accept_index."""
    kinds = set()
    for seed in range(60):
        segs, keys, pred, lp, chains, result, batch = _case(seed)
        kinds.add(("index", result.accept_index is None))
        kinds.add(("chains", bool(chains) and pred is not None and segs[0][2] > 1))
        kinds.add(("limits", any(r.sampling_params.max_new_tokens is not None for r in batch.reqs)))
    assert kinds >= {("index", True), ("index", False), ("chains", True), ("limits", True)}


@pytest.mark.parametrize("seed", range(40))
def test_draft_filler_shift_check_and_chain_start_are_the_per_request_loop(st, monkeypatch, seed):
    rng = np.random.default_rng(100 + seed)
    bs, c = int(rng.integers(1, 6)), int(rng.integers(1, 5))
    segs = [(f"r{i}", i * c, c) for i in range(bs)]
    n = bs * c
    rows = np.where(rng.random(n) < 0.8, np.arange(n), -1).astype(np.int64)
    tok = rng.integers(0, 9, n).astype(np.int64)
    ids = np.where(rng.random(n) < 0.9, np.append(tok[1:], 0), 99)
    n_acc = rng.integers(-1, c + 2, max(bs - int(rng.integers(0, 2)), 0))
    keys = (np.array([s[0] for s in segs for _ in range(c)], dtype=object), np.arange(n), tok)
    p = Pass(hs=None, rows=rows, keys=keys, segments=segs, step=1, regime="target_verify", committed=True)

    # the reference: the loops of the per-request version
    want_rows = rows.copy()
    for i, (_, s, cc) in enumerate(segs):
        if i < len(n_acc):
            want_rows[s + int(min(max(n_acc[i], 0), cc)):s + cc] = -1
    checked = mismatched = 0
    for _, s, cc in segs:
        seg = np.arange(s, s + cc - 1)
        seg = seg[(want_rows[seg] >= 0) & (want_rows[seg + 1] >= 0)] if len(seg) else seg
        checked += len(seg)
        mismatched += int(np.count_nonzero(ids[seg] != tok[seg + 1]))
    last = [s + (cc if i >= len(n_acc) else int(min(max(n_acc[i], 1), cc))) - 1 for i, (_, s, cc) in enumerate(segs)]

    seen = {}
    monkeypatch.setattr(forward, "to_numpy", lambda t: np.asarray(t).reshape(-1))
    monkeypatch.setattr(forward, "_record_draft_ids", lambda i, r: seen.setdefault("rows", r.copy()))
    monkeypatch.setattr(forward, "_draft_predictions", lambda hs, r, pp, acc: seen.setdefault("acc", acc))
    monkeypatch.setattr(STATE, "labels", ["layer1"])
    monkeypatch.setattr(STATE, "model", {"hidden_size": 4, "num_layers": 4})
    monkeypatch.setattr(STATE, "cfg", SimpleNamespace(topk=3, wants_values=lambda name: True))
    monkeypatch.setattr(STATE, "rec", SimpleNamespace(_packed=lambda *a, **k: 1))  # what serving.packed calls
    monkeypatch.setattr(STATE, "fc_out", None)
    hs = torch.zeros(n, 4)
    p.hs = hs
    monkeypatch.setattr(STATE, "last_target", p)
    mode = SimpleNamespace(is_extend=lambda: True, is_draft_extend_v2=lambda: False, is_target_verify=lambda: False)
    fb = SimpleNamespace(forward_mode=mode, spec_info=SimpleNamespace(hidden_states=hs, num_accept_tokens=n_acc),
                         input_ids=ids)
    forward.record_draft(SimpleNamespace(), fb)
    np.testing.assert_array_equal(seen["rows"], want_rows)
    assert (STATE.shift_checked, STATE.shift_mismatched) == (checked, mismatched)
    assert ("shift" in STATE.warned) == (mismatched > 0)
    assert forward.last_accepted_rows(p, seen["acc"]).tolist() == last
