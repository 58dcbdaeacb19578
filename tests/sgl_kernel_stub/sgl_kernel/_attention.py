"""Paged attention for the ``intel_amx`` backend (test stand-in; see the package docstring).

Both ops read K/V through the paged cache: request b's token at position p
lives in cache row ``req_to_token[req_pool_indices[b], p]``. Math is float32,
one request at a time; GQA heads are expanded by repetition.

Masking conventions (from SGLang's triton extend/decode kernels):

* causal: the query at absolute position q sees keys ``k <= q``;
* ``sliding_window`` here is the backend's ``layer.sliding_window_size + 1``:
  when > 0 a query sees only keys with ``q - k < sliding_window``;
* ``logit_cap > 0``: scores become ``cap * tanh(score / cap)``;
* ``sinks`` (one logit per head) join the softmax denominator only.
"""

from __future__ import annotations

import torch


def _ints(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.reshape(-1).tolist()]


def _dequant(rows: torch.Tensor, scale: float) -> torch.Tensor:
    rows = rows.to(torch.float32)
    return rows * scale if scale not in (None, 1.0) else rows


def _quant_into(cache: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor, scale: float):
    rows = rows.to(torch.float32)
    if scale not in (None, 1.0) and cache.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        rows = rows / scale
    cache[loc] = rows.to(cache.dtype).view(-1, *cache.shape[1:])


