"""TEST SUPPORT ONLY: plain-PyTorch reference implementations of sgl_kernel CPU ops.

They stand in for the ops of SGLang's CPU build of ``sgl-kernel`` (C++, AVX-512/AMX, compiled
from source: ``sgl-kernel/csrc/cpu/``) that the PyPI wheel of ``sgl-kernel`` lacks, under the
SAME names and argument lists, so SGLang 0.5.23's own Python code (``intel_amx_backend.py``,
``sgl_kernel/speculative.py``, ``kernels/ops/speculative/spec_tree.py``) calls them unchanged:

=====================================  =====================================================
``torch.ops.sgl_kernel.``               stands in for (semantics taken from)
=====================================  =====================================================
``decode_attention_cpu``               csrc/cpu/decode.cpp (+ triton decode_attention.py)
``extend_attention_cpu``               csrc/cpu/extend.cpp (+ triton extend_attention.py)
``copy_all_layer_kv_cache_cpu``        KV slot moves of every layer (kernels/ops/kvcache/
                                       cache_move.py ``copy_all_layer_kv_cache_tiled``)
``build_tree_kernel_efficient_cpu``    draft tree → verify layout (spec_tree.py
                                       ``sgl_build_tree_kernel_efficient_triton``)
``verify_tree_greedy_cpu``             greedy tree verification (spec_tree.py
                                       ``verify_tree_greedy_kernel_triton``)
``assign_req_to_token_pool_cpu``       mem_cache/allocation.py ``assign_req_to_token_pool``
``assign_extend_cache_locs_cpu``       speculative/cache_locs.py ``assign_extend_cache_locs``
``assign_draft_cache_locs_contiguous   speculative/cache_locs.py
_cpu``                                 ``assign_draft_cache_locs_contiguous``
``build_draft_decode_metadata_cpu``    the draft steps' ``req_to_token`` rows
                                       (intel_amx_backend.py, IntelAMXMultiStepDraftBackend)
``fill_bonus_tokens_cpu``              speculative eagle.py ``fill_bonus_tokens``
``fill_accept_out_cache_loc_cpu``      speculative eagle.py ``fill_accept_out_cache_loc``
=====================================  =====================================================

Registered by `register` only on a machine without a CUDA driver (see the package docstring);
a GPU run uses SGLang's own CUDA kernels and never sees these. They are written for clarity,
loop over sequences in Python and are slow — fine for the tiny models of tests/with_sglang/.
Features our tests never exercise (attention sinks, tree masks of top-k > 1 drafting,
cross-attention, fp8 KV caches) raise NotImplementedError instead of guessing.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

_LIB: torch.library.Library | None = None

_SCHEMAS = {
    "decode_attention_cpu": (
        "decode_attention_cpu(Tensor query, Tensor(a!) k_buffer, Tensor(b!) v_buffer, float key_scale, "
        "float value_scale, Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, Tensor(d!) attn_logits, "
        "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, "
        "bool is_cross_attn, int sliding_window, Tensor? encoder_lens, Tensor? sinks) -> ()"
    ),
    "extend_attention_cpu": (
        "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, "
        "Tensor k_buffer, Tensor v_buffer, float key_scale, float value_scale, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, "
        "int max_len_extend, float sm_scale, float logit_cap, bool is_cross_attn, int sliding_window, "
        "Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask, bool is_causal) -> ()"
    ),
    "copy_all_layer_kv_cache_cpu": (
        "copy_all_layer_kv_cache_cpu(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()"
    ),
    "build_tree_kernel_efficient_cpu": (
        "build_tree_kernel_efficient_cpu(Tensor parent_list, Tensor selected_index, Tensor verified_seq_len, "
        "Tensor(a!) tree_mask, Tensor(b!) positions, Tensor(c!) retrive_index, Tensor(d!) retrive_next_token, "
        "Tensor(e!) retrive_next_sibling, int topk, int depth, int draft_token_num, int tree_mask_mode) -> ()"
    ),
    "verify_tree_greedy_cpu": (
        "verify_tree_greedy_cpu(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, "
        "Tensor candidates, Tensor retrive_index, Tensor retrive_next_token, Tensor retrive_next_sibling, "
        "Tensor target_predict) -> ()"
    ),
    "assign_req_to_token_pool_cpu": (
        "assign_req_to_token_pool_cpu(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, "
        "Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()"
    ),
    "assign_extend_cache_locs_cpu": (
        "assign_extend_cache_locs_cpu(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, "
        "Tensor end_offset, Tensor(a!) out_cache_loc, int pool_len) -> ()"
    ),
    "assign_draft_cache_locs_contiguous_cpu": (
        "assign_draft_cache_locs_contiguous_cpu(Tensor req_pool_indices, Tensor req_to_token, Tensor seq_lens, "
        "Tensor(a!) out_cache_loc, int pool_len, int topk, int num_steps) -> ()"
    ),
    "build_draft_decode_metadata_cpu": (
        "build_draft_decode_metadata_cpu(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, int topk, "
        "int num_steps, int pool_len) -> Tensor"
    ),
    "fill_bonus_tokens_cpu": (
        "fill_bonus_tokens_cpu(Tensor accept_tokens, Tensor accept_lens, Tensor(a!) bonus_tokens, "
        "int accept_stride) -> ()"
    ),
    "fill_accept_out_cache_loc_cpu": (
        "fill_accept_out_cache_loc_cpu(Tensor accept_index, Tensor out_cache_loc, Tensor(a!) accept_out_cache_loc) -> ()"
    ),
}


def register() -> None:
    """Define and implement the ops under ``torch.ops.sgl_kernel`` (once per process)."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    impls = globals()
    for name, schema in _SCHEMAS.items():
        if hasattr(torch.ops.sgl_kernel, name):
            continue  # a real CPU build of sgl-kernel is loaded: never shadow it
        lib.define(schema)
        lib.impl(name, impls[name], "CPU")
    _LIB = lib


