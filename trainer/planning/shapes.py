"""A model's shape as the roofline needs it: bytes read and FLOPs of a forward, KV bytes per token.

Why: a decode step of a large model is a read of its weights and KV cache; a verify of k + 1
tokens reads the same bytes and does k + 1 times the arithmetic. So the shape (dense or
mixture-of-experts, grouped-query KV) decides where speculation turns from free to dear. Read
from a Hugging Face config.json (Qwen3 / Qwen3-MoE keys; Llama-style keys work alike), a bundled
preset, or a parameter count (a generic dense shape with Qwen3's proportions: stated as such).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sidecar.speculation.expert_union import ExpertReads

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
    ),
    "qwen3-235b-a22b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_experts=128,
        num_experts_per_tok=8,
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}
"""The Hugging Face config.json values of the models the project plans for (Qwen/Qwen3-*)."""
PRESET_ALIASES = {
    "0.6b": "qwen3-0.6b",
    "8b": "qwen3-8b",
    "30b": "qwen3-30b-a3b",
    "qwen3-30b": "qwen3-30b-a3b",
    "235b": "qwen3-235b-a22b",
    "qwen3-235b": "qwen3-235b-a22b",
}


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelShape:
    """The sizes that decide a forward's bytes and FLOPs (bf16 weights and KV by default)."""

    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    """Dense MLP width (also the draft layer's MLP width for a mixture-of-experts target)."""
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    dense_layers: int = 0
    """Layers of a mixture of experts with a dense MLP instead (mlp_only_layers, first_k_dense_replace)."""
    shared_intermediate: int = 0
    """Width of a sparse layer's shared experts, which every token passes through (GLM-4.5)."""
    weight_bytes_per_param: float = 2.0
    kv_bytes_per_value: float = 2.0

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{self.name}: {name} must be > 0, got {getattr(self, name)}")
        if self.experts and not 0 < self.experts_per_token <= self.experts:
            raise ValueError(
                f"{self.name}: experts_per_token must lie in 1..{self.experts}, got {self.experts_per_token}"
            )
        if self.experts and self.expert_intermediate <= 0:
            raise ValueError(f"{self.name}: a mixture of experts needs moe_intermediate_size > 0")

    @property
    def attention_params(self) -> int:
        """Per layer: Q, K, V and output projections."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate

    @property
    def sparse_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    @property
    def shared_params(self) -> int:
        """Per sparse layer: the router and the shared experts, which every forward reads."""
        return self.hidden * self.experts + 3 * self.hidden * self.shared_intermediate

    @property
    def mlp_params(self) -> int:
        """Per layer: the dense MLP, or all experts, the router and the shared experts."""
        if self.experts:
            return self.experts * self.expert_params + self.shared_params
        return 3 * self.hidden * self.intermediate

    @property
    def total_params(self) -> int:
        """Everything, the embedding and an untied output head each counted once."""
        dense = 3 * self.hidden * self.intermediate
        mlps = self.sparse_layers * self.mlp_params + (self.layers - self.sparse_layers) * dense
        return self.layers * self.attention_params + mlps + 2 * self.vocab * self.hidden

    @property
    def active_params(self) -> int:
        """Parameters a token's forward multiplies with (no embedding gather; the output head included)."""
        dense = 3 * self.hidden * self.intermediate
        sparse = self.experts_per_token * self.expert_params + self.shared_params
        mlps = self.sparse_layers * sparse + (self.layers - self.sparse_layers) * dense
        return self.layers * self.attention_params + mlps + self.vocab * self.hidden

    def expert_reads(self) -> ExpertReads:
        """The bytes a forward reads split as `sidecar.speculation.expert_union` prices them (the
        automatic-k controller's prior uses the same)."""
        dense = 3 * self.hidden * self.intermediate
        fixed = (
            self.layers * self.attention_params
            + self.sparse_layers * self.shared_params
            + (self.layers - self.sparse_layers) * dense
            + self.vocab * self.hidden
        )
        return ExpertReads(
            experts=self.experts,
            top_k=self.experts_per_token,
            sparse_layers=self.sparse_layers,
            expert_bytes=self.expert_params * self.weight_bytes_per_param,
            fixed_bytes=fixed * self.weight_bytes_per_param,
        )

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_value

    def weight_bytes(self, tokens: np.ndarray) -> np.ndarray:
        """Weight bytes one forward over `tokens` tokens reads: attention and the output head
        always; a dense MLP always; of a mixture of experts, the experts its tokens route to
        (uniform routing: E (1 - (1 - top/E)^tokens) per layer)."""
        tokens = np.asarray(tokens, dtype=float)
        if self.experts:
            reads = self.expert_reads()
            return np.vectorize(reads.step_bytes, otypes=[float])(tokens)
        fixed = self.layers * (self.attention_params + self.mlp_params) + self.vocab * self.hidden
        return np.full_like(tokens, fixed * self.weight_bytes_per_param)

    def attention_flops(self, width: np.ndarray | float, kv_tokens: np.ndarray) -> np.ndarray:
        """FLOPs of scores and values for `width` new tokens per row over `kv_tokens` context
        tokens summed over the rows."""
        return 4.0 * self.layers * self.heads * self.head_dim * np.asarray(width) * np.asarray(kv_tokens)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], name: str = "model") -> ModelShape:
        """From a Hugging Face config.json dict; a missing key says which."""
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            experts = int(d.get("num_experts") or d.get("num_local_experts") or d.get("n_routed_experts") or 0)
            layers = int(d["num_hidden_layers"])
            step = int(d.get("decoder_sparse_step") or 1)
            first_dense = int(d.get("first_k_dense_replace") or 0)
            only = {int(i) for i in d.get("mlp_only_layers") or []}
            dense_layers = sum(i < first_dense or i in only or (i + 1) % step != 0 for i in range(layers))
            return cls(
                name=name,
                vocab=int(d["vocab_size"]),
                hidden=hidden,
                layers=layers,
                heads=heads,
                kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                intermediate=int(d["intermediate_size"]),
                experts=experts,
                experts_per_token=int(d.get("num_experts_per_tok") or 0) if experts else 0,
                expert_intermediate=int(d.get("moe_intermediate_size") or 0) if experts else 0,
                dense_layers=dense_layers if experts else 0,
                shared_intermediate=int(d.get("moe_intermediate_size") or 0) * int(d.get("n_shared_experts") or 0)
                if experts
                else 0,
            )
        except KeyError as e:
            raise ValueError(f"{name}: config.json lacks {e.args[0]!r}, which the roofline needs") from None

    @classmethod
    def dense_of_size(cls, params: float) -> ModelShape:
        """A generic dense decoder of about `params` parameters with Qwen3-8B's proportions
        (depth ~ params^(1/3), MLP 3x hidden, 8 KV heads of 128, vocab 151936)."""
        if params < 1e8:
            raise ValueError(f"a model size is given in parameters (e.g. 8b, 70b), got {params:g}")
        layers = max(8, round(36 * (params / 8.2e9) ** (1 / 3)))
        body = max(params - 2 * 151936 * 4096, params * 0.5)
        hidden = max(512, round(math.sqrt(body / (11.5 * layers)) / 128) * 128)
        return cls(
            name=f"dense {params / 1e9:g}B (generic shape)",
            vocab=151936,
            hidden=hidden,
            layers=layers,
            heads=hidden // 128,
            kv_heads=8,
            head_dim=128,
            intermediate=3 * hidden,
        )


def load_shape(spec: str) -> ModelShape:
    """A preset name (qwen3-8b, 8b, ...), a config.json (or a directory holding one), or a size
    ("70b", "1.5e10"); an unknown name says what is accepted."""
    key = spec.strip().lower()
    key = PRESET_ALIASES.get(key, key)
    if key in PRESETS:
        return ModelShape.from_hf(PRESETS[key], name=key)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            return ModelShape.from_hf(json.loads(path.read_text()), name=path.parent.name or str(path))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); pass a Hugging Face config.json") from None
    if m := re.fullmatch(r"(\d+(?:\.\d+)?)\s*b", key):
        return ModelShape.dense_of_size(float(m.group(1)) * 1e9)
    try:
        return ModelShape.dense_of_size(float(key))
    except ValueError:
        pass
    raise ValueError(
        f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}), a config.json or a directory "
        "holding one, nor a size such as 70b"
    )
