"""Speculative-decoding (EAGLE) helper ops (test stand-in; see the package docstring).

Index conventions follow SGLang's reference kernels:

* ``retrive_index[b, i] = b * draft_token_num + i`` (a global row into the
  verify batch), ``retrive_next_token[b, i]`` is the first child of node i and
  ``retrive_next_sibling[b, i]`` the next sibling, ``-1`` meaning none.
* ``selected_index[b, i - 1] // topk`` names the parent of draft node i in
  ``parent_list[b]``; 0 means the root (the bonus token, node 0).
"""

from __future__ import annotations

import torch

FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2


def _ints(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.reshape(-1).tolist()]


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
) -> None:
    """bonus_tokens[i] = last accepted token of request i.

    ``accept_lens`` counts the bonus token, so it sits at column
    ``accept_lens[i] - 1`` of row i (row width ``accept_stride``).
    """
    flat = accept_tokens.reshape(-1)
    out = bonus_tokens.view(-1)
    for i, n in enumerate(_ints(accept_lens)):
        out[i] = flat[int(accept_stride) * i + n - 1]


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,
) -> None:
    """Compact the KV slots of accepted tokens, in order.

    Every entry ``src != -1`` of the flattened ``accept_index`` writes
    ``out_cache_loc[src]`` to position ``#(valid entries before it)``.
    """
    idx = accept_index.reshape(-1).to(torch.int64)
    valid = idx != -1
    n = int(valid.sum().item())
    if n:
        dst = accept_out_cache_loc.view(-1)
        dst[:n] = out_cache_loc.reshape(-1)[idx[valid]].to(dst.dtype)


def rotate_input_ids_cpu(
    input_ids: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    topk_index: torch.Tensor,
    select_index: torch.Tensor | None = None,
) -> None:
    """Shift each request's extend segment left by one and put its new token
    last (or at ``select_index[i]`` when given)."""
    ids = input_ids.view(-1)
    new_tokens = topk_index.reshape(-1)
    selects = _ints(select_index) if select_index is not None else None
    for i, (start, n) in enumerate(zip(_ints(extend_start_loc), _ints(extend_seq_lens))):
        if n <= 0:
            continue
        if n > 1:
            ids[start : start + n - 1] = ids[start + 1 : start + n].clone()
        last = selects[i] if selects is not None else start + n - 1
        ids[last] = new_tokens[i].to(ids.dtype)