# ---- attention -----------------------------------------------------------------------------


def _attend(
    q: Tensor,  # (Lq, H, D)
    k: Tensor,  # (Lk, Hkv, D)
    v: Tensor,  # (Lk, Hkv, Dv)
    *,
    sm_scale: float,
    logit_cap: float,
    causal_offset: int | None,
) -> Tensor:  # (Lq, H, Dv)
    """Softmax attention in float32; query j sees keys 0..causal_offset+j (all when None)."""
    group = q.shape[1] // k.shape[1]  # grouped-query attention: kv head = q head // group
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * sm_scale  # (H, Lq, Lk)
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if causal_offset is not None:
        lq, lk = q.shape[0], k.shape[0]
        visible = torch.arange(lk)[None, :] <= causal_offset + torch.arange(lq)[:, None]  # (Lq, Lk)
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf)


def _unsupported(
    is_cross_attn: bool, sliding_window: int, sinks: Tensor | None, key_scale: float, v_scale: float
) -> None:
    if is_cross_attn or sinks is not None or sliding_window > 0 or key_scale != 1.0 or v_scale != 1.0:
        raise NotImplementedError(
            "reference attention covers causal self-attention without sinks, sliding windows or scaled (fp8) KV "
            "caches; this model needs SGLang's real CPU kernels (sgl-kernel built for CPU)"
        )


