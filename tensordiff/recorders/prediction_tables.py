"""The prediction tables both serve plugins (:mod:`.sglang`, :mod:`.vllm`) write, engine-agnostic:
a pass's top-k rows (:class:`PassTable`), ``target_topk`` / ``draft_topk``, ``draft_fc_output``,
``spec_verify`` and ``spec_chain`` (layouts in :mod:`tensordiff.conventions` and
docs/recorders.md). Each function takes the plugin's state ``st`` (its ``rec``, ``model``,
``cfg``, ``spec_k``, ``verify_steps`` and ``dirty``).

Standard library only at import time (every engine process that loads a plugin imports this);
numpy and the recorder core are imported inside the functions that need them.
"""

from __future__ import annotations

from .. import conventions
from . import serving


class PassTable:
    """The top-k rows of one pass: ``job`` (a :class:`~tensordiff.recorders.staging.TopkJob`)
    holds the rows ``need`` of the pass's ``n_rows`` (None: every row), computed when the
    recorder drains its staged work (or on first read)."""

    __slots__ = ("_full", "job", "n_rows", "need")

    def __init__(self, job, n_rows: int, need):
        self.job = job
        self.n_rows = int(n_rows)
        self.need = need
        self._full = None

    @property
    def width(self) -> int:
        return self.job.width

    def full(self):
        """[n_rows, width] float64, NaN in rows not computed (made once: a verify pass's
        spec_verify and spec_chain rows both read it)."""
        import numpy as np

        t = self.job.table
        if self.need is None:
            return t
        if self._full is None:
            self._full = np.full((self.n_rows, t.shape[1]), np.nan)
            self._full[self.need] = t
        return self._full

    def ref(self, r: int):
        """(job, row of its table) of pass row ``r``, or None where that row is not computed."""
        import numpy as np

        if self.need is None:
            return self.job, int(r)
        i = int(np.searchsorted(self.need, r))
        return (self.job, i) if i < len(self.need) and int(self.need[i]) == int(r) else None

    def refs(self, rs) -> list:
        """:meth:`ref` of every pass row of ``rs`` (an int64 array), one search for all."""
        import numpy as np

        if self.need is None:
            return [(self.job, r) for r in rs.tolist()]
        need = self.need
        at = np.searchsorted(need, rs)
        ok = (at < len(need)) & (need[np.minimum(at, max(len(need) - 1, 0))] == rs) if len(need) else at < 0
        return [(self.job, i) if k else None for i, k in zip(at.tolist(), ok.tolist())]

    def rows_of(self, rows):
        """The trace rows of the computed rows, given the pass's trace rows."""
        return rows if self.need is None else rows[self.need]


class JoinedJob:
    """The top-k table of a pass's rows computed by several jobs: ``parts`` = [(job, the positions
    of its rows in the table)], ``n`` rows in all, every job of one width. Read as a job is
    (:attr:`width`, :attr:`table`)."""

    __slots__ = ("_table", "n", "parts", "width")

    def __init__(self, parts: list, n: int):
        self.parts = parts
        self.n = int(n)
        self.width = int(parts[0][0].width)
        self._table = None

    @property
    def table(self):
        import numpy as np

        if self._table is None:
            t = np.empty((self.n, self.width))
            for job, at in self.parts:
                t[at] = job.table
            self._table = t
            self.parts = []  # the jobs' own tables are no longer needed
        return self._table


def kept_rows(rec, rows):
    """Indices of the rows of a pass the recorder will keep: a trace row (not -1) at a position
    the sampling keeps. Top-k tables are computed for these rows only."""
    import numpy as np

    keep = rows >= 0
    if not rec.sample.keeps_all:
        keep &= rec.sample.mask(rec.positions_of(np.where(keep, rows, 0)))
    return np.flatnonzero(keep)


def record_topk(st, name: str, table: PassTable, rows, token_offset: int, source: str) -> None:
    """Append the top-k rows of ``table`` for the pass's token ``rows`` (-1 skipped; rows whose
    predictions were not computed are not recorded)."""
    from .staging import Later

    n = st.model.get("num_layers") or 0
    order = {conventions.TARGET_TOPK: n + 0.6, conventions.DRAFT_TOPK: n + 0.9}[name]
    job = table.job
    st.rec.plain(name, Later(table.width, lambda: job.table), table.rows_of(rows), role=name,
                 token_offset=token_offset, order=order,
                 attrs={"layout": "ids[0:k] | logprobs[k:2k] | logsumexp[2k]",
                        "k": conventions.topk_k(table.width), "source": source})
    st.dirty = True


