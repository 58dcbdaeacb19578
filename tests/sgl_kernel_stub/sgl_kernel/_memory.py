"""KV-slot bookkeeping ops (test stand-in; see the package docstring).

``req_to_token`` is the request -> KV-slot table, ``[num_reqs, pool_len]``.
The reference kernels address it as a flat buffer with row stride
``pool_len``; the helpers below do the same.
"""

from __future__ import annotations

import ctypes

import torch


def _ints(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.reshape(-1).tolist()]


def _flat_rows(req_to_token: torch.Tensor) -> torch.Tensor:
    if not req_to_token.is_contiguous():
        raise ValueError("req_to_token must be contiguous")
    return req_to_token.view(-1)


def _segments(start_offset: torch.Tensor, end_offset: torch.Tensor):
    """(i, start, end, out_offset) with out_offset = sum of earlier lengths."""
    starts, ends = _ints(start_offset), _ints(end_offset)
    out = 0
    for i, (s, e) in enumerate(zip(starts, ends)):
        yield i, s, e, out
        out += e - s


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req_i, start_i:end_i] = the i-th run of out_cache_loc.

    Runs are packed back to back in ``out_cache_loc`` in batch order.
    """
    flat = _flat_rows(req_to_token)
    reqs = _ints(req_pool_indices)
    src = out_cache_loc.reshape(-1)
    for i, s, e, off in _segments(start_offset, end_offset):
        n = e - s
        if n <= 0:
            continue
        base = reqs[i] * pool_len
        flat[base + s : base + e] = src[off : off + n].to(flat.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Gather: the i-th run of out_cache_loc = req_to_token[req_i, start_i:end_i]."""
    flat = _flat_rows(req_to_token)
    reqs = _ints(req_pool_indices)
    dst = out_cache_loc.view(-1)
    for i, s, e, off in _segments(start_offset, end_offset):
        n = e - s
        if n <= 0:
            continue
        base = reqs[i] * pool_len
        dst[off : off + n] = flat[base + s : base + e].to(dst.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    speculative_num_steps: int,
) -> None:
    """Copy each request's ``topk * num_steps`` slots that follow ``seq_len``.

    Request i's block lands at ``out_cache_loc[i * topk * num_steps :]``.
    """
    flat = _flat_rows(req_to_token)
    dst = out_cache_loc.view(-1)
    width = int(topk) * int(speculative_num_steps)
    for i, (req, seq_len) in enumerate(zip(_ints(req_pool_indices), _ints(seq_lens))):
        base = req * pool_len + seq_len
        dst[i * width : (i + 1) * width] = flat[base : base + width].to(dst.dtype)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every KV buffer (given by raw address and row stride in bytes),
    copy row ``src_loc[j]`` to row ``tgt_loc[j]``.

    All source rows are read before any target row is written, as in the
    reference kernel (which loads a whole tile before storing it).
    """
    tgt = tgt_loc.reshape(-1).to(torch.int64)
    src = src_loc.reshape(-1).to(torch.int64)
    if tgt.numel() == 0:
        return
    if tgt.numel() != src.numel():
        raise ValueError("tgt_loc and src_loc differ in length")
    rows_needed = int(torch.maximum(tgt.max(), src.max()).item()) + 1
    for ptr, stride in zip(_ints(data_ptrs), _ints(strides)):
        if ptr == 0 or stride <= 0:
            continue
        raw = (ctypes.c_uint8 * (rows_needed * stride)).from_address(ptr)
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(rows_needed, stride)
        rows[tgt] = rows[src]


def build_draft_decode_metadata_cpu(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    pool_len: int,
) -> torch.Tensor:
    """Per-candidate KV tables for multi-step draft decoding.

    Returns ``[bs * topk, pool_len]``; row ``b * topk + t`` holds request b's
    prefix slots ``req_to_token[req_b, :seq_len_b]`` followed by the slots of
    candidate t's draft tokens, ``req_to_token[req_b, seq_len_b + t * num_steps
    : seq_len_b + (t + 1) * num_steps]`` -- the layout that
    ``assign_draft_cache_locs_contiguous`` hands out and that the triton
    ``generate_draft_decode_kv_indices`` reads back (page size 1).
    Rows index the returned table with ``req_pool_indices = arange(bs * topk)``.
    """
    topk, num_steps, pool_len = int(topk), int(num_steps), int(pool_len)
    table = req_to_token.reshape(req_to_token.shape[0], -1)
    reqs, lens = _ints(req_pool_indices), _ints(seq_lens)
    out = torch.zeros(
        (len(reqs) * topk, pool_len), dtype=req_to_token.dtype, device=req_to_token.device
    )
    for b, (req, seq_len) in enumerate(zip(reqs, lens)):
        row = table[req]
        for t in range(topk):
            dst = out[b * topk + t]
            n_prefix = min(seq_len, pool_len)
            dst[:n_prefix] = row[:n_prefix]
            lo = seq_len + t * num_steps
            hi = min(lo + num_steps, row.numel())
            n = max(0, min(hi - lo, pool_len - seq_len))
            if n > 0:
                dst[seq_len : seq_len + n] = row[lo : lo + n]
    return out