def decode_attention_cpu(
    query: Tensor,  # (B, H, D): one new token per sequence
    k_buffer: Tensor,  # (S, Hkv, D): the KV cache, all slots
    v_buffer: Tensor,  # (S, Hkv, Dv)
    key_scale: float,
    value_scale: float,
    output: Tensor,  # (B, H, Dv), written
    key: Tensor | None,  # (B, Hkv, D): the new tokens' keys, stored at `loc` first
    value: Tensor | None,  # (B, Hkv, Dv)
    loc: Tensor,  # (B,) cache slots of the new tokens
    attn_logits: Tensor,  # (B, H, splits, Dv + 1): the kernel's scratch, unused here
    req_to_token: Tensor,  # (R, L): cache slot of each position of each request
    req_pool_indices: Tensor,  # (B,)
    seq_lens: Tensor,  # (B,) lengths including the new token
    sm_scale: float,
    logit_cap: float,
    is_cross_attn: bool,
    sliding_window: int,
    encoder_lens: Tensor | None,
    sinks: Tensor | None,
) -> None:
    """One decode step: store the new K/V at `loc`, then each query attends to its whole sequence."""
    _unsupported(is_cross_attn, sliding_window, sinks, key_scale, value_scale)
    if key is not None and value is not None:
        k_buffer[loc.long()] = key.to(k_buffer.dtype)
        v_buffer[loc.long()] = value.to(v_buffer.dtype)
    for i in range(query.shape[0]):
        slots = req_to_token[int(req_pool_indices[i]), : int(seq_lens[i])].long()
        out = _attend(
            query[i : i + 1],
            k_buffer[slots],
            v_buffer[slots],
            sm_scale=sm_scale,
            logit_cap=logit_cap,
            causal_offset=None,
        )
        output[i] = out[0].to(output.dtype)


def extend_attention_cpu(
    q_extend: Tensor,  # (N, H, D): the new tokens of all sequences, packed
    k_extend: Tensor | None,  # (N, Hkv, D)
    v_extend: Tensor | None,  # (N, Hkv, Dv)
    o_extend: Tensor,  # (N, H, Dv), written
    k_buffer: Tensor,  # (S, Hkv, D): holds the cached prefixes
    v_buffer: Tensor,
    key_scale: float,
    value_scale: float,
    req_to_token: Tensor,
    req_pool_indices: Tensor,  # (B,)
    seq_lens: Tensor,  # (B,) prefix + new tokens
    extend_seq_lens: Tensor,  # (B,) new tokens
    extend_start_loc: Tensor,  # (B,) offset of each sequence's new tokens in the packed rows
    max_len_extend: int,
    sm_scale: float,
    logit_cap: float,
    is_cross_attn: bool,
    sliding_window: int,
    encoder_lens: Tensor | None,
    sinks: Tensor | None,
    tree_mask: Tensor | None,
    is_causal: bool,
) -> None:
    """Prefill / verify: new tokens attend to their cached prefix and causally to each other."""
    _unsupported(is_cross_attn, sliding_window, sinks, key_scale, value_scale)
    if tree_mask is not None or not is_causal:
        raise NotImplementedError("reference extend attention is causal only (top-k 1 chain drafts, no tree mask)")
    if k_extend is None or v_extend is None:
        raise NotImplementedError("reference extend attention needs the new tokens' K/V (no KV-shared layers)")
    for i in range(req_pool_indices.shape[0]):
        start, n = int(extend_start_loc[i]), int(extend_seq_lens[i])
        prefix = int(seq_lens[i]) - n
        slots = req_to_token[int(req_pool_indices[i]), :prefix].long()
        k = torch.cat([k_buffer[slots].to(k_extend.dtype), k_extend[start : start + n]])
        v = torch.cat([v_buffer[slots].to(v_extend.dtype), v_extend[start : start + n]])
        out = _attend(q_extend[start : start + n], k, v, sm_scale=sm_scale, logit_cap=logit_cap, causal_offset=prefix)
        o_extend[start : start + n] = out.to(o_extend.dtype)


# ---- KV cache ------------------------------------------------------------------------------


def copy_all_layer_kv_cache_cpu(
    data_ptrs: Tensor,  # (num_buffers,) uint64: address of each layer's K or V buffer
    strides: Tensor,  # (num_buffers,) bytes per cache slot of that buffer
    tgt_loc: Tensor,  # (n,) slots written
    src_loc: Tensor,  # (n,) slots read
) -> None:
    """Copy cache slots src → tgt in every buffer (all sources read before any write)."""
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(ptr + int(s) * stride, stride) for s in src_loc.tolist()]
        for t, row in zip(tgt_loc.tolist(), rows, strict=True):
            ctypes.memmove(ptr + int(t) * stride, row, stride)


