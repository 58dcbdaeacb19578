"""Torch tensors in the form a trace stores them: trace dtype names, host arrays (bf16 as its
bits), and the top-k prediction rows a recorder writes for logits."""

from __future__ import annotations

import numpy as np
import torch

from .. import conventions
from ..kernels import topk as _topk_f32

__all__ = ["TORCH_DTYPES", "logical_dtype", "to_storage", "topk_rows"]

_LOGICAL = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
}
TORCH_DTYPES = {v: k for k, v in _LOGICAL.items()}   # trace dtype name -> torch dtype


def logical_dtype(dtype: torch.dtype) -> str:
    """The trace dtype name of a torch floating dtype (other floating types record as float32)."""
    if dtype in _LOGICAL:
        return _LOGICAL[dtype]
    if dtype.is_floating_point:
        return "float32"
    raise ValueError(f"cannot record a {dtype} tensor: tensordiff records floating-point states")


def to_storage(x: torch.Tensor) -> np.ndarray:
    """A CPU tensor as the numpy array the writer stores (bf16 as its uint16 bits); shares memory."""
    x = x.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16)
    return x.numpy()


_TOPK_ROWS = 2048
# blocks of at most this many logits take torch.logsumexp itself: one call instead of the
# seven of :func:`_logsumexp_from_max`, whose saved max pass is worth it only on large blocks
_OWN_MAX_ELEMENTS = 1 << 16


def _logsumexp_from_max(x: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(x, dim=-1, keepdim=True)`` for fp32 rows ``x`` [n, V] whose row maxima
    ``top`` [n, 1] (the first top-k column) are known: the same steps as torch's own (a max that
    is infinite counts as 0; sum of exp(x - max), log, plus max) without its pass for the max, so
    the same bits (tests/test_sglang_overhead_paths.py checks them against torch's). One [n, V]
    temporary: the exponentials are taken in place in the difference."""
    m = top.masked_fill(top.isinf(), 0)
    return torch.sum(torch.sub(x, m).exp_(), dim=-1, keepdim=True).log_().add_(m)


def topk_rows(logits: torch.Tensor, k: int = conventions.DEFAULT_TOPK,
              id_map: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k rows of ``logits`` [..., V] as the trace stores them: [n, 2k+1] float64 =
    [token ids (k) | log-probabilities (k) | logsumexp], best first, k = min(k, V), computed in
    fp32 where the logits live. ``id_map`` [V] turns column ids into target ids (a draft's
    reduced vocabulary: ``d2t + arange``). The table is filled in place (no per-column float64
    copies and no concatenation): each column gets the float64 of the same fp32 value.

    On the CPU the top-k is the compiled :func:`tensordiff._kernels.topk` (one scan per row, no
    thread pool: a few torch ops per pass cost more than the selection itself): the values
    ``torch.topk`` gives, NaN first, and among equal values the lower index first (the token an
    argmax picks; torch's order among ties is unspecified). The logsumexp and the log-probabilities
    are torch's float32 steps on either device, so the same bits."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    kk = min(int(k), flat.shape[-1])
    n = flat.shape[0]
    if flat.device.type == "cpu" and kk > 0:
        return torch.from_numpy(_topk_rows_cpu(flat, kk, id_map))
    if id_map is not None:
        id_map = id_map.to(flat.device)
    out = torch.empty((n, 2 * kk + 1), dtype=torch.float64, device=flat.device)
    for s in range(0, n, _TOPK_ROWS):  # fp32 copies of at most _TOPK_ROWS rows at a time
        x = flat[s:s + _TOPK_ROWS].float()
        v, i = torch.topk(x, kk, dim=-1)
        o = out[s:s + x.shape[0]]
        lse = _logsumexp(x, v)
        o[:, :kk] = id_map[i] if id_map is not None else i
        o[:, kk:2 * kk] = v.sub_(lse)
        o[:, 2 * kk:] = lse
    return out


def _logsumexp(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The logsumexp of fp32 rows ``x`` whose top-k values ``v`` are known (both paths of
    :func:`topk_rows`, the same steps)."""
    if x.numel() <= _OWN_MAX_ELEMENTS:  # small: torch's own (one call, its max pass costs little)
        return torch.logsumexp(x, dim=-1, keepdim=True)
    return _logsumexp_from_max(x, v[:, :1])  # large (a prefill's rows): the max is the top-1 column


def _topk_rows_cpu(flat: torch.Tensor, kk: int, id_map: torch.Tensor | None) -> np.ndarray:
    n = flat.shape[0]
    out = np.empty((n, 2 * kk + 1), dtype=np.float64)
    ids = id_map.detach().cpu().numpy() if id_map is not None else None
    for s in range(0, n, _TOPK_ROWS):  # fp32 copies of at most _TOPK_ROWS rows at a time
        x = flat[s:s + _TOPK_ROWS].float()
        if x.stride(-1) != 1:
            x = x.clone(memory_format=torch.contiguous_format)  # (torch calls a [n, 1] column of any stride contiguous)
        r = x.shape[0]
        v = np.empty((r, kk), dtype=np.float32)
        i = np.empty((r, kk), dtype=np.int64)
        _topk_f32(x.numpy(), kk, v, i)
        lse = _logsumexp(x, torch.from_numpy(v)).numpy()
        o = out[s:s + r]
        o[:, :kk] = ids[i] if ids is not None else i
        np.subtract(v, lse, out=v)  # float32, as torch subtracts: the same bits
        o[:, kk:2 * kk] = v
        o[:, 2 * kk:] = lse
    return out
