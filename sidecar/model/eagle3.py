"""The EAGLE-3 draft: one decoder layer over the target's fused low/middle/high hidden states.

EAGLE-3 (Li et al. 2025, https://arxiv.org/abs/2503.01840) drafts for targets that carry no draft
layers of their own (Qwen3, Llama): a separate small model reads three of the target's hidden
states instead of only the last one. This module is that draft as SGLang's
`LlamaForCausalLMEagle3` and vLLM's `Eagle3LlamaForCausalLM` run it, so that one checkpoint
(`eagle3_checkpoint.py`) serves the embedded engine and SGLang's / vLLM's EAGLE3 algorithm:

- **aux states**: the residual stream *entering* target layers `aux_layers` (default 2, L/2, L-3
  of an L-layer target, both loaders' default; `aux_layer_ids` in the config overrides), each
  (hidden,), concatenated low → high into (3 hidden,);
- **fc** (hidden, 3 hidden): fuses them, g_t = fc(aux_t);
- **midlayer**: one Llama decoder layer whose attention reads cat([input_layernorm(embed(x_{t+1})),
  hidden_norm(g_t)]) (2 hidden → q/k/v, embedding first), with the residual stream starting at
  g_t itself: out = g + attn; out = out + mlp(post_attention_layernorm(out)). No q/k norm (Llama).
- **norm** and **lm_head** (draft_vocab, hidden): draft logits over the draft vocabulary; `d2t`
  maps draft id i to target id i + d2t[i] (`t2d`: which target ids the draft vocabulary holds).
  A target id outside the draft vocabulary gets logit -inf, probability exactly 0: that zero is
  part of the proposal q the engine's rejection sampling uses, so a reduced vocabulary keeps the
  output distribution exact (it can only lower acceptance).
- **chain**: draft step d >= 1 feeds the previous step's pre-norm output back in as g together
  with the token just drafted (fc is applied to target states only), as both loaders do.

The token embedding is the target's (shared, never stored in the draft), as SGLang's EAGLE3
worker and vLLM do when the draft checkpoint holds none.

Positions: entry t (inputs g_t and x_{t+1}, predicting x_{t+2}) attends to the draft's own
entries 0..t. SGLang rotates it at position t; the embedded engine rotates the draft at t + 1,
like its MTP layers. Rotary attention depends only on position differences, so the two give
the same q (up to rounding).

Two ways to run it, with no engine state in the first: `forward(aux, input_ids, embed)` over
whole sequences (teacher forcing, the trainer's forward) and `step` / `target_logits` over new
positions appended to a `KVCache` (the engine's `drafters.Eagle3Drafter`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sidecar.model.kv_cache import AttentionPlan, KVCache, attend
from sidecar.model.model import _DTYPES, MLP, ROPE_MARGIN, ModelConfig, Qwen3WithMTP, RMSNorm, _rms
from yarn import RopeConfig, RotaryEmbedding, apply_rotary

ARCHITECTURE = "LlamaForCausalLMEagle3"
PUSH_PREFIX = "eagle3."
"""Weight pushes name a served EAGLE-3 draft's parameters `eagle3.<checkpoint name>` (part of the
DRAFT selector); the token maps are fixed at draft-init and never pushed."""


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """SGLang's and vLLM's default taps for an L-layer target: the inputs of layers 2, L/2, L-3."""
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(kw_only=True, slots=True)
class Eagle3Config:
    """Shape of an EAGLE-3 draft; the fields are config.json keys of the SGLang/vLLM layout."""

    vocab_size: int
    """The target's vocabulary (the draft's outputs are mapped into it)."""
    draft_vocab_size: int
    """Rows of lm_head; < vocab_size for a reduced draft vocabulary (then d2t/t2d matter)."""
    hidden_size: int
    """Must equal the target's hidden size (the embedding is shared, fc reads 3 target states)."""
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    torch_dtype: str = "float32"
    aux_layer_ids: list[int] | None = None
    """Target layers whose *input* residual stream is tapped, 3 ascending ids in [1, L); None = `default_aux_layers` of the target. config.json: `eagle_aux_hidden_state_layer_ids`
    (vLLM's convention, the same numbers) and `eagle_config.eagle_aux_hidden_state_layer_ids`
    (SGLang's: the ids of layer outputs, one less)."""
    architectures: list[str] = field(default_factory=lambda: [ARCHITECTURE])

    def __post_init__(self) -> None:
        for name in ("vocab_size", "draft_vocab_size", "hidden_size", "intermediate_size", "num_attention_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size ({self.draft_vocab_size}) must be <= vocab_size ({self.vocab_size}): "
                "the draft vocabulary is a subset of the target's"
            )
        if self.num_key_value_heads <= 0 or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads must divide num_attention_heads ({self.num_attention_heads}), "
                f"got {self.num_key_value_heads}"
            )
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even number (rotary pairs), got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(f"rms_norm_eps and rope_theta must be > 0, got {self.rms_norm_eps}, {self.rope_theta}")
        if self.max_position_embeddings < 2:
            raise ValueError(f"max_position_embeddings must be >= 2, got {self.max_position_embeddings}")
        if self.torch_dtype not in _DTYPES:
            raise ValueError(f"torch_dtype must be one of {sorted(_DTYPES)}, got {self.torch_dtype!r}")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != 3:
            raise ValueError(f"aux_layer_ids must name 3 target layers (low, middle, high), got {self.aux_layer_ids}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ValueError(f"rope_scaling must be null or a dict, got {self.rope_scaling!r}")
        self.rope_config()  # ValueError for rotary scaling other than plain RoPE, YaRN and llama3 (`yarn.RopeConfig`)

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.torch_dtype]

    def aux_layers(self, num_target_layers: int) -> tuple[int, int, int]:
        """The three tapped target layers for a target of `num_target_layers` layers, checked."""
        ids = tuple(self.aux_layer_ids) if self.aux_layer_ids is not None else default_aux_layers(num_target_layers)
        if not 0 < ids[0] < ids[1] < ids[2] < num_target_layers:
            # SGLang and vLLM capture a layer's input once, in layer order: taps must be distinct,
            # ascending, and past layer 0 (SGLang's capture adds the residual, which layer 0 lacks).
            where = "aux_layer_ids" if self.aux_layer_ids is not None else "the default taps (2, L/2, L-3)"
            raise ValueError(
                f"{where} {list(ids)} must be 3 ascending layers in [1, {num_target_layers}) for a "
                f"{num_target_layers}-layer target (the default needs L >= 7); "
                "set eagle_aux_hidden_state_layer_ids in the draft's config.json"
            )
        return ids[0], ids[1], ids[2]

    def check_target(self, target: ModelConfig) -> None:
        """Raise ValueError unless this draft can serve `target` (vocabulary, hidden size, taps)."""
        if self.vocab_size != target.vocab_size:
            raise ValueError(f"the draft's vocab_size {self.vocab_size} differs from the target's {target.vocab_size}")
        if self.hidden_size != target.hidden_size:
            raise ValueError(
                f"the draft's hidden_size {self.hidden_size} differs from the target's {target.hidden_size}: "
                "an EAGLE-3 draft shares the target's embedding and fuses its hidden states"
            )
        self.aux_layers(target.num_hidden_layers)

    def rope_config(self) -> RopeConfig:
        return RopeConfig.from_hf(self.to_hf_dict())

    @classmethod
    def for_target(cls, target: ModelConfig, **overrides: Any) -> Eagle3Config:
        """A draft shaped like one layer of `target` (heads, head_dim, MLP, rotary), full vocabulary."""
        base: dict[str, Any] = dict(
            vocab_size=target.vocab_size,
            draft_vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
            torch_dtype=target.torch_dtype,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> Eagle3Config:
        """Read an EAGLE-3 config.json (LlamaForCausalLMEagle3 keys; unknown keys ignored)."""
        heads = d["num_attention_heads"]
        ids = d.get("eagle_aux_hidden_state_layer_ids")
        nested = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids is None and nested is not None:  # SGLang's nested key: ids of layer *outputs* (it adds 1)
            ids = [int(i) + 1 for i in nested]
        return cls(
            vocab_size=int(d["vocab_size"]),
            draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_attention_heads=int(heads),
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta") or 10_000.0),
            rope_scaling=d.get("rope_scaling"),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            torch_dtype=d.get("torch_dtype") or d.get("dtype") or "float32",
            aux_layer_ids=None if ids is None else [int(i) for i in ids],
            architectures=list(d.get("architectures") or [ARCHITECTURE]),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json: Llama keys with one hidden layer, plus draft_vocab_size (and the taps when set)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "aux_layer_ids"}
        d.update(
            model_type="llama",
            num_hidden_layers=1,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
        )
        if self.aux_layer_ids is not None:  # vLLM reads layer inputs at the top level, SGLang layer outputs nested
            d["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.aux_layer_ids]}
        return d


class Eagle3Attention(nn.Module):
    """Llama grouped-query attention whose q/k/v read 2 hidden (embedding | fused state)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        h = cfg.hidden_size
        self.q_proj = nn.Linear(2 * h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def _qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # each (B, S, heads, d)
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # (B, S, 1, d)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x (B, S, 2h) -> (B, S, h)
        """Causal attention over whole sequences, no cache (the reference and training path)."""
        b, s, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self._qkv(x, cos, sin))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def cached(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, plan: AttentionPlan) -> Tensor:
        """The same attention over new positions appended to a one-layer KV cache."""
        q, k, v = self._qkv(x, cos, sin)
        keys, values = cache.write_and_read(0, k, v, plan)
        return self.o_proj(attend(q, keys, values, plan))


class Eagle3Layer(nn.Module):
    """The midlayer: input_layernorm (embedding), hidden_norm (fused state), attention, MLP."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)  # the target's SwiGLU (the same parameter names)

    def attention_input(self, embedded: Tensor, hidden: Tensor) -> Tensor:  # (B, S, 2h)
        return torch.cat([_rms(embedded, self.input_layernorm), _rms(hidden, self.hidden_norm)], dim=-1)

    def finish(self, hidden: Tensor, attended: Tensor) -> Tensor:
        """Residual stream from the fused state: g + attn, then + mlp(norm(.)). (B, S, h) pre-norm."""
        x = hidden + attended
        return x + self.mlp(_rms(x, self.post_attention_layernorm))


class Eagle3Draft(nn.Module):
    """The EAGLE-3 draft, named per the SGLang/vLLM checkpoint layout (`named_parameters()` and
    the `d2t` / `t2d` buffers *are* the checkpoint names)."""

    d2t: Tensor
    t2d: Tensor

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.set_draft_vocab(torch.arange(config.draft_vocab_size))
        self._rotary: list[RotaryEmbedding] = [RotaryEmbedding(config.rope_config())]  # outside the tree: fp32

    # ---- vocabulary ------------------------------------------------------------------------
    def set_draft_vocab(self, target_ids: Tensor) -> None:
        """Make draft id i stand for target id target_ids[i] (distinct, ascending, in the target vocab)."""
        ids = target_ids.to(torch.int64).cpu()
        n, v = self.config.draft_vocab_size, self.config.vocab_size
        if ids.shape != (n,) or (ids.numel() and (ids[0] < 0 or ids[-1] >= v)) or bool((ids.diff() <= 0).any()):
            raise ValueError(f"the draft vocabulary must be {n} distinct ascending target ids in [0, {v})")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(n))
            self.t2d.zero_()
            self.t2d[ids.to(self.t2d.device)] = True

    def draft_to_target(self) -> Tensor:  # (draft_vocab,) int64
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def check_vocab(self) -> None:
        """Raise ValueError unless d2t and t2d describe the same set of distinct target ids."""
        ids = self.draft_to_target()
        v = self.config.vocab_size
        if bool(((ids < 0) | (ids >= v)).any()):
            raise ValueError(f"d2t maps draft ids outside the target vocabulary [0, {v})")
        if ids.unique().numel() != ids.numel():
            raise ValueError("d2t maps two draft ids to the same target id")
        if not torch.equal(self.t2d.nonzero()[:, 0].sort().values, ids.sort().values):
            raise ValueError("t2d does not mark exactly the target ids that d2t maps to")

    # ---- pieces -----------------------------------------------------------------------------
    def fuse(self, aux: Tensor) -> Tensor:  # (..., 3h) target taps -> (..., h)
        return F.linear(aux, self.fc.weight)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin (B, S, head_dim) float32 by table lookup (no host read; see `rope_positions`)."""
        rotary = self._rotary[0]
        if rotary.inv_freq.device != positions.device:
            rotary = self._rotary[0] = rotary.to(positions.device)
        rotary.ensure(self.rope_positions())
        return rotary.lookup(positions)

    def rope_positions(self) -> int:
        return self.config.max_position_embeddings + ROPE_MARGIN

    def draft_logits(self, out: Tensor) -> Tensor:
        """Logits over the draft vocabulary (..., draft_vocab) from pre-norm outputs (..., h)."""
        return F.linear(_rms(out, self.norm), self.lm_head.weight)

    def target_logits(self, out: Tensor) -> Tensor:
        """Logits over the target vocabulary (..., vocab) in float32: -inf outside the draft vocabulary."""
        logits = self.draft_logits(out).float()
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy(-1, self.draft_to_target(), logits)

    # ---- whole sequences (training) ---------------------------------------------------------
    def forward(
        self,
        aux: Tensor,  # (B, T, 3h) target taps at positions 0..T-1 (detach to train the draft alone)
        input_ids: Tensor,  # (B, T)
        embed: Tensor,  # (vocab, h) the target's token embedding
    ) -> Tensor:  # (B, T-1, draft_vocab) position t predicts x_{t+2}
        """Teacher-forced draft logits over whole sequences: entry t reads fc(aux_t) and x_{t+1}
        (`chain`'s step 0, through the draft's own head)."""
        outs = self.chain(input_ids, aux, lambda ids: F.embedding(ids, embed))
        if not outs:  # one position: nothing to predict
            return aux.new_zeros(input_ids.shape[0], 0, self.config.draft_vocab_size)
        return self.draft_logits(outs[0])

    def chain(
        self,
        input_ids: Tensor,  # (B, T)
        aux: Tensor,  # (B, T, 3h) target taps (detached by the caller)
        embed: Callable[[Tensor], Tensor],  # ids -> the target's embeddings (B, L, h)
        depth: int | None = None,  # steps (None: 1); the MTP draft's argument order, for the trainer
    ) -> list[Tensor]:  # step j: (B, T-1-j, h) pre-norm outputs
        """Teacher-forced chain over whole sequences (EAGLE-3's training-time test, in the form
        the engine drafts): step 0 at entry t reads fc(aux_t) and x_{t+1}; step j >= 1 reads
        step j-1's output at t and x_{t+j+1}; step j's entry t predicts x_{t+j+2} (`draft_logits`)
        at rotary position t + j + 1. Each step attends over its own step's entries."""
        b, t = input_ids.shape
        depth = 1 if depth is None else depth
        layer = self.midlayer
        outs: list[Tensor] = []
        h = self.fuse(aux)
        for j in range(depth):
            length = t - 1 - j
            if length <= 0:
                break
            positions = torch.arange(j + 1, j + 1 + length, device=input_ids.device).expand(b, length)
            cos, sin = self.rope(positions)
            state = h[:, :length]
            x = layer.attention_input(embed(input_ids[:, j + 1 : j + 1 + length]), state)
            h = layer.finish(state, layer.self_attn(x, cos.to(x.dtype), sin.to(x.dtype)))
            outs.append(h)
        return outs

    # ---- cached steps (the engine) -----------------------------------------------------------
    def step(
        self,
        tokens: Tensor,  # (B, S) x_{t+1} of each new position t
        hidden: Tensor,  # (B, S, h) fused target states g_t, or the previous step's output when chaining
        embed: Tensor,  # (vocab, h) the target's token embedding
        cache: KVCache,  # the draft's own one-layer cache
        plan: AttentionPlan,  # its slots for the new positions
        rope_positions: Tensor,  # (B, S) rotary positions
    ) -> Tensor:  # (B, S, h) pre-norm outputs
        """The midlayer over new positions, attending to its own cached earlier positions."""
        layer = self.midlayer
        cos, sin = self.rope(rope_positions)
        dtype = hidden.dtype
        x = layer.attention_input(F.embedding(tokens, embed), hidden)
        return layer.finish(hidden, layer.self_attn.cached(x, cos.to(dtype), sin.to(dtype), cache, plan))


def target_taps(
    model: Qwen3WithMTP,
    input_ids: Tensor,  # (B, T)
    layers: Sequence[int],
) -> Tensor:  # (B, T, len(layers) * hidden)
    """The plain (uncached) forward's residual stream entering each of `layers`, concatenated:
    the `aux` a trainer feeds `Eagle3Draft.forward` (an independent path from the engine's)."""
    taps: list[Tensor] = []
    model.hidden_states(input_ids, aux_layers=tuple(layers), aux=taps)
    return torch.cat(taps, dim=-1)


def build_eagle3(config: Eagle3Config, *, device: str | torch.device = "cpu", seed: int | None = None) -> Eagle3Draft:
    """A draft in config.dtype on `device` (random normal(0, 1/sqrt(h)) matrices when seed is given), eval mode."""
    draft = Eagle3Draft(config)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        std = config.hidden_size**-0.5
        with torch.no_grad():
            for name, p in draft.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
    return draft.to(device=device, dtype=config.dtype).eval().requires_grad_(False)
