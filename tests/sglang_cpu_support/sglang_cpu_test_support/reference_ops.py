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
=====================================  =====================================================

Registered by `register` only on a machine without a CUDA driver (see the package docstring);
a GPU run uses SGLang's own CUDA kernels and never sees these. They are written for clarity,
loop over sequences in Python and are slow — fine for the tiny models of tests/with_sglang/.
Features our tests never exercise (attention sinks, tree masks of top-k > 1 drafting,
cross-attention, fp8 KV caches) raise NotImplementedError instead of guessing.
"""

from __future__ import annotations

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
}


def register() -> None:
    """Define and implement the ops under ``torch.ops.sgl_kernel`` (once per process)."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    impls = {"decode_attention_cpu": decode_attention_cpu, "extend_attention_cpu": extend_attention_cpu}
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


def _unsupported(is_cross_attn: bool, sliding_window: int, sinks: Tensor | None, key_scale: float, v_scale: float) -> None:
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
        out = _attend(query[i : i + 1], k_buffer[slots], v_buffer[slots], sm_scale=sm_scale, logit_cap=logit_cap, causal_offset=None)
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
