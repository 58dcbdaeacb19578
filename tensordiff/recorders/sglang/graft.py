"""Graft in SGLang (``TENSORDIFF_GRAFT=OTHER.h5:STATE``): during the target's forward, the residual
stream at boundary STATE (``layer<b>``, the input of decoder layer b, 1 <= b < n) is replaced by
OTHER's recorded values of the same tokens, so a diff of the grafted trace against OTHER says
whether anything after STATE still diverges (:func:`tensordiff.signatures.graft_finding` reads the
trace's ``graft`` attribute this sets).

Rows are matched by the request's tokens: a request is the sequence of OTHER whose key is its
request id, else the sequences whose tokens it has followed from position 0, and every row's token
must be OTHER's at that position. A row of a prefill or decode pass without its value in OTHER
stops the recording in one line (never an ungrafted row recorded as grafted). In a target-verify
pass the rows after a drafted token OTHER's sequence does not have are proposals the verify
rejects when the run follows OTHER: they keep the engine's value (counted in the trace's
``graft`` statistics). A pass the plugin does not key (paused, no requests) is not grafted.

The pre-hook on layer b is installed before the catalog's, so the catalog records the grafted
value. SGLang's residual stream (an operand and the residual it owes) is exported as a complete
value with the handoff SGLang uses across an eager break, and layer b is entered with the grafted
value on a fresh stream, as layer 0 is with the embeddings. Eager passes only (start the server
with ``--disable-cuda-graph``). Taps, ``embed`` and the last boundary are not grafted in the
engine yet: ``record train --graft`` grafts them on the HF side.
"""

from __future__ import annotations

from typing import Any

from .state import STATE, log


class EngineGraft:
    def __init__(self, src: Any, site: str, n_layers: int):
        self.src = src
        self.site = site                    # "layer": a pre-hook of the decoder layer
        self.keys = {k for k, _ in src.index}
        self.handles: list[Any] = []
        self.cands: dict[str, set[str]] = {}        # request -> the sequences of OTHER it can be
        self.grafted = 0
        self.kept_draft_rows = 0

    # -- matching -------------------------------------------------------------------------

    def _candidates(self, rid: str, first_pos: int) -> set[str]:
        got = self.cands.get(rid)
        if got is not None:
            return got
        if rid in self.keys:
            got = {rid}
        elif first_pos == 0:
            got = set(self.keys)
        else:
            raise ValueError(f"TENSORDIFF_GRAFT: request {rid} starts at position {first_pos} (a radix-cache hit?) "
                             "and its id is no sequence of the graft's trace: start the server with "
                             "--disable-radix-cache")
        self.cands[rid] = got
        return got

    def rows_of(self, keys: Any) -> tuple[list[int], list[int]]:
        """(batch rows, rows of OTHER's state) of the pass whose keys are ``keys``."""
        verify = keys.regime == "target_verify"
        idx = self.src.index
        mine: list[int] = []
        theirs: list[int] = []
        for rid, s, c in keys.segs:
            rid = str(rid)
            cands = self._candidates(rid, int(keys.pos[s]))
            for i in range(s, s + c):
                p, t = int(keys.pos[i]), int(keys.ids[i])
                left = {k for k in cands if idx.get((k, p), (0, None))[1] == t}
                if not left:
                    if verify and i > s:   # a drafted token OTHER's sequence lacks: the verify rejects it
                        self.kept_draft_rows += s + c - i
                        break
                    raise ValueError(f"TENSORDIFF_GRAFT: {self.src.path} has no row of {self.src.state} for "
                                     f"request {rid} position {p} token {t} (its tokens are not this run's)")
                if not verify or i == s:
                    cands = left
                    self.cands[rid] = left
                mine.append(i)
                theirs.append(idx[(min(left), p)][0])
        return mine, theirs

    # -- the hooks -------------------------------------------------------------------------

    def replace(self, hs: Any, res: Any) -> tuple[Any, Any] | None:
        import numpy as np
        import torch

        st = STATE
        keys = st.ctx_keys
        if keys is None or st.broken or hs is None:
            return None
        try:
            mine, theirs = self.rows_of(keys)
            if not mine:
                return None
            order = np.argsort(theirs, kind="stable")
            vals = self.src.reader.read_values_at(self.src.state, np.asarray(theirs, dtype=np.int64)[order])
            back = np.empty_like(order)
            back[order] = np.arange(len(order))
            vals = vals[back]
            if vals.shape[-1] != hs.shape[-1]:
                raise ValueError(f"TENSORDIFF_GRAFT: {self.src.state} is [.., {hs.shape[-1]}] here and "
                                 f"[.., {vals.shape[-1]}] in {self.src.path}")
        except ValueError as e:
            refuse(str(e))
            return None
        except Exception as e:  # noqa: BLE001  (reading OTHER failed: the engine goes on, recording stops)
            refuse(f"TENSORDIFF_GRAFT: reading {self.src.state} from {self.src.path} failed ({type(e).__name__}: {e})")
            return None
        at = torch.as_tensor(mine, dtype=torch.long, device=hs.device)
        hs = hs.clone()
        hs[at] = torch.from_numpy(np.ascontiguousarray(vals)).to(device=hs.device, dtype=hs.dtype)
        if res is not None:
            res = res.clone()
            res[at] = 0
        self.grafted += len(mine)
        st.capture_attrs["graft"] = {"rows": self.grafted, "draft_rows_kept": self.kept_draft_rows}
        return hs, res

    def layer_pre_hook(self, module, args, kwargs):
        """Decoder layer b's input: SGLang's residual stream (an operand and the residual it owes)
        exported as a complete value (the handoff SGLang itself uses across an eager break), the
        grafted rows replaced, and layer b entered with that value on a fresh stream, as layer 0
        enters with the embeddings."""
        st = STATE
        if st.ctx_keys is None or st.broken:
            return None
        from sglang.srt.layers.layer_boundary.residual import batch as rb

        args, kwargs = list(args), dict(kwargs)
        hs = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
        fb = kwargs.get("forward_batch", args[2] if len(args) > 2 else None)
        if hs is None or fb is None:
            return None
        handoff = rb.export_replay_handoff(hs, fb)
        if handoff.residual is not None and not getattr(handoff.update, "is_plain_add", True):
            refuse("TENSORDIFF_GRAFT: this layer's residual update is not a plain add: not a layout the graft knows")
            return None
        full = handoff.value if handoff.residual is None else handoff.value + handoff.residual
        got = self.replace(full, None)
        rb.start(fb)
        value = full if got is None else got[0]
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = value
        else:
            args[1] = value
        return tuple(args), kwargs


