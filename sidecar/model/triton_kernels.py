"""Triton kernels of the fixed-shape decode forward: one kernel for what torch runs as several.

Each kernel computes what its reference in `decode_kernels` computes, rounding where the reference
rounds (a bf16 product is rounded to bf16 before the next operation reads it, as torch's
elementwise kernels do), so the two differ only in the order of a reduction's additions:

- `add_rms_norm`: the residual add of the previous block and the next RMSNorm (with its weight);
- `qk_norm_rope_store`: the q/k/v biases (where the model has them), the q/k RMSNorms (where it has
  them), the rotary embedding of q and k, and the writes of k and v into the KV cache at the
  forward's slots: q comes out rotated, k and v only go to the cache;
- `decode_attention`: grouped-query attention of a row's few new columns (the verified column and
  its drafts) over its cached slots, reading only the slots up to the row's last position (not the
  read width a graph is captured with) and selecting by position (a stale value past a row's end is
  never read, so it cannot reach the output even when it is not finite); at long read widths split
  among several programs a row, their partial results combined by `_combine_splits_kernel`;
- `silu_mul`: SwiGLU's silu(gate) * up over the fused gate|up projection;
- `round_uniforms`: a round's counter-based uniforms (`counter_rng`), bit for bit (integer hashing,
  exact in int64 on every backend), in one kernel instead of ~35 elementwise operators.

Imported only where Triton is installed (`decode_kernels.triton_available`). On a CPU the kernels
run in Triton's interpreter (`TRITON_INTERPRET=1` before Triton is imported; the tests' conftest
sets it where there is no GPU): that is how CI checks them against the references, in float32 (the
interpreter has no bfloat16).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr, n_cols, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=live, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * n_cols + cols, mask=live, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n_cols + cols, x, mask=live)
    xf = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * r).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=live)


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + delta, weight * rms_norm(x + delta)) over the last dimension; x itself when delta is None."""
    cols = x.shape[-1]
    x2 = x.contiguous().view(-1, cols)
    out = torch.empty_like(x2)
    total = x2 if delta is None else torch.empty_like(x2)
    d2 = x2 if delta is None else delta.contiguous().view(-1, cols)
    block = triton.next_power_of_2(cols)
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2, d2, weight, total, out, cols, eps, HAS_DELTA=delta is not None, BLOCK=block, num_warps=_warps(block)
    )
    return total.view(x.shape), out.view(x.shape)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, n_total, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # flat index into (rows, n_cols)
    live = i < n_total
    row, col = i // n_cols, i % n_cols
    g = tl.load(gu_ptr + row * 2 * n_cols + col, mask=live, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * n_cols + n_cols + col, mask=live, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + i, (act * u).to(out_ptr.dtype.element_ty), mask=live)


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of a fused (..., 2I) gate|up projection: (..., I)."""
    cols = gate_up.shape[-1] // 2
    gu = gate_up.contiguous().view(-1, 2 * cols)
    out = torch.empty(gu.shape[0], cols, dtype=gu.dtype, device=gu.device)
    block = 1024
    _silu_mul_kernel[(triton.cdiv(out.numel(), block),)](gu, out, cols, out.numel(), BLOCK=block)
    return out.view(*gate_up.shape[:-1], cols)


@triton.jit(do_not_specialize=["S"])  # a forward's width varies (1 to k + 1): one build serves them all
def _qk_norm_rope_store_kernel(
    qkv_ptr,
    bias_ptr,
    norm_ptr,
    cos_ptr,
    sin_ptr,
    rope_pos_ptr,
    n_rope,
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    table_ptr,
    t_row,
    block_size,
    eps,
    n_q,
    n_kv,
    k_block,
    k_slot,
    k_head,
    v_block,
    v_slot,
    v_head,
    S,
    D: tl.constexpr,
    HEADS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)  # b * S + s: all of one token's heads
    b = token // S
    hh = tl.arange(0, HEADS)[:, None]  # q heads, then k heads, then v heads (padded to HEADS)
    cols = tl.arange(0, D)[None, :]
    rolled = (cols + D // 2) % D
    heads = n_q + 2 * n_kv
    row = qkv_ptr + (token * heads + hh) * D
    live = hh < heads
    x = tl.load(row + cols, mask=live, other=0.0)
    xr = tl.load(row + rolled, mask=live, other=0.0)
    qk = hh < n_q + n_kv
    dt = x.dtype
    if HAS_BIAS:  # the projection's bias, rounded as torch's add rounds it
        x = (x.to(tl.float32) + tl.load(bias_ptr + hh * D + cols, mask=live, other=0.0).to(tl.float32)).to(dt)
        xr = (xr.to(tl.float32) + tl.load(bias_ptr + hh * D + rolled, mask=live, other=0.0).to(tl.float32)).to(dt)
    xf = x.to(tl.float32)
    if HAS_NORM:
        r = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]
        w = tl.load(norm_ptr + hh * D + cols, mask=qk, other=0.0).to(tl.float32)
        wr = tl.load(norm_ptr + hh * D + rolled, mask=qk, other=0.0).to(tl.float32)
        n = ((xf * r).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        nr = ((xr.to(tl.float32) * r).to(dt).to(tl.float32) * wr).to(dt).to(tl.float32)
    else:
        n = xf
        nr = xr.to(tl.float32)
    rp = tl.minimum(tl.maximum(tl.load(rope_pos_ptr + token), 0), n_rope - 1)  # the table's row
    c = tl.load(cos_ptr + rp * D + cols).to(tl.float32)
    s = tl.load(sin_ptr + rp * D + cols).to(tl.float32)
    out = ((n * c).to(dt).to(tl.float32) + nr * s).to(dt)
    slot = tl.load(pos_ptr + token)
    block = tl.load(table_ptr + b * t_row + slot // block_size)  # the row's block holding the slot
    at = slot % block_size
    tl.store(q_ptr + (token * n_q + hh) * D + cols, out, mask=hh < n_q)
    # head indices clamped at 0 where masked off: no lane's address leaves the pool (the
    # interpreter computes every lane's address, and a head's stride spans the whole pool)
    k_head_at = tl.maximum(hh - n_q, 0)
    tl.store(k_ptr + block * k_block + at * k_slot + k_head_at * k_head + cols, out, mask=(hh >= n_q) & qk)
    is_v = (hh >= n_q + n_kv) & live
    v_head_at = tl.maximum(hh - n_q - n_kv, 0)
    tl.store(v_ptr + block * v_block + at * v_slot + v_head_at * v_head + cols, x, mask=is_v)


def qk_norm_rope_store(
    qkv: Tensor,  # (B, S, heads + 2 kv_heads, head_dim): one forward's q|k|v projection, before its bias
    bias: Tensor | None,  # ((heads + 2 kv_heads) * head_dim,) the q|k|v bias, or None (no biases)
    norm: Tensor | None,  # (heads + kv_heads, head_dim): the q norm's weight per query head, then the k norm's
    cos_table: Tensor,  # (rotary positions, head_dim)
    sin_table: Tensor,  # (rotary positions, head_dim) sign-folded (`model.RopeTable`)
    rope_positions: Tensor,  # (B, S) each column's rotary position (clamped into the tables)
    eps: float,
    keys: Tensor,  # (blocks, block_size, kv_heads, head_dim) a layer's key pool (a strided view)
    values: Tensor,
    positions: Tensor,  # (B, S) the slot each column is written to
    table: Tensor,  # (B, blocks a row) each row's blocks (`kv_pages`)
) -> Tensor:  # (B, S, heads, head_dim) rotated queries
    """Add the bias (where given), normalise (where `norm` is given) and rotate q and k (their
    rotary factors looked up in the tables), write k and v
    at their slots (slot t of row b: offset t % block_size of block table[b, t // block_size]);
    return q."""
    b, s, total, d = qkv.shape
    kv = keys.shape[2]
    h = total - 2 * kv
    if keys.stride(3) != 1 or values.stride(3) != 1:
        raise ValueError("the key and value storage must be contiguous in head_dim")
    q = torch.empty(b, s, h, d, dtype=qkv.dtype, device=qkv.device)
    heads = triton.next_power_of_2(total)
    _qk_norm_rope_store_kernel[(b * s,)](
        qkv.contiguous(),
        qkv if bias is None else bias.contiguous(),
        qkv if norm is None else norm.contiguous(),
        cos_table.contiguous(),
        sin_table.contiguous(),
        rope_positions.contiguous(),
        cos_table.shape[0],
        q,
        keys,
        values,
        positions.contiguous(),
        table,
        table.stride(0),
        keys.shape[1],
        eps,
        h,
        kv,
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        s,
        D=d,
        HEADS=heads,
        HAS_BIAS=bias is not None,
        HAS_NORM=norm is not None,
        num_warps=_warps(heads * d),
    )
    return q


@triton.jit(do_not_specialize=["S", "read", "chunk"])
def _decode_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    table_ptr,
    t_row,
    block_size,
    out_ptr,
    part_ptr,
    stat_ptr,
    scale,
    read,
    chunk,
    k_block,
    k_head,
    k_slot,
    v_block,
    v_head,
    v_slot,
    S,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    n_kv = tl.num_programs(1)
    n_heads = G * n_kv
    m = tl.arange(0, BLOCK_M)  # query row m: column m // G, query head kvh * G + m % G
    col = m // G
    qhead = kvh * G + m % G
    live_m = m < G * S
    d = tl.arange(0, D)
    q_off = ((b * S + col) * n_heads + qhead)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + q_off, mask=live_m[:, None], other=0.0)
    pos = tl.load(pos_ptr + b * S + col, mask=live_m, other=-1)  # the slot each query row sits at
    last = tl.load(pos_ptr + b * S + S - 1)  # the row's last column: the furthest slot any query reads
    first = split * chunk  # this program's slots: [first, end), a `chunk` of the read width
    end = tl.minimum(tl.minimum(last + 1, read), first + chunk)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(first, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        live_n = n < end
        block = tl.load(table_ptr + b * t_row + n // block_size, mask=live_n, other=0)  # each slot's block
        k_at = block * k_block + (n % block_size) * k_slot
        v_at = block * v_block + (n % block_size) * v_slot
        kt = tl.load(k_ptr + k_at[None, :] + kvh * k_head + d[:, None], mask=live_n[None, :], other=0.0)
        if IEEE:  # noqa: SIM108 (Triton: a constexpr branch)
            qk = tl.dot(q, kt, input_precision="ieee")
        else:
            qk = tl.dot(q, kt)
        qk = tl.where((n[None, :] <= pos[:, None]) & live_n[None, :], qk * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(qk - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + v_at[:, None] + kvh * v_head + d[None, :], mask=live_n[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if SPLITS == 1:  # the whole row in this program: the output itself
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=live_m[:, None])
    else:  # this split's running max, sum and unnormalised output, for `_combine_splits_kernel`
        at = (b * n_kv + kvh) * SPLITS + split
        tl.store(stat_ptr + (at * 2) * BLOCK_M + m, m_i)
        tl.store(stat_ptr + (at * 2 + 1) * BLOCK_M + m, l_i)
        tl.store(part_ptr + (at * BLOCK_M + m[:, None]) * D + d[None, :], acc)


@triton.jit(do_not_specialize=["S"])
def _combine_splits_kernel(
    part_ptr, stat_ptr, out_ptr, S, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    n_kv = tl.num_programs(1)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    base = (b * n_kv + kvh) * SPLITS
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for i in range(SPLITS):
        top = tl.maximum(top, tl.load(stat_ptr + ((base + i) * 2) * BLOCK_M + m))
    safe = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for i in range(SPLITS):
        w = tl.exp(tl.load(stat_ptr + ((base + i) * 2) * BLOCK_M + m) - safe)  # 0 for a split that read nothing
        total += w * tl.load(stat_ptr + ((base + i) * 2 + 1) * BLOCK_M + m)
        acc += w[:, None] * tl.load(part_ptr + ((base + i) * BLOCK_M + m[:, None]) * D + d[None, :])
    col = m // G
    live_m = m < G * S
    q_off = ((b * S + col) * (G * n_kv) + kvh * G + m % G)[:, None] * D + d[None, :]
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=live_m[:, None])


SPLIT_SLOTS = 512
"""Slots of the read width per attention program (at most MAX_SPLITS programs a row and key/value
head): long contexts spread over more of the device, short ones stay one kernel."""
MAX_SPLITS = 16


def attention_splits(read: int) -> int:
    """Programs a row and key/value head's attention takes at read width `read` (a host int: the
    captured shape's)."""
    return max(1, min(MAX_SPLITS, read // SPLIT_SLOTS))


def decode_attention(
    q: Tensor,  # (B, S, heads, head_dim)
    keys: Tensor,  # (blocks, block_size, kv_heads, head_dim) a layer's key pool (a strided view)
    values: Tensor,
    positions: Tensor,  # (B, S) each column's slot; column j attends to slots <= positions[b, j]
    table: Tensor,  # (B, blocks a row) each row's blocks (`kv_pages`)
    read: int,  # slots a row may read (the captured shape's width)
    splits: int | None = None,  # programs per row and key/value head (default `attention_splits`)
) -> Tensor:  # (B, S, heads * head_dim)
    """Causal-by-position grouped-query attention over cached slots (see the module docstring).
    A row's columns are its consecutive positions, so its last column's is the furthest read. Past
    SPLIT_SLOTS slots of read width the slots are split among several programs, whose partial
    results a second kernel combines (flash-decoding): one kernel at short contexts, two at long."""
    b, s, h, d = q.shape
    kv = keys.shape[2]
    g = h // kv
    splits = attention_splits(read) if splits is None else splits
    block_m = max(16, triton.next_power_of_2(g * s))
    block_n = 64 if d <= 64 else 32
    chunk = triton.cdiv(triton.cdiv(read, splits), block_n) * block_n  # slots per split, a multiple of block_n
    out = torch.empty(b, s, h, d, dtype=q.dtype, device=q.device)
    part = out if splits == 1 else torch.empty(b * kv * splits * block_m * d, dtype=torch.float32, device=q.device)
    stat = out if splits == 1 else torch.empty(b * kv * splits * 2 * block_m, dtype=torch.float32, device=q.device)
    _decode_attention_kernel[(b, kv, splits)](
        q.contiguous(),
        keys,
        values,
        positions.contiguous(),
        table,
        table.stride(0),
        keys.shape[1],
        out,
        part,
        stat,
        1.0 / math.sqrt(d),
        read,
        chunk,
        keys.stride(0),
        keys.stride(2),
        keys.stride(1),
        values.stride(0),
        values.stride(2),
        values.stride(1),
        s,
        G=g,
        D=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SPLITS=splits,
        IEEE=q.dtype == torch.float32,
        num_warps=4,
    )
    if splits > 1:
        _combine_splits_kernel[(b, kv)](part, stat, out, s, G=g, D=d, BLOCK_M=block_m, SPLITS=splits, num_warps=4)
    return out.view(b, s, h * d)


def _warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


@triton.jit
def _mix(x, c0, c1):
    x = x ^ (x >> 16)
    x = (x * c0) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * c1) & 0xFFFFFFFF
    return x ^ (x >> 15)


@triton.jit
def _round_uniforms_kernel(keys_ptr, pos_ptr, out_ptr, rows, k, BLOCK: tl.constexpr, COLS: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)[:, None]  # rows of this program
    j = tl.arange(0, COLS)[None, :]  # the round's columns: k draft samples, k acceptance tests, the final token
    n = 2 * k + 1
    live = (r < rows) & (j < n)
    role_index = tl.where(j < k, j, tl.where(j < 2 * k, 64 + (j - k), 128))
    words = tl.load(pos_ptr + r, mask=r < rows, other=0) * 256 + role_index
    ka = tl.load(keys_ptr + r * 2, mask=r < rows, other=0)
    kb = tl.load(keys_ptr + r * 2 + 1, mask=r < rows, other=0)
    a = _mix(ka ^ words, 0x21F0AAAD, 0x735A2D97)
    b = _mix(kb ^ words, 0x7FEB352D, 0x2C1B3C6D)
    h = _mix(a ^ (((b << 16) | (b >> 16)) & 0xFFFFFFFF), 0x21F0AAAD, 0x735A2D97)
    u = (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
    tl.store(out_ptr + r * n + j, u, mask=live)


def round_uniforms(keys: Tensor, positions: Tensor, k: int) -> Tensor:
    """`counter_rng.uniforms(keys, counter_rng.round_words(positions, k))`: (B, 2k + 1) float32."""
    rows = keys.shape[0]
    out = torch.empty(rows, 2 * k + 1, dtype=torch.float32, device=keys.device)
    block = 16
    _round_uniforms_kernel[(triton.cdiv(rows, block),)](
        keys.contiguous(), positions.contiguous(), out, rows, k, BLOCK=block, COLS=triton.next_power_of_2(2 * k + 1)
    )
    return out
