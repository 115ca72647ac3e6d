"""The weights of one decoder layer as the cached (decode) forwards read them.

The fused q|k|v and gate|up projections and the q/k norm table a decode step
multiplies by (`DecodeWeights`), how they are refreshed in place after a weight push (captured CUDA
graphs read their addresses), and `joined_rows`, which finds parameters already stored as one tensor
(`Qwen3WithMTP.join_projections`) so that no copy is made of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


class _Weighted(Protocol):
    @property
    def weight(self) -> Tensor: ...


class _Linear(_Weighted, Protocol):
    @property
    def bias(self) -> Tensor | None: ...


class _Norm(_Weighted, Protocol):
    @property
    def eps(self) -> float: ...


class _Attention(Protocol):
    @property
    def q_proj(self) -> _Linear: ...
    @property
    def k_proj(self) -> _Linear: ...
    @property
    def v_proj(self) -> _Linear: ...
    @property
    def o_proj(self) -> _Weighted: ...
    @property
    def q_norm(self) -> _Norm | None: ...
    @property
    def k_norm(self) -> _Norm | None: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...


class _MLP(Protocol):
    @property
    def gate_proj(self) -> _Weighted: ...
    @property
    def up_proj(self) -> _Weighted: ...
    @property
    def down_proj(self) -> _Weighted: ...


class DecoderLayer(Protocol):
    """What a decoder layer (`model.DecoderLayer`) is to its decode weights: the parameters read
    (a protocol, so that this module, which the model imports, imports nothing of the model)."""

    @property
    def self_attn(self) -> _Attention: ...
    @property
    def mlp(self) -> _MLP: ...
    @property
    def input_layernorm(self) -> _Norm: ...
    @property
    def post_attention_layernorm(self) -> _Norm: ...


@dataclass(kw_only=True, slots=True)
class DecodeWeights:
    """One decoder layer's weights as the cached forwards use them: q|k|v and gate|up fused into
    one matrix each, the q|k|v biases into one vector (where the layer has them) and the q and k
    norms into one (heads, head_dim) table (where it has them; copies, rebuilt
    whenever a source changes: `Qwen3WithMTP.decode_weights`), the rest the parameters
    themselves (read without module attribute lookups).

    On CPU the four projections are stored by columns, (in, out) contiguous, and applied as
    `x @ w`: the layer's weights do not fit the caches, so a decode step streams them from
    memory, and MKL reads this layout about 20% faster at decode batch sizes (measured on the CPU
    box: the 24 layers' projections of the demo policy 2.4 vs 3.0 ms at B = 1, 3.8 vs 5.0 ms at
    B = 16). Elsewhere (out, in) and `F.linear`, which shares o and down with the parameters."""

    input_norm: Tensor
    qkv: Tensor
    qkv_bias: Tensor | None
    """(heads + 2 kv_heads) * head_dim: q's bias, k's, v's (None: no biases)."""
    qk_norm: Tensor | None
    """(heads + kv_heads, head_dim): the q norm's weight per query head, the k norm's (None: no norms)."""
    o: Tensor
    post_norm: Tensor
    gate_up: Tensor
    down: Tensor
    eps: float
    by_columns: bool

    def tensors(self) -> tuple[Tensor, ...]:
        """Every tensor the cached forward reads from here."""
        optional = tuple(t for t in (self.qkv_bias, self.qk_norm) if t is not None)
        return (self.input_norm, self.qkv, *optional, self.o, self.post_norm, self.gate_up, self.down)

    def project(self, x: Tensor, w: Tensor) -> Tensor:
        """x (..., in) times one of the projections: (..., out)."""
        return torch.matmul(x, w) if self.by_columns else F.linear(x, w)

    @staticmethod
    def sources(layer: DecoderLayer) -> tuple[Tensor, ...]:
        """The parameters the copies are made of: q, k, v, gate, up, o, down, then the q/k/v biases
        and the q/k norms where the layer has them."""
        a, m = layer.self_attn, layer.mlp
        return (
            a.q_proj.weight,
            a.k_proj.weight,
            a.v_proj.weight,
            m.gate_proj.weight,
            m.up_proj.weight,
            a.o_proj.weight,
            m.down_proj.weight,
            *_biases(layer),
            *_norms(layer),
        )

    @classmethod
    def of(cls, layer: DecoderLayer, by_columns: bool | None = None) -> DecodeWeights:
        """`by_columns`: the CPU layout (default: on CPU devices)."""
        a = layer.self_attn
        q, k, v, gate, up, o, down = cls.sources(layer)[:7]
        biases, norms = _biases(layer), _norms(layer)
        by_columns = q.device.type == "cpu" if by_columns is None else by_columns

        def fused(parts: list[Tensor]) -> Tensor:
            if by_columns:
                return torch.cat(parts).t().contiguous()
            joined = joined_rows(parts)  # parameters stored as one tensor (`join_projections`): no copy
            return joined if joined is not None else torch.cat(parts)

        return cls(
            input_norm=layer.input_layernorm.weight,
            qkv=fused([q, k, v]),
            qkv_bias=torch.cat(biases) if biases else None,
            qk_norm=torch.cat([norms[0].expand(a.num_heads, -1), norms[1].expand(a.num_kv_heads, -1)])
            if norms
            else None,
            o=o.t().contiguous() if by_columns else o,
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=fused([gate, up]),
            down=down.t().contiguous() if by_columns else down,
            eps=layer.input_layernorm.eps,
            by_columns=by_columns,
        )

    def refresh(self, layer: DecoderLayer) -> bool:
        """Rewrite the copies in place from `layer`'s parameters (a captured CUDA graph reads these
        storages: new tensors would leave it reading the old weights). False when that cannot be
        done (a field would change identity, shape or kind): rebuild with `of` instead."""
        new = DecodeWeights.of(layer, by_columns=True) if self.by_columns else None
        a = layer.self_attn
        q, k, v, gate, up, o, down = DecodeWeights.sources(layer)[:7]
        biases, norms = _biases(layer), _norms(layer)
        if (self.qkv_bias is None) != (not biases) or (self.qk_norm is None) != (not norms):
            return False
        own: dict[str, Tensor] = {  # fields that are the parameters themselves (GPU layout) must still be them
            "input_norm": layer.input_layernorm.weight,
            "post_norm": layer.post_attention_layernorm.weight,
        }
        if not self.by_columns:
            own |= {"o": o, "down": down}
        if any(getattr(self, f) is not t for f, t in own.items()):
            return False
        # copies built inside an engine step are inference tensors: writable in place only in inference mode
        writable = torch.is_inference_mode_enabled()
        with torch.no_grad():
            fused = {"qkv": [q, k, v], "gate_up": [gate, up]}
            if norms:
                fused["qk_norm"] = [norms[0].expand(a.num_heads, -1), norms[1].expand(a.num_kv_heads, -1)]
            for name, parts in fused.items():
                dst = getattr(self, name)
                joined = joined_rows(parts) if new is None and name != "qk_norm" else None
                if joined is not None:  # the parameters themselves: nothing to copy, unless dst is a copy
                    if joined.data_ptr() != dst.data_ptr() or joined.shape != dst.shape:
                        return False
                    continue
                if (dst.is_inference() and not writable) or any(t.is_inference() for t in parts):
                    return False
                if new is not None and name != "qk_norm":
                    src = getattr(new, name)
                    if src.shape != dst.shape:
                        return False
                    dst.copy_(src)
                else:
                    if dst.shape != (sum(t.shape[0] for t in parts), parts[0].shape[1]):
                        return False
                    torch.cat(parts, out=dst)
            if self.qkv_bias is not None:
                if (self.qkv_bias.is_inference() and not writable) or any(t.is_inference() for t in biases):
                    return False
                if self.qkv_bias.shape[0] != sum(t.shape[0] for t in biases):
                    return False
                torch.cat(biases, out=self.qkv_bias)
            if new is not None:
                for name in ("o", "down"):
                    dst, src = getattr(self, name), getattr(new, name)
                    if (dst.is_inference() and not writable) or src.shape != dst.shape:
                        return False
                    dst.copy_(src)
        self.eps = layer.input_layernorm.eps
        return True


def _biases(layer: DecoderLayer) -> list[Tensor]:
    """The q, k and v projections' biases, or [] where the layer has none."""
    a = layer.self_attn
    found = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
    return [t for t in found if t is not None] if all(t is not None for t in found) else []


def _norms(layer: DecoderLayer) -> list[Tensor]:
    """The q and k norms' weights, or [] where the layer has none."""
    a = layer.self_attn
    return [] if a.q_norm is None or a.k_norm is None else [a.q_norm.weight, a.k_norm.weight]


def joined_rows(parts: list[Tensor]) -> Tensor | None:
    """The one (rows, cols) tensor whose consecutive row blocks `parts` are (views into one storage,
    in order, contiguous), or None."""
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in parts:
        same = t.untyped_storage().data_ptr() == storage and t.dtype == first.dtype
        if not (same and t.is_contiguous() and t.dim() == 2 and t.shape[1] == first.shape[1]):
            return None
        if t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in parts)
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1), first.storage_offset())