def _parent_position(sel: list[int], parents: list[int], node: int, topk: int, n_sel: int):
    """Tree position (0 = root) of draft node ``node``'s parent, or None if
    the parent is not among the selected tokens (an invalid tree)."""
    parent_tb = sel[node - 1] // topk
    if parent_tb == 0:
        return 0
    parent_token = parents[parent_tb]
    for p in range(n_sel):
        if sel[p] == parent_token:
            return p + 1
    return None


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """Build the EAGLE draft tree: attention mask, positions and retrieval links.

    Mask layouts (mask bytes; the caller pre-fills prefix columns):

    * FULL_MASK: request b owns ``D * (seq_len_b + D)`` cells after the blocks
      of earlier requests; row t has the prefix columns then one column per
      draft node.
    * QLEN_ONLY: ``D * D`` cells per request, draft columns only.
    * QLEN_ONLY_BITPACKING: one little-endian bit-field of 1/2/4 bytes per row,
      bit j set when the row's token sees draft node j.

    ``retrive_next_token`` / ``retrive_next_sibling`` must arrive filled with -1.
    """
    topk, D, mode = int(topk), int(draft_token_num), int(tree_mask_mode)
    bs = verified_seq_len.numel()
    if bs == 0:
        return
    lens = _ints(verified_seq_len)
    n_sel = D - 1
    sel_rows = selected_index.reshape(bs, -1).tolist()
    par_rows = parent_list.reshape(bs, -1).tolist() if parent_list.numel() else [[]] * bs
    mask_bytes = tree_mask.view(-1)
    if mask_bytes.dtype != torch.uint8:  # bool or a packed uint16/uint32 buffer
        mask_bytes = mask_bytes.view(torch.uint8)
    pos = positions.view(-1)
    r_index = retrive_index.view(bs, D)
    r_next = retrive_next_token.view(bs, D)
    r_sib = retrive_next_sibling.view(bs, D)
    bytes_per_row = 4 if D > 16 else (2 if D > 8 else 1)

    seq_tree_base = 0  # sum of earlier seq_lens * D (FULL_MASK only)
    for b in range(bs):
        sel = [int(x) for x in sel_rows[b]]
        parents = [int(x) for x in par_rows[b]]
        seq_len = lens[b]

        # Retrieval links: children are pushed to the front of their parent's
        # child list while walking nodes from last to first.
        next_tok = [int(x) for x in r_next[b].tolist()]
        next_sib = [int(x) for x in r_sib[b].tolist()]
        for i in range(D - 1, 0, -1):
            r_index[b, i] = b * D + i
            pp = _parent_position(sel, parents, i, topk, n_sel)
            if pp is None:
                continue  # invalid tree: node ignored, as the reference does
            if next_tok[pp] != -1:
                next_sib[i] = next_tok[pp]
            next_tok[pp] = i
        r_index[b, 0] = b * D
        r_next[b] = torch.tensor(next_tok, dtype=r_next.dtype)
        r_sib[b] = torch.tensor(next_sib, dtype=r_sib.dtype)

        # Mask rows and positions.
        for t in range(D):
            ancestors = []  # draft-node columns (excluding the root) row t sees
            depth_t = 0
            if t > 0:
                cur = t - 1
                for _ in range(max(int(depth), D)):
                    depth_t += 1
                    ancestors.append(cur + 1)
                    parent_tb = sel[cur] // topk
                    if parent_tb == 0:
                        break
                    token = parents[parent_tb]
                    found = next((p for p in range(n_sel) if sel[p] == token), None)
                    if found is None:
                        break
                    cur = found
            pos[b * D + t] = seq_len + depth_t

            if mode == QLEN_ONLY_BITPACKING:
                bits = 1  # root
                for col in ancestors:
                    bits |= 1 << col
                start = (b * D + t) * bytes_per_row
                for k in range(bytes_per_row):
                    mask_bytes[start + k] = (bits >> (8 * k)) & 0xFF
                continue
            if mode == FULL_MASK:
                row = seq_tree_base + D * D * b + (seq_len + D) * t + seq_len
            elif mode == QLEN_ONLY:
                row = D * D * b + D * t
            else:
                raise ValueError(f"unknown tree_mask_mode {mode}")
            cells = [0] * D
            cells[0] = 1
            for col in ancestors:
                cells[col] = 1
            mask_bytes[row : row + D] = torch.tensor(cells, dtype=torch.uint8)
        seq_tree_base += seq_len * D


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy tree verification.

    Walk from the root: at each level take the first child whose draft token
    equals the target's greedy token at the last accepted node. Writes the
    accepted nodes' global rows into ``accept_index[b, 1:]`` (row 0 is the
    root), the count of accepted draft tokens into ``accept_token_num[b]``, and
    the target token into ``predicts`` at every accepted row plus the bonus
    position (the last accepted row).
    """
    bs, D = candidates.shape[0], candidates.shape[1]
    num_spec = accept_index.shape[1]
    cand = candidates.reshape(bs, D).tolist()
    r_index = retrive_index.reshape(bs, D).tolist()
    r_next = retrive_next_token.reshape(bs, D).tolist()
    r_sib = retrive_next_sibling.reshape(bs, D).tolist()
    target = [int(x) for x in target_predict.reshape(-1).tolist()]
    pred = predicts.view(-1)
    acc = accept_index.view(bs, num_spec)
    for b in range(bs):
        last = int(r_index[b][0])
        acc[b, 0] = last
        n_acc = 0
        cur = 0
        for _ in range(1, num_spec):
            cur = int(r_next[b][cur])
            matched = False
            while cur != -1:
                if int(cand[b][cur]) == target[last]:
                    pred[last] = target[last]
                    n_acc += 1
                    last = int(r_index[b][cur])
                    acc[b, n_acc] = last
                    matched = True
                    break
                cur = int(r_sib[b][cur])
            if not matched:
                break
        accept_token_num.view(-1)[b] = n_acc
        pred[last] = target[last]