def assign_req_to_token_pool_cpu(
    req_pool_indices: Tensor,  # (B,)
    req_to_token: Tensor,  # (R, L), written
    start_offset: Tensor,  # (B,)
    end_offset: Tensor,  # (B,)
    out_cache_loc: Tensor,  # (sum(end - start),) packed new slots
    pool_len: int,
) -> None:
    """req_to_token[r_i, start_i:end_i] = the i-th packed run of out_cache_loc."""
    offset = 0
    for i in range(req_pool_indices.shape[0]):
        a, b = int(start_offset[i]), int(end_offset[i])
        req_to_token[int(req_pool_indices[i]), a:b] = out_cache_loc[offset : offset + b - a].to(req_to_token.dtype)
        offset += b - a


def assign_extend_cache_locs_cpu(
    req_pool_indices: Tensor,
    req_to_token: Tensor,
    start_offset: Tensor,
    end_offset: Tensor,
    out_cache_loc: Tensor,  # written: the runs req_to_token[r_i, start_i:end_i], packed
    pool_len: int,
) -> None:
    """The inverse gather of `assign_req_to_token_pool_cpu`."""
    offset = 0
    for i in range(req_pool_indices.shape[0]):
        a, b = int(start_offset[i]), int(end_offset[i])
        out_cache_loc[offset : offset + b - a] = req_to_token[int(req_pool_indices[i]), a:b].to(out_cache_loc.dtype)
        offset += b - a


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: Tensor,
    req_to_token: Tensor,
    seq_lens: Tensor,
    out_cache_loc: Tensor,  # (B * topk * num_steps,), written
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """Each request's topk * num_steps slots after its sequence, in order."""
    n = topk * num_steps
    for i in range(req_pool_indices.shape[0]):
        start = int(seq_lens[i])
        row = req_to_token[int(req_pool_indices[i]), start : start + n]
        out_cache_loc[i * n : (i + 1) * n] = row.to(out_cache_loc.dtype)


def build_draft_decode_metadata_cpu(
    req_to_token: Tensor,
    req_pool_indices: Tensor,  # (B,)
    seq_lens: Tensor,  # (B,)
    topk: int,
    num_steps: int,
    pool_len: int,
) -> Tensor:  # (B * topk, pool_len)
    """``req_to_token`` rows of the draft steps' decode attention (request i, candidate t → row i·topk + t).

    With top-k 1 the draft slots already follow each sequence in its own row, so the rows are
    the requests' rows; trees (top-k > 1) lay candidates out differently and are not covered.
    """
    if topk != 1:
        raise NotImplementedError("reference build_draft_decode_metadata_cpu covers top-k 1 chain drafting only")
    return req_to_token[req_pool_indices.long()].clone()


# ---- speculative verify ----------------------------------------------------------------------