def record_fc(st, fc_out, rows, source: str, private: bool = False) -> None:
    """``draft_fc_output``: the draft's fc output on the rows of ``draft_input`` (token_offset 1)."""
    n = st.model.get("num_layers") or 0
    serving.record(st.rec, conventions.DRAFT_FC, fc_out, rows, kind="other", role=conventions.DRAFT_FC, token_offset=1,
                   order=n + 0.8, values=st.cfg.wants_values(conventions.DRAFT_FC), private=private,
                   attrs={"source": source})
    st.dirty = True


def record_steps(st, rows, steps, width: int) -> None:
    """``spec_verify``: one row per verify step, [accepted, K, first rejected or -1, draft tokens,
    the target's top-1 at each draft position, the target's log-prob of each draft token]
    (``steps``: an array or a :class:`~tensordiff.recorders.staging.Later`)."""
    if st.spec_k is None:
        st.spec_k = conventions.spec_verify_drafts(width)
    if width != conventions.spec_verify_width(st.spec_k):
        st.warn_once("spec-k", "a verify step with another number of draft tokens than %d; not recorded", st.spec_k)
        return
    n = st.model.get("num_layers") or 0
    st.rec.plain(conventions.SPEC_VERIFY, steps, rows, role=conventions.SPEC_VERIFY, order=n + 0.95,
                 attrs={"layout": "accepted, K, first_rejected (-1: none), draft_tokens[K], target_top1[K], "
                                  "target_logprob_of_draft[K]", "k": st.spec_k,
                        "what": "one row per verify step, on the token row of the step's first (verified) row"})
    st.verify_steps += len(rows)
    st.dirty = True


def record_chain_rows(st, rows, chains: list, blocks, tw: int, k: int) -> None:
    """``spec_chain`` rows of the verify steps (token ``rows``) whose chain is whole: ``chains[j]``
    the k (top-k job, row) of step j's draft positions (None: not known), all of one width;
    ``blocks()`` the target's top-k rows at every step's draft positions [len(rows), k, tw]. The
    table is filled when the rows are written."""
    import numpy as np

    from .staging import Later

    got = [j for j, ch in enumerate(chains) if ch is not None and len(ch) == k]
    if not got:
        return
    dw = chains[got[0]][0][0].width
    got = [j for j in got if all(job.width == dw for job, _ in chains[j])]
    picked = [chains[j] for j in got]

    def chain_rows():
        return np.concatenate([chain_draft_rows(picked, k, dw), blocks()[got].reshape(len(got), -1)], axis=1)

    record_chains(st, rows[got], Later(k * (dw + tw), chain_rows), dw, tw, k)


def chain_draft_rows(chains: list, k: int, dw: int):
    """The draft top-k rows of ``chains`` (each k (top-k job, row), every job of width ``dw``) as
    [len(chains), k * dw] float64: a draft position whose rows all come from one job (the usual
    case: the pass's draft_topk table, a decode step's job) is taken with one index."""
    import numpy as np

    m = len(chains)
    out = np.empty((m, k, dw))
    for p in range(k):
        col = [ch[p] for ch in chains]
        job0 = col[0][0]
        if all(job is job0 for job, _ in col):
            out[:, p] = job0.table[np.fromiter((i for _, i in col), dtype=np.int64, count=m)]
        else:
            for r, (job, i) in enumerate(col):
                out[r, p] = job.table[i]
    return out.reshape(m, k * dw)


def record_chains(st, rows, table, dw: int, tw: int, k: int) -> None:
    """``spec_chain``: per verify step, [draft top-k rows of positions 0..K-1 | target top-k rows
    of verify rows 0..K-1], flat."""
    n = st.model.get("num_layers") or 0
    st.rec.plain(conventions.SPEC_CHAIN, table, rows, role=conventions.SPEC_CHAIN, order=n + 0.96,
                 attrs={"layout": "K draft top-k rows (draft positions 0..K-1), then K target top-k rows (verify rows "
                                  "0..K-1); each row ids | logprobs | logsumexp",
                        "K": k, "draft_width": dw, "target_width": tw,
                        "what": "one row per verify step, on the token row of its spec_verify row"})
    st.dirty = True
