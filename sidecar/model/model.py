"""The served policy: one dense decoder (Qwen3, Qwen2, Llama) with DeepSeek-V3-style MTP heads.

Trunk (Qwen3, https://arxiv.org/abs/2505.09388): token embedding, `num_hidden_layers` pre-norm
decoder layers (RMSNorm → grouped-query attention with rotary position embedding, optionally
scaled (YaRN, llama3) → residual; RMSNorm → SwiGLU MLP → residual), a final RMSNorm and an output
head (tied to the embedding or not). The families differ in two attention fields
(`architectures.FAMILIES`): `qk_norm` (per-head RMSNorm on q and k: Qwen3) and `attention_bias`
(q/k/v biases: Qwen2); Llama has neither.

Draft (DeepSeek-V3 MTP, https://arxiv.org/abs/2412.19437 §2.2): MTP layer j at position t
combines the trunk's final-normed hidden state h_t with the embedding of the next token,
`eh_proj(cat([enorm(embed(x_{t+1})), hnorm(h_t)]))` (embedding first, as SGLang and
Megatron), runs one decoder layer with its own causal attention (rotary position t + 1),
then `shared_head.norm` and the shared output head: logits for x_{t+2}. MiMo's layout
(`MiMoMTPLayer`, `model.mtp_layers.*`) is the same function with the hidden state first.

The module tree reproduces the checkpoint naming contract (see `checkpoint.py`) exactly, so
`named_parameters()` *are* the checkpoint names. Two ways to run it:

- `forward(input_ids)`: the plain full forward without a cache — the reference the engine's
  cached, speculative path is tested against.
- `trunk_step` / `mtp_step`: cache-aware forwards over a batch of rows with per-row lengths
  (`kv_cache.KVCache`), used by `torch_engine.TorchEngine`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sidecar.model import decode_kernels
from sidecar.model.config import _DTYPES as _DTYPES  # re-exported: the config lives in `config.py`
from sidecar.model.config import ModelConfig as ModelConfig
from sidecar.model.decode_kernels import DecodeKernels, DecodeOps
from sidecar.model.decode_weights import DecodeWeights, joined_rows
from sidecar.model.kv_cache import AttentionPlan, FusedPlan, KVCache, attend
from sidecar.model.moe import Router, SparseMoE
from yarn import RotaryEmbedding, apply_rotary

ROPE_MARGIN = 72
"""Rotary table rows past max_position_embeddings: a verify writes up to k + 1 <= 64 scratch columns
past a row's end (max speculation k is 63, `torch_engine`), and a prefill pads no further."""


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, like Hugging Face's Qwen3RMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    """Grouped-query self-attention with rotary embedding; q/k/v biases (Qwen2) and per-head q/k
    RMSNorm (Qwen3) where the config has them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: Tensor,  # (B, S, hidden)
        cos: Tensor,  # (B, S, head_dim)
        sin: Tensor,  # (B, S, head_dim)
    ) -> Tensor:  # (B, S, hidden)
        """The plain causal forward over whole sequences (no cache): the reference path."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1).to(q.dtype), sin.unsqueeze(1).to(q.dtype)
        rd = cos.shape[-1]  # partial rotary (GLM-4.5): the first rd dimensions rotate, the rest pass
        q = torch.cat([apply_rotary(q[..., :rd], cos, sin), q[..., rd:]], -1)
        k = torch.cat([apply_rotary(k[..., :rd], cos, sin), k[..., rd:]], -1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))

    def cached(
        self,
        x: Tensor,  # (B, S, hidden), already input-normed
        w: DecodeWeights,
        rope: RopeTable,
        cache: KVCache,
        layer: int,
        plan: AttentionPlan,
        kernels: DecodeOps | None = None,
    ) -> Tensor:  # (B, S, hidden)
        """The same attention over new tokens appended to a KV cache, written for few operator
        calls: one q|k|v projection, the q/k norms as one norm and one table product, rotation in
        the projection's (B, S, heads, head_dim) layout (no transposed copies), one write per
        cache tensor through the plan's views. At decode sizes a step costs its operator calls.
        With fused `kernels`, a fused fixed-shape forward (`plan_fixed(masked=False)`: no mask, the
        pool and its table) runs the norms, rotation and cache writes as one kernel and the
        attention as another (`decode_kernels`)."""
        b, s, _ = x.shape
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = w.project(x, w.qkv)
        if isinstance(kernels, DecodeKernels) and isinstance(plan, FusedPlan):
            if rope.partial:
                raise ValueError(
                    "the fused q/k kernel rotates whole heads: a partial-rotary model's rounds plan masked"
                )
            q = kernels.qk_norm_rope_store(
                qkv.view(b, s, h + 2 * kv, d),
                w.qkv_bias,
                w.qk_norm,
                rope.cos_table,
                rope.sin_table,
                rope.positions,
                w.eps,
                plan.keys_in[layer],
                plan.values_in[layer],
                plan.positions,
                plan.table,
            )
            out = kernels.decode_attention(
                q, plan.keys_in[layer], plan.values_in[layer], plan.positions, plan.table, plan.kv_len
            )
            return w.project(out, w.o)
        if w.qkv_bias is not None:
            qkv = qkv + w.qkv_bias
        qkv = qkv.view(b, s, h + 2 * kv, d)
        qk = qkv[:, :, : h + kv]  # (B, S, h + kv, d)
        qk = rope.rotate(qk if w.qk_norm is None else _rms_w(qk, w.qk_norm, w.eps))
        keys, values = cache.write_and_read(layer, qk[:, :, h:], qkv[:, :, h + kv :], plan)
        return w.project(attend(qk[:, :, :h], keys, values, plan), w.o)


_rms_w = decode_kernels.rms_norm
_TORCH_OPS = DecodeOps()


def _rms(x: Tensor, norm: RMSNorm) -> Tensor:
    """`norm(x)` without the module call (same operations, same rounding)."""
    return _rms_w(x, norm.weight, norm.eps)


@dataclass(kw_only=True, slots=True)
class RopeTable:
    """cos and sign-folded sin of one forward's positions, (B, S, 1, head_dim) in the compute dtype,
    looked up in the model's tables when first read (a fused forward reads the tables and the
    positions instead: `triton_kernels.qk_norm_rope_store`).

    `rotate(x)` = x cos + rotate_half(x) sin, computed as x cos + roll(x, head_dim / 2) sin_folded
    with sin_folded = (-sin_1, sin_2): rolling by half the head swaps its halves, and a sign flip
    is exact, so these are the same products in three operator calls."""

    cos_table: Tensor
    """(positions, head_dim) cos of every position the tables hold."""
    sin_table: Tensor
    """(positions, head_dim) the sign-folded sin."""
    positions: Tensor
    """(B, S) this forward's rotary positions (clamped into the tables when looked up)."""
    rotary_dim: int = 0
    """The first dimensions of each head that rotate (partial rotary, GLM-4.5); 0: all of them."""
    _looked_up: tuple[Tensor, Tensor] | None = None

    def _lookup(self) -> tuple[Tensor, Tensor]:
        if self._looked_up is None:
            idx = self.positions.clamp(0, self.cos_table.shape[0] - 1)
            self._looked_up = (self.cos_table[idx].unsqueeze(2), self.sin_table[idx].unsqueeze(2))
        return self._looked_up

    @property
    def cos(self) -> Tensor:
        return self._lookup()[0]

    @property
    def sin_folded(self) -> Tensor:
        return self._lookup()[1]

    @property
    def partial(self) -> bool:
        return 0 < self.rotary_dim < self.cos_table.shape[-1]

    def rotate(self, x: Tensor) -> Tensor:  # (B, S, heads, head_dim)
        """Partial rotary: the halves of the first rotary_dim dimensions swap instead (the rest is
        multiplied by cos 1 and added to sin 0: unchanged, exactly)."""
        if self.partial:
            rd, half = self.rotary_dim, self.rotary_dim // 2
            swapped = torch.cat([x[..., half:rd], x[..., :half], x[..., rd:]], -1)
            return torch.addcmul(x * self.cos, swapped, self.sin_folded)
        return torch.addcmul(x * self.cos, x.roll(x.shape[-1] // 2, -1), self.sin_folded)


class MLPShape(Protocol):
    """What an MLP's shape is read from (a ModelConfig, or an EAGLE-3 draft's config)."""

    hidden_size: int
    intermediate_size: int


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: MLPShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention block and MLP block (dense SwiGLU, or experts where layer `idx` is
    sparse: `moe`), each with a residual connection."""

    def __init__(self, cfg: ModelConfig, idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP | SparseMoE = (
            SparseMoE(cfg.hidden_size, cfg.moe) if cfg.moe is not None and cfg.is_sparse(idx) else MLP(cfg)
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # (B, S, hidden)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

    def cached(
        self, x: Tensor, w: DecodeWeights, rope: RopeTable, cache: KVCache, layer: int, plan: AttentionPlan
    ) -> Tensor:
        """`forward` over new tokens appended to a KV cache (see `Attention.cached`)."""
        x, delta = self.cached_parts(x, None, w, rope, cache, layer, plan)
        return x + delta

    def cached_parts(
        self,
        x: Tensor,
        delta: Tensor | None,
        w: DecodeWeights,
        rope: RopeTable,
        cache: KVCache,
        layer: int,
        plan: AttentionPlan,
        kernels: DecodeOps | None = None,
    ) -> tuple[Tensor, Tensor]:
        """`cached` of the residual stream x + delta, returned as (stream, delta) with the MLP's
        output not yet added: the next layer adds it in the kernel of its input norm
        (`decode_kernels.add_rms_norm`), and the last in the final norm's."""
        fused = kernels if kernels is not None else _TORCH_OPS
        x, normed = fused.add_rms_norm(x, delta, w.input_norm, w.eps)
        x, normed = fused.add_rms_norm(
            x, self.self_attn.cached(normed, w, rope, cache, layer, plan, kernels), w.post_norm, w.eps
        )
        if w.gate_up is None or w.down is None:  # a sparse layer: its experts (fixed shapes where the plan is)
            return x, cast(SparseMoE, self.mlp)(normed, fixed_shape=plan.fixed_shape, kernels=fused)
        return x, w.project(fused.silu_mul(w.project(normed, w.gate_up)), w.down)


class SharedHead(nn.Module):
    """The MTP layer's final norm (the output projection itself is the trunk's, shared)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """One DeepSeek-V3 MTP module: enorm/hnorm, eh_proj, a decoder layer, shared_head.norm.

    What the forwards read of any MTP layer (`AnyMTPLayer`): `token_norm`, `hidden_norm`, `proj`,
    `hidden_first` (the order of the fused input) and `head_norm`."""

    hidden_first = False

    def __init__(self, cfg: ModelConfig, idx: int) -> None:
        super().__init__(cfg, idx)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)

    @property
    def token_norm(self) -> RMSNorm:
        return self.enorm

    @property
    def hidden_norm(self) -> RMSNorm:
        return self.hnorm

    @property
    def proj(self) -> nn.Linear:
        return self.eh_proj

    @property
    def head_norm(self) -> RMSNorm:
        return cast(RMSNorm, self.shared_head.norm)

    def combine(self, embedded: Tensor, hidden: Tensor) -> Tensor:
        """eh_proj(cat([enorm(embed(x_{t+1})), hnorm(h_t)])): the layer's input, (B, S, hidden)."""
        return fused_input(self, self.token_norm(embedded), self.hidden_norm(hidden))


class MiMoMTPLayer(DecoderLayer):
    """One MiMo MTP layer (XiaomiMiMo/MiMo `modeling_mimo.py`, `MiMoMTPLayers`): token_layernorm and
    hidden_layernorm, input_proj of cat([hidden, token]) (the hidden state FIRST), a decoder layer of the
    trunk's kind, final_layernorm; the trunk's output head. The same interface as `MTPLayer`."""

    hidden_first = True

    def __init__(self, cfg: ModelConfig, idx: int) -> None:
        super().__init__(cfg, idx)
        self.token_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def token_norm(self) -> RMSNorm:
        return self.token_layernorm

    @property
    def hidden_norm(self) -> RMSNorm:
        return self.hidden_layernorm

    @property
    def proj(self) -> nn.Linear:
        return self.input_proj

    @property
    def head_norm(self) -> RMSNorm:
        return self.final_layernorm

    def combine(self, embedded: Tensor, hidden: Tensor) -> Tensor:
        """input_proj(cat([hidden_layernorm(h_t), token_layernorm(embed(x_{t+1}))])), (B, S, hidden)."""
        return fused_input(self, self.token_norm(embedded), self.hidden_norm(hidden))


AnyMTPLayer = MTPLayer | MiMoMTPLayer


def fused_input(layer: AnyMTPLayer, embedded: Tensor, hidden: Tensor) -> Tensor:
    """The layer's projection of its normed inputs, concatenated in its layout's order."""
    parts = [hidden, embedded] if layer.hidden_first else [embedded, hidden]
    return F.linear(torch.cat(parts, dim=-1), layer.proj.weight)


def mtp_layers(cfg: ModelConfig) -> nn.ModuleList:
    """`cfg.num_nextn_predict_layers` MTP layers of `cfg.mtp_layout`'s kind."""
    kind = MiMoMTPLayer if cfg.mtp_layout == "mimo" else MTPLayer
    return nn.ModuleList(kind(cfg, cfg.num_hidden_layers + j) for j in range(cfg.num_nextn_predict_layers))


class Trunk(nn.Module):
    """Embedding, decoder layers and the final norm (checkpoint prefix `model.`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.mtp_layout == "mimo":  # MiMo keeps its MTP layers in the trunk: `model.mtp_layers.{j}.*`
            self.mtp_layers = mtp_layers(cfg)


class MTPStack(nn.Module):
    """The draft layers in specrl's layout (checkpoint prefix `mtp.`; none in MiMo's layout)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layers = mtp_layers(cfg) if cfg.mtp_layout == "specrl" else nn.ModuleList()


class Qwen3WithMTP(nn.Module):
    """The policy (trunk + output head) and its MTP draft layers, named per the checkpoint contract."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Trunk(config)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.mtp = MTPStack(config)
        # Held outside the module tree so that model.to(bfloat16) never rounds the rotary
        # frequencies; it follows the model's device lazily in `rope`.
        self._rotary: list[RotaryEmbedding] = [RotaryEmbedding(config.rope_config())]
        self._folded: tuple[Tensor, Tensor] | None = None  # (cos, sign-folded sin) tables of rope_table
        # decode_weights: (built, their source parameters, the sources' (storage, version) when built)
        self._fused: tuple[list[DecodeWeights], list[Tensor], list[tuple[int, int]]] | None = None
        self._frozen = False
        self.decode_by_columns: bool | None = None
        self.decode_builds = 0
        self.kernels: DecodeOps = _TORCH_OPS
        """What the cached forwards run: torch's operators, or fused kernels (`decode_kernels`)."""
        """Times `decode_weights` built new tensors (rather than refreshing them in place)."""
        """The cached forwards' weight layout: (in, out) copies (True), the parameters' own (out, in)
        (False), or by device (None: by columns on CPUs, `DecodeWeights`)."""

    # ---- shared pieces -------------------------------------------------------------------
    @property
    def draft_layers(self) -> nn.ModuleList:
        """The MTP layers: `mtp.layers`, or MiMo's `model.mtp_layers`."""
        return cast(nn.ModuleList, self.model.mtp_layers) if self.config.mtp_layout == "mimo" else self.mtp.layers

    def mtp_layer(self, j: int) -> AnyMTPLayer:
        """MTP layer j (typed access into `draft_layers`)."""
        return cast(AnyMTPLayer, self.draft_layers[j])

    def output_weight(self) -> Tensor:
        """The output projection (vocab, hidden): lm_head, or the embedding when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: Tensor) -> Tensor:
        """Project final-normed hidden states (..., hidden) to logits (..., vocab)."""
        return F.linear(hidden, self.output_weight())

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin (B, S, head_dim) float32 for integer positions (B, S)."""
        return self._rotary_on(positions.device)(positions)

    def _rotary_on(self, device: torch.device) -> RotaryEmbedding:
        rotary = self._rotary[0]
        if rotary.inv_freq.device != device:
            rotary = self._rotary[0] = rotary.to(device)
            self._folded = None
        return rotary

    def rope_table(self, positions: Tensor, dtype: torch.dtype) -> RopeTable:
        """The rotary factors of cached forwards by table lookup, no host read (positions are
        validated by the engine at admission; the table covers `rope_positions()`)."""
        rotary = self._rotary_on(positions.device)
        folded = self._folded
        if folded is None or folded[0].dtype != dtype:
            rotary.ensure(self.rope_positions())
            rd = self.config.rotary_dim
            sin, cos = rotary.sin_cached, rotary.cos_cached
            rest = self.config.head_dim - rd  # partial rotary: the unrotated dimensions (cos 1, sin 0)
            folded = self._folded = (
                torch.cat([cos, cos.new_ones(cos.shape[0], rest)], -1).to(dtype),
                torch.cat([-sin[:, : rd // 2], sin[:, rd // 2 :], sin.new_zeros(sin.shape[0], rest)], -1).to(dtype),
            )
        return RopeTable(
            cos_table=folded[0], sin_table=folded[1], positions=positions, rotary_dim=self.config.rotary_dim
        )

    def decode_weights(self) -> list[DecodeWeights]:
        """`DecodeWeights` of the trunk's layers, then the MTP layers'; refreshed when a source
        parameter was written (its version counter) or given new storage, and on every call for
        parameters created under inference mode (which keep no version counter). A refresh writes
        the existing copies in place where it can (`DecodeWeights.refresh`), so a captured forward
        reads the new weights."""
        if self._fused is None:
            layers = [cast(DecoderLayer, m) for m in [*self.model.layers, *self.draft_layers]]
            self._fused = ([], [t for layer in layers for t in DecodeWeights.sources(layer)], [])
        built, sources, signature = self._fused
        if self._frozen and built:
            return built
        try:  # (a push also says so itself, `weights_changed`: a reused buffer can repeat both)
            now = [(t.data_ptr(), t._version) for t in sources]
        except RuntimeError:  # an inference tensor has no version counter: rebuild every time
            now = []
        if not now or now != signature:
            layers = [cast(DecoderLayer, m) for m in [*self.model.layers, *self.draft_layers]]
            with torch.no_grad():
                if not (len(built) == len(layers) and all(w.refresh(m) for w, m in zip(built, layers, strict=True))):
                    built[:] = [DecodeWeights.of(m, self.decode_by_columns) for m in layers]
                    self.decode_builds += 1
            signature[:] = now
        return built

    def weights_changed(self) -> None:
        """The parameters were given new values outside what `decode_weights` can see (a push:
        storages swapped in, possibly at addresses it saw before, written below autograd's version
        counters): its next call refreshes the decode weights whatever their sources' signature."""
        if self._fused is not None:
            self._fused[2].clear()

    @contextlib.contextmanager
    def frozen_weights(self) -> Iterator[None]:
        """A span in which the parameters do not change (an engine step): `decode_weights` checks
        its sources once, not in every forward."""
        self.decode_weights()
        self._frozen = True
        try:
            yield
        finally:
            self._frozen = False

    def join_projections(self) -> None:
        """Store each decoder layer's q|k|v and gate|up weights as consecutive row blocks of one
        tensor (the parameters become views of it; values unchanged), so that where the cached
        forwards multiply by (out, in) weights (not CPUs: `DecodeWeights`) their fused projections
        are the parameters themselves instead of copies: ~70% of each layer's weights less memory.
        Pushes copy into the views (`TorchEngine` never swaps a storage parameters share). A sparse
        layer's experts are stacked likewise (`SparseMoE.join_experts`: what the fused kernel reads)."""
        joined_any = False
        with torch.no_grad():
            for layer in (cast(DecoderLayer, m) for m in [*self.model.layers, *self.draft_layers]):
                a, mlp = layer.self_attn, layer.mlp
                if isinstance(mlp, SparseMoE) and mlp.joined_experts() is None:
                    mlp.join_experts()
                groups = [(a.q_proj, a.k_proj, a.v_proj)] + (
                    [(mlp.gate_proj, mlp.up_proj)] if isinstance(mlp, MLP) else []
                )
                for group in groups:
                    if joined_rows([lin.weight for lin in group]) is not None:
                        continue
                    joined = torch.cat([lin.weight for lin in group])
                    start = 0
                    for lin in group:
                        rows = lin.weight.shape[0]
                        lin.weight.data = joined[start : start + rows]
                        start += rows
                    joined_any = True
        if joined_any:  # the decode weights are rebuilt over the joined storage (not when nothing moved:
            self._fused = None  # another engine's captured graphs read the copies they have)

    def rope_positions(self) -> int:
        """Positions the cached forwards' tables hold: the context plus room for the scratch
        columns a verify or draft chain writes past a row's end (up to ROPE_MARGIN)."""
        return self.config.max_position_embeddings + ROPE_MARGIN

    # ---- plain reference forward ---------------------------------------------------------
    def hidden_states(
        self, input_ids: Tensor, aux_layers: tuple[int, ...] = (), aux: list[Tensor] | None = None
    ) -> Tensor:
        """h (B, T, hidden): the trunk's output after the final norm, no cache. With `aux`, also
        appends the residual stream entering each layer of `aux_layers` (an EAGLE-3 draft's taps)."""
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        cos, sin = self.rope(positions)
        x = self.model.embed_tokens(input_ids)
        taps: dict[int, Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in aux_layers:
                taps[i] = x
            x = layer(x, cos, sin)
        if aux is not None:
            aux.extend(taps[i] for i in aux_layers)
        return self.model.norm(x)

    def forward(self, input_ids: Tensor) -> Tensor:  # (B, T) -> logits (B, T, V)
        """The plain full forward: logits for every next token, no cache (the reference)."""
        return self.logits(self.hidden_states(input_ids))

    def mtp_hidden(self, input_ids: Tensor, hidden: Tensor, layer: int = 0) -> Tensor:
        """MTP layer `layer` over a whole sequence, no cache (the draft trainer's forward).

        input_ids (B, T), hidden (B, T, hidden) = the trunk's h (detach it to train the draft
        alone). Position t (0 <= t < T-1) combines h_t with embed(x_{t+1}) at rotary position
        t + 1; returns the layer's output (B, T-1, hidden) before shared_head.norm.
        """
        b, t = input_ids.shape
        mtp = self.mtp_layer(layer)
        positions = torch.arange(1, t, device=input_ids.device).expand(b, t - 1)
        cos, sin = self.rope(positions)
        x = mtp.combine(self.model.embed_tokens(input_ids[:, 1:]), hidden[:, :-1])
        return mtp(x, cos, sin)

    def mtp_logits(self, input_ids: Tensor, hidden: Tensor, layer: int = 0) -> Tensor:
        """Draft logits (B, T-1, V): position t predicts x_{t+2}. See `mtp_hidden`."""
        out = self.mtp_hidden(input_ids, hidden, layer)
        return self.logits(self.mtp_layer(layer).head_norm(out))

    # ---- cache-aware steps (the engine) ---------------------------------------------------
    def trunk_step(
        self,
        input_ids: Tensor,  # (B, S) new tokens, right-padded per row
        cache: KVCache,  # one slot per trunk layer
        plan: AttentionPlan,  # positions of the new tokens, from cache.plan(...)
        aux_layers: tuple[int, ...] = (),  # layers whose input an EAGLE-3 draft taps
        aux: list[Tensor] | None = None,  # receives those inputs (B, S, hidden), in aux_layers' order
    ) -> Tensor:  # (B, S, hidden) final-normed hidden states
        """Run the trunk over new tokens appended to each row's cached prefix."""
        x = F.embedding(input_ids, self.model.embed_tokens.weight)
        rope = self.rope_table(plan.positions, x.dtype)
        weights = self.decode_weights()
        taps: dict[int, Tensor] = {}
        delta: Tensor | None = None  # the previous layer's MLP output, added in the next norm's kernel
        kernels = self.kernels
        for i, layer in enumerate(self.model.layers):
            if i in aux_layers:
                taps[i] = x if delta is None else x + delta
            x, delta = cast(DecoderLayer, layer).cached_parts(x, delta, weights[i], rope, cache, i, plan, kernels)
        if aux is not None:
            aux.extend(taps[i] for i in aux_layers)
        norm = self.model.norm
        return kernels.add_rms_norm(x, delta, norm.weight, norm.eps)[1]

    def mtp_step(
        self,
        layer: int,
        tokens: Tensor,  # (B, S) x_{t+1} for each MTP position t
        hidden: Tensor,  # (B, S, hidden) h_t (trunk output, or the previous MTP output when chaining)
        cache: KVCache,  # this MTP layer's own cache (a one-layer KVCache)
        plan: AttentionPlan,  # cache slots of the new positions
        rope_positions: Tensor | None = None,  # (B, S) rotary positions; default slot + 1 (= t + 1)
    ) -> Tensor:  # (B, S, hidden) MTP output before shared_head.norm
        """One MTP layer over new positions, attending to its own cached earlier positions."""
        mtp = self.mtp_layer(layer)
        embedded = self._norm(F.embedding(tokens, self.model.embed_tokens.weight), mtp.token_norm)
        x = fused_input(mtp, embedded, self._norm(hidden, mtp.hidden_norm))  # `combine`
        rope = self.rope_table(plan.positions + 1 if rope_positions is None else rope_positions, x.dtype)
        weights = self.decode_weights()[self.config.num_hidden_layers + layer]
        x, delta = mtp.cached_parts(x, None, weights, rope, cache, 0, plan, self.kernels)
        return x + delta

    def mtp_normed(self, layer: int, out: Tensor) -> Tensor:
        """An MTP output through its shared_head.norm: what the output head projects."""
        return self._norm(out, self.mtp_layer(layer).head_norm)

    def _norm(self, x: Tensor, norm: RMSNorm) -> Tensor:
        """`norm(x)` as the cached forwards run it (`kernels`: one fused kernel, or `_rms`'s operators)."""
        return self.kernels.add_rms_norm(x, None, norm.weight, norm.eps)[1]

    def mtp_head(self, layer: int, out: Tensor) -> Tensor:
        """Draft logits from an MTP output: shared lm_head(shared_head.norm(out))."""
        return self.logits(self.mtp_normed(layer, out))


def init_weights(model: Qwen3WithMTP, seed: int, std: float = 0.02) -> None:
    """Deterministic random init (normal(0, std) matrices, unit norms), for tests and tools."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def build_model(config: ModelConfig, *, device: str | torch.device = "cpu", seed: int | None = None) -> Qwen3WithMTP:
    """A model in config.dtype on `device` (random init when seed is given) in eval mode."""
    model = Qwen3WithMTP(config)
    if seed is not None:
        init_weights(model, seed, std=1.0 / math.sqrt(config.hidden_size))
    model = model.to(device=device, dtype=config.dtype)
    for m in model.modules():
        if isinstance(m, Router):
            m.float()  # routers are float32 in every dtype (`moe`, `checkpoint.ROUTER_SUFFIXES`)
    return model.eval().requires_grad_(False)