def build_tree_kernel_efficient_cpu(
    parent_list: Tensor,  # (B, (depth - 1) * topk + 1)
    selected_index: Tensor,  # (B, draft_token_num - 1)
    verified_seq_len: Tensor,  # (B,)
    tree_mask: Tensor,  # written; layout set by tree_mask_mode
    positions: Tensor,  # (B * draft_token_num,), written
    retrive_index: Tensor,  # (B, draft_token_num), written
    retrive_next_token: Tensor,  # (B, draft_token_num), written (initialised to -1 by the caller)
    retrive_next_sibling: Tensor,  # (B, draft_token_num), written (initialised to -1 by the caller)
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """The draft tree's verify layout: retrieval links, positions and the ancestor mask.

    A line-by-line transcription of the Triton kernel named in the module table (one
    program per batch row there, one loop iteration here).
    """
    if tree_mask_mode == 2:
        raise NotImplementedError("reference tree building does not cover QLEN_ONLY_BITPACKING")
    n = draft_token_num
    seq = verified_seq_len.tolist()
    prefix_sum = [sum(seq[:b]) for b in range(len(seq))]
    mask = tree_mask.view(-1)
    pos = positions.view(-1)
    sel = selected_index
    par = parent_list.view(parent_list.shape[0], -1)

    def parent_slot(b: int, i: int) -> int | None:
        """Position (1-based among drafts) of the parent of draft i-1's token, 0 for the root, None if lost."""
        parent_tb = int(sel[b, i]) // topk
        if parent_tb == 0:
            return 0
        parent_token = int(par[b, parent_tb])
        for pp in range(n - 1):
            if int(sel[b, pp]) == parent_token:
                return pp + 1
        return None

    for b in range(len(seq)):
        seq_len = seq[b]
        pos[b * n] = seq_len
        for i in range(n - 1, 0, -1):
            retrive_index[b, i] = b * n + i
            parent = parent_slot(b, i - 1)
            if parent is not None:
                first_child = int(retrive_next_token[b, parent])
                retrive_next_token[b, parent] = i
                if first_child != -1:
                    retrive_next_sibling[b, i] = first_child
        retrive_index[b, 0] = b * n
        for x in range(n):
            if tree_mask_mode == 0:  # FULL_MASK: rows of (prefix + drafts) per draft token
                idx = n * n * b + prefix_sum[b] * n + (seq_len + n) * x + seq_len + 1
            else:  # QLEN_ONLY: rows of the drafts only
                idx = n * n * b + n * x + 1
            mask[idx - 1] = True
            mask[idx : idx + n - 1] = False
            if x == 0:
                continue
            cur, depth_of_x = x - 1, 0
            for _ in range(depth):
                depth_of_x += 1
                mask[idx + cur] = True
                parent = parent_slot(b, cur)
                if not parent:  # the root (0) or not found (None)
                    break
                cur = parent - 1
            pos[b * n + x] = depth_of_x + seq_len


def verify_tree_greedy_cpu(
    predicts: Tensor,  # (B * draft_token_num,), written: the target's token at each accepted node
    accept_index: Tensor,  # (B, num_spec_tokens), written: accepted nodes (flat indices), -1 padded
    accept_token_num: Tensor,  # (B,), written: accepted drafts (bonus excluded)
    candidates: Tensor,  # (B, draft_token_num): draft tokens, node 0 = last verified token
    retrive_index: Tensor,  # (B, draft_token_num)
    retrive_next_token: Tensor,  # (B, draft_token_num): first child, -1 none
    retrive_next_sibling: Tensor,  # (B, draft_token_num): next sibling, -1 none
    target_predict: Tensor,  # (B, draft_token_num): the target's argmax after each node
) -> None:
    """Greedy verification: walk down the tree while a child equals the target's argmax."""
    flat_target = target_predict.reshape(-1)
    for b in range(candidates.shape[0]):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, accept_index.shape[1]):
            cur = int(retrive_next_token[b, cur])
            target = int(flat_target[last])
            while cur != -1 and int(candidates[b, cur]) != target:
                cur = int(retrive_next_sibling[b, cur])
            if cur == -1:
                break
            predicts[last] = target
            accepted += 1
            last = int(retrive_index[b, cur])
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        predicts[last] = flat_target[last]


def fill_bonus_tokens_cpu(
    accept_tokens: Tensor,  # (B * accept_stride,) or (B, accept_stride)
    accept_lens: Tensor,  # (B,) accepted tokens including the bonus
    bonus_tokens: Tensor,  # (B,), written
    accept_stride: int,
) -> None:
    """bonus_i = the last accepted token of request i."""
    flat = accept_tokens.reshape(-1)
    for i in range(accept_lens.shape[0]):
        bonus_tokens[i] = flat[accept_stride * i + int(accept_lens[i]) - 1]


def fill_accept_out_cache_loc_cpu(
    accept_index: Tensor,  # (B, k + 1), -1 where nothing was accepted
    out_cache_loc: Tensor,  # (B * draft_token_num,)
    accept_out_cache_loc: Tensor,  # written: cache slots of the accepted nodes, packed in order
) -> None:
    """Pack the cache slots of the accepted nodes."""
    flat = accept_index.reshape(-1)
    kept = flat[flat != -1].long()
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)