def refuse(msg: str) -> None:
    """The recorder's error path in one line: recording stops, the trace is closed with the error."""
    st = STATE
    log.error("tensordiff: recording stopped: %s", msg)
    st.broken = True
    if st.rec is not None:
        try:
            st.rec.close(ValueError(msg))
        except Exception:  # noqa: BLE001
            log.exception("tensordiff: closing the trace after the error failed")


def install_graft(runner) -> dict[str, Any]:
    """The pre-hook that grafts ``STATE.cfg.graft`` into the target; the trace's ``graft`` attribute.
    Raises ValueError (one line) on a spec this engine cannot graft."""
    import inspect

    from ..graft_source import open_graft_source
    from ..structure import find_decoder

    st = STATE
    spec = st.cfg.graft
    src = open_graft_source(spec, "TENSORDIFF_GRAFT")
    try:
        layers, _, _ = find_decoder(runner.model)
        n = int(st.model.get("num_layers") or len(layers))
        b = src.st.layer
        if src.st.kind != "boundary" or b is None or not 1 <= b < n:
            raise ValueError(f"TENSORDIFF_GRAFT: SGLang grafts a boundary layer1..layer{n - 1}, not {src.state} "
                             "(graft taps, embed and the last boundary with record train --graft)")
        params = inspect.signature(layers[b].forward).parameters
        if "hidden_states" not in params or "forward_batch" not in params:
            raise ValueError(f"TENSORDIFF_GRAFT: {type(layers[b]).__name__}.forward takes no "
                             "(hidden_states, forward_batch): not a layout the graft knows")
        try:
            from sglang.srt.layers.layer_boundary.residual import batch as rb
        except ImportError:
            raise ValueError("TENSORDIFF_GRAFT: this SGLang has no residual-stream handoff "
                             "(layer_boundary.residual.batch): not a version the graft knows") from None
        if not hasattr(rb, "export_replay_handoff") or not hasattr(rb, "start"):
            raise ValueError("TENSORDIFF_GRAFT: this SGLang has no residual-stream handoff "
                             "(layer_boundary.residual.batch): not a version the graft knows")
        g = EngineGraft(src, "layer", n)
        g.handles.append(layers[b].register_forward_pre_hook(g.layer_pre_hook, with_kwargs=True))
    except BaseException:
        src.close()
        raise
    st.graft = g
    from .ranks import server_arg

    if not bool(server_arg(runner, "disable_cuda_graph", False)):
        st.warn_once("graft-graphs", "TENSORDIFF_GRAFT grafts eager passes only; CUDA-graph replays (decode, verify) "
                     "run the engine's own values: start the server with --disable-cuda-graph")
    log.info("tensordiff: grafting %s from %s", src.state, src.path)
    return {"from": src.path, "state": src.state, "engine": "sglang"}
