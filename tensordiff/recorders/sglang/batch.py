"""What a forward batch says, read the same way by the hooks (forward) and their snapshots
(capture): its rows per request (``segments``), its regime, and whether two tensors are the very
same one (``same_tensor``). Torch is imported inside :func:`to_numpy` only."""

from __future__ import annotations


def to_numpy(t):
    import torch
    if isinstance(t, torch.Tensor):
        if t.device.type != "cpu":
            t = t.cpu()
        return t.detach().numpy().reshape(-1)
    import numpy as np
    return np.asarray(t).reshape(-1)


def segments(fb, n_rows: int) -> list[tuple[str, int, int]] | None:
    """[(rid, first row, row count)] of a target pass, in batch order."""
    rids = getattr(fb, "rids", None)
    if not rids:
        return None
    mode = fb.forward_mode
    bs = len(rids)
    if mode.is_decode():
        counts = [1] * bs
    elif mode.is_target_verify():
        if n_rows % bs:
            return None
        counts = [n_rows // bs] * bs
    else:
        counts = getattr(fb, "extend_seq_lens_cpu", None)
        if counts is None and getattr(fb, "extend_seq_lens", None) is not None:
            counts = to_numpy(fb.extend_seq_lens).tolist()
        if counts is None:
            return None
        counts = [int(c) for c in counts]
    if sum(counts) != n_rows or len(counts) != bs:
        return None
    out, start = [], 0
    for rid, c in zip(rids, counts):
        out.append((str(rid), start, c))
        start += c
    return out


def regime_of(mode) -> str:
    if mode.is_decode():
        return "decode"
    if mode.is_target_verify():
        return "target_verify"
    return "prefill"


def same_tensor(a, b) -> bool:
    if a is b:
        return True
    try:
        return a.shape == b.shape and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype
    except Exception:  # noqa: BLE001
        return False