def _attend(
    q: torch.Tensor,  # [Lq, H, D] float32
    k: torch.Tensor,  # [Lk, Hkv, D] float32
    v: torch.Tensor,  # [Lk, Hkv, Dv] float32
    allowed: torch.Tensor | None,  # [Lq, Lk] bool, None = all
    sm_scale: float,
    logit_cap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    h, hkv = q.shape[1], k.shape[1]
    if h != hkv:
        if h % hkv:
            raise ValueError(f"{h} query heads do not divide into {hkv} kv heads")
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * sm_scale
    if logit_cap and logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if allowed is not None:
        scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(torch.float32).view(h, 1, 1).expand(h, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows that see no key at all
    return torch.einsum("hqk,khd->qhd", probs, v)


def decode_attention_cpu(
    query: torch.Tensor,  # [bs, H, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, Dv]
    k_scale: float,
    v_scale: float,
    output: torch.Tensor,  # [bs, H, Dv]
    key: torch.Tensor | None,  # [bs, Hkv, D], written to k_cache[loc] first
    value: torch.Tensor | None,
    loc: torch.Tensor,  # [bs]
    attn_logits: torch.Tensor,  # scratch of the native kernel; unused here
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,  # includes the token being decoded
    sm_scale: float,
    logit_cap: float,
    is_cross_attention: bool,
    sliding_window: int,
    encoder_lens: torch.Tensor | None,
    sinks: torch.Tensor | None,
) -> None:
    """One query token per request against its whole cached context."""
    if is_cross_attention:
        raise NotImplementedError("sgl_kernel test stub: cross-attention decode")
    if key is not None and value is not None:
        cache_loc = loc.reshape(-1).to(torch.int64)
        _quant_into(k_cache, cache_loc, key, k_scale)
        _quant_into(v_cache, cache_loc, value, v_scale)
    table = req_to_token.reshape(req_to_token.shape[0], -1)
    for b, (req, seq_len) in enumerate(zip(_ints(req_pool_indices), _ints(seq_lens))):
        first = max(0, seq_len - sliding_window) if sliding_window and sliding_window > 0 else 0
        slots = table[req, first:seq_len].to(torch.int64)
        k = _dequant(k_cache[slots], k_scale)
        v = _dequant(v_cache[slots], v_scale)
        q = query[b : b + 1].to(torch.float32)
        out = _attend(q, k, v, None, sm_scale, logit_cap, sinks)
        output[b] = out[0].to(output.dtype)


def extend_attention_cpu(
    q_extend: torch.Tensor,  # [tokens, H, D]
    k_extend: torch.Tensor | None,  # [tokens, Hkv, D]; None: read from the cache
    v_extend: torch.Tensor | None,
    o_extend: torch.Tensor,  # [tokens, H, Dv]
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    k_scale: float,
    v_scale: float,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,  # prefix + extend, per request
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_len_extend: int,
    sm_scale: float,
    logit_cap: float,
    is_cross_attention: bool,
    sliding_window: int,
    encoder_lens: torch.Tensor | None,
    sinks: torch.Tensor | None,
    tree_mask: torch.Tensor | None,
    is_causal: bool,
) -> None:
    """Prefill / verify: each request's new tokens against prefix + themselves.

    ``tree_mask`` (speculative verify with a real tree) replaces the causal
    mask among the new tokens. On CPU SGLang builds it in the QLEN_ONLY
    layout: request b owns ``extend_len_b ** 2`` row-major cells after the
    blocks of earlier requests and its prefix stays fully visible. A mask
    sized for the FULL_MASK layout (``extend_len_b * seq_len_b`` cells per
    request, prefix columns included) is accepted too.
    """
    if is_cross_attention:
        raise NotImplementedError("sgl_kernel test stub: cross-attention extend")
    table = req_to_token.reshape(req_to_token.shape[0], -1)
    reqs, lens = _ints(req_pool_indices), _ints(seq_lens)
    ext_lens, starts = _ints(extend_seq_lens), _ints(extend_start_loc)
    mask_flat = tree_mask.reshape(-1) if tree_mask is not None and tree_mask.numel() else None
    full_layout = False
    if mask_flat is not None:
        qlen_cells = sum(e * e for e in ext_lens)
        full_cells = sum(e * t for e, t in zip(ext_lens, lens))
        if mask_flat.numel() < qlen_cells:
            raise ValueError(
                f"tree_mask has {mask_flat.numel()} cells, fewer than the "
                f"{qlen_cells} of a QLEN_ONLY mask for these extend lengths"
            )
        full_layout = mask_flat.numel() == full_cells and full_cells != qlen_cells
    mask_off = 0
    for b, req in enumerate(reqs):
        total, n_ext, start = lens[b], ext_lens[b], starts[b]
        if n_ext <= 0:
            continue
        prefix = total - n_ext
        # As the native kernel: the prefix comes from the paged cache, the new tokens from
        # k_extend / v_extend when given (MLA's MHA prefill passes per-head K/V whose head
        # size is not the latent cache's, and no prefix), else from the cache too.
        slots = table[req, : prefix if k_extend is not None and v_extend is not None else total]
        k = _dequant(k_buffer[slots.to(torch.int64)], k_scale)
        v = _dequant(v_buffer[slots.to(torch.int64)], v_scale)
        if k_extend is not None and v_extend is not None:
            k_new = k_extend[start : start + n_ext].to(torch.float32)
            v_new = v_extend[start : start + n_ext].to(torch.float32)
            if prefix and (k.shape[1:] != k_new.shape[1:] or v.shape[1:] != v_new.shape[1:]):
                raise ValueError(
                    f"cached K/V rows {tuple(k.shape[1:])}/{tuple(v.shape[1:])} and new ones "
                    f"{tuple(k_new.shape[1:])}/{tuple(v_new.shape[1:])} differ in shape"
                )
            k = torch.cat([k, k_new]) if prefix else k_new
            v = torch.cat([v, v_new]) if prefix else v_new
        q = q_extend[start : start + n_ext].to(torch.float32)

        q_pos = torch.arange(prefix, total).unsqueeze(1)
        k_pos = torch.arange(total).unsqueeze(0)
        if mask_flat is not None and full_layout:
            cells = mask_flat[mask_off : mask_off + n_ext * total]
            allowed = cells.reshape(n_ext, total).to(torch.bool)
            mask_off += n_ext * total
        elif mask_flat is not None:
            cells = mask_flat[mask_off : mask_off + n_ext * n_ext]
            allowed = torch.ones(n_ext, total, dtype=torch.bool)
            allowed[:, prefix:] = cells.reshape(n_ext, n_ext).to(torch.bool)
            mask_off += n_ext * n_ext
        elif is_causal:
            allowed = k_pos <= q_pos
        else:
            allowed = torch.ones(n_ext, total, dtype=torch.bool)
        if sliding_window and sliding_window > 0:
            allowed = allowed & (q_pos - k_pos < sliding_window)
        out = _attend(q, k, v, allowed, sm_scale, logit_cap, sinks)
        o_extend[start : start + n_ext] = out.to(o_extend.dtype)
