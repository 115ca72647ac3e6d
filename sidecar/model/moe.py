"""Mixture-of-experts MLPs: the router, the routed experts and the shared ones, as the hub ships them.

A sparse layer's MLP replaces the dense SwiGLU with E SwiGLU experts of width
`moe_intermediate_size`, of which a router picks `num_experts_per_tok` per token; the layer's output
is the routing-weighted sum of the picked experts' outputs (plus, in GLM-4.5, `n_shared_experts`
experts every token passes through, as one SwiGLU of n times the width). Two router kinds, each
transformers' own (its modeling code is the oracle, `tests/sidecar/model/test_moe_models.py`):

- `softmax_topk` (Qwen3-MoE, `modeling_qwen3_moe.Qwen3MoeTopKRouter`; Qwen3 report
  https://arxiv.org/abs/2505.09388): softmax over all E logits in float32, the top k, renormalised
  to sum 1 iff `norm_topk_prob` (read from config.json: transformers' class default is false, the
  released Qwen3-MoE models say true).
- `sigmoid_grouped` (GLM-4.5 https://arxiv.org/abs/2508.06471, DeepSeek-V3's router
  https://arxiv.org/abs/2412.19437 §2.1.2): sigmoid scores s; the choice is made on s +
  `e_score_correction_bias` within the `topk_group` best of `n_group` expert groups (a group scored
  by its two best biased scores); the weights are the *unbiased* s of the chosen experts,
  renormalised iff `norm_topk_prob`, times `routed_scaling_factor`.

The router runs in float32 whatever the model's dtype (its logits too: a choice must not flip with
the rounding of bf16 logits); each expert's output is multiplied by its routing weight in the dtype
transformers' router returns it in (Qwen3-MoE: the model's; GLM-4.5: float32) and the product
rounded to the model's dtype before the sum, as transformers does (`SparseMoE.weights_in_dtype`).

Two expert paths, the same arithmetic:

- `experts_by_expert` (eager forwards, the CPU reference): the tokens gathered by expert, one
  gate, up and down product per *active* expert, each output scaled by its routing weight and
  added back in expert order (transformers' order, so float32 results match it to rounding).
- `experts_fixed_shape` (fixed-shape forwards, `AttentionPlan.fixed_shape`: what a GPU captures as CUDA
  graphs): every expert over every token, its output scaled by a routing weight that is 0 where the
  token was not routed to it: no host read, no data-dependent shape. The additions are the same
  and in the same order (an unrouted expert adds an exact 0), so only the products' blocking
  differs from the reference.

Layers: `MoEConfig.is_sparse(idx)`: Qwen3-MoE's layers are sparse unless `idx in mlp_only_layers` or
`(idx + 1) % decoder_sparse_step != 0`; GLM-4.5's unless `idx < first_k_dense_replace`. The
checkpoint names follow the module tree (`checkpoint.py`): `mlp.gate.weight` [E, hidden],
`mlp.gate.e_score_correction_bias` [E] (sigmoid_grouped), `mlp.experts.{e}.{gate,up,down}_proj.weight`,
`mlp.shared_experts.{gate,up,down}_proj.weight`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sidecar.model.decode_kernels import DecodeKernels, DecodeOps

RouterKind = Literal["softmax_topk", "sigmoid_grouped"]
ROUTER_KINDS: tuple[RouterKind, ...] = ("softmax_topk", "sigmoid_grouped")

ROUTER_OF_ARCHITECTURE: dict[str, RouterKind] = {
    "Qwen3MoeForCausalLM": "softmax_topk",
    "Glm4MoeForCausalLM": "sigmoid_grouped",
}
"""The router each MoE architecture's modeling code runs."""

HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen3MoeForCausalLM": {
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "Glm4MoeForCausalLM": {
        "n_routed_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1408,
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "partial_rotary_factor": 0.5,
    },
}
"""transformers' class defaults (`Qwen3MoeConfig`, `Glm4MoeConfig`, 5.x) of the keys read, which its
forward uses where config.json leaves a key out (`tests/sidecar/model/test_moe_routers.py` compares them)."""


@dataclass(kw_only=True, slots=True)
class MoEConfig:
    """The experts of a mixture-of-experts model; the fields are config.json's keys (see
    `from_hf_dict` for the spellings read)."""

    num_experts: int
    """Routed experts per sparse layer, E (config.json: num_experts, num_local_experts or n_routed_experts)."""
    num_experts_per_tok: int
    """Experts each token is routed to, the router's top k."""
    moe_intermediate_size: int
    """SwiGLU width of one expert (and of one shared expert)."""
    router: RouterKind = "softmax_topk"
    """Which router (the module docstring); chosen by the architecture, not a config.json key."""
    norm_topk_prob: bool = False
    """Renormalise the chosen experts' weights to sum 1."""
    n_group: int = 1
    """sigmoid_grouped: expert groups (E divisible by it)."""
    topk_group: int = 1
    """sigmoid_grouped: the groups a token's experts are chosen from."""
    routed_scaling_factor: float = 1.0
    """sigmoid_grouped: the chosen weights' factor."""
    n_shared_experts: int = 0
    """Experts every token passes through, summed with the routed ones (one SwiGLU n × as wide)."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """Layer indices that are dense (Qwen3-MoE)."""
    decoder_sparse_step: int = 1
    """Every decoder_sparse_step-th layer is sparse (Qwen3-MoE: (idx + 1) % step == 0)."""
    first_k_dense_replace: int = 0
    """The first layers that are dense (GLM-4.5, DeepSeek-V3)."""

    def __post_init__(self) -> None:
        if self.num_experts <= 0:
            raise ValueError(f"num_experts must be > 0, got {self.num_experts}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_tok}"
            )
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size must be > 0, got {self.moe_intermediate_size}")
        if self.router not in ROUTER_KINDS:
            raise ValueError(f"router must be one of {ROUTER_KINDS}, got {self.router!r}")
        if self.n_group <= 0 or self.num_experts % self.n_group:
            raise ValueError(f"n_group must divide num_experts ({self.num_experts}), got {self.n_group}")
        if not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
        if self.router == "sigmoid_grouped" and self.num_experts // self.n_group < 2:
            raise ValueError("sigmoid_grouped routing scores a group by its two best experts: needs >= 2 per group")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        if self.decoder_sparse_step <= 0:
            raise ValueError(f"decoder_sparse_step must be > 0, got {self.decoder_sparse_step}")
        if self.first_k_dense_replace < 0:
            raise ValueError(f"first_k_dense_replace must be >= 0, got {self.first_k_dense_replace}")

    def is_sparse(self, idx: int) -> bool:
        """Whether decoder layer `idx` (an MTP layer: num_hidden_layers + j) routes to experts."""
        return (
            idx >= self.first_k_dense_replace
            and idx not in self.mlp_only_layers
            and (idx + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], architecture: str) -> MoEConfig | None:
        """The experts config.json describes for `architecture` (None: no experts, a dense model). A
        key the JSON leaves out takes transformers' class default (`HF_DEFAULTS`), as its forward does."""
        router = ROUTER_OF_ARCHITECTURE.get(architecture)
        if router is None:
            return None
        defaults = HF_DEFAULTS[architecture]

        def value(key: str) -> Any:
            return d[key] if d.get(key) is not None else defaults[key]

        names = ("num_experts", "num_local_experts") if router == "softmax_topk" else ("n_routed_experts",)
        experts = next((d[n] for n in names if d.get(n) is not None), defaults[names[0]])
        if not experts:
            return None  # transformers builds dense layers only
        out: dict[str, Any] = {
            "num_experts": int(experts),
            "num_experts_per_tok": int(value("num_experts_per_tok")),
            "moe_intermediate_size": int(value("moe_intermediate_size")),
            "router": router,
            "norm_topk_prob": bool(value("norm_topk_prob")),
        }
        if router == "softmax_topk":
            out["mlp_only_layers"] = [int(i) for i in value("mlp_only_layers")]
            out["decoder_sparse_step"] = int(value("decoder_sparse_step"))
        else:
            for key in ("n_group", "topk_group", "n_shared_experts", "first_k_dense_replace"):
                out[key] = int(value(key))
            out["routed_scaling_factor"] = float(value("routed_scaling_factor"))
        return cls(**out)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json keys (transformers' spellings) of these experts."""
        d: dict[str, Any] = {
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
        }
        if self.router == "softmax_topk":
            d |= {
                "num_experts": self.num_experts,
                "mlp_only_layers": list(self.mlp_only_layers),
                "decoder_sparse_step": self.decoder_sparse_step,
            }
        else:
            d |= {
                "n_routed_experts": self.num_experts,
                "n_group": self.n_group,
                "topk_group": self.topk_group,
                "routed_scaling_factor": self.routed_scaling_factor,
                "n_shared_experts": self.n_shared_experts,
                "first_k_dense_replace": self.first_k_dense_replace,
            }
        return d


def route(
    logits: Tensor,  # (T, E) float32 router logits
    cfg: MoEConfig,
    bias: Tensor | None = None,  # (E,) float32 e_score_correction_bias (sigmoid_grouped)
) -> tuple[Tensor, Tensor]:  # weights (T, k) float32, expert ids (T, k) int64
    """The experts each token is routed to and their weights (the module docstring's two routers,
    transformers' operations in transformers' order)."""
    k = cfg.num_experts_per_tok
    if cfg.router == "softmax_topk":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, k, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    scores = logits.sigmoid()
    biased = scores if bias is None else scores + bias
    t, e, g = logits.shape[0], cfg.num_experts, cfg.n_group
    group_scores = biased.view(t, g, e // g).topk(2, dim=-1)[0].sum(dim=-1)  # (T, G)
    groups = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()  # (T, G)
    keep = keep.unsqueeze(-1).expand(t, g, e // g).reshape(t, e)
    ids = torch.topk(biased.masked_fill(~keep, float("-inf")), k=k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


class Router(nn.Module):
    """`mlp.gate`: the router's (E, hidden) weight and, for sigmoid_grouped, the expert-score bias."""

    def __init__(self, hidden_size: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, hidden_size))
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(cfg.num_experts)) if cfg.router == "sigmoid_grouped" else None
        )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:  # x (T, hidden) -> weights (T, k) f32, ids (T, k)
        logits = F.linear(x.float(), self.weight.float())
        bias = self.e_score_correction_bias
        return route(logits, self.cfg, None if bias is None else bias.float())


def swiglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """down(silu(gate(x)) * up(x)) with (out, in) weights."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


class Expert(nn.Module):
    """One expert's SwiGLU (`mlp.experts.{e}.{gate,up,down}_proj`; the shared experts' too)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return swiglu(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


def experts_by_expert(
    x: Tensor,  # (T, hidden)
    weights: Tensor,  # (T, k) routing weights, in the dtype the products are taken in (`weights_in_dtype`)
    ids: Tensor,  # (T, k) expert ids
    experts: nn.ModuleList,
) -> Tensor:  # (T, hidden)
    """The reference: tokens gathered by expert, one SwiGLU per active expert, outputs scaled by
    their routing weight and added in expert order."""
    out = torch.zeros_like(x)
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (T*k,) slots sorted by expert, token order within one
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start : start + n]
        start += n
        tokens = slots // k
        y = (experts[e](x[tokens]) * weights.reshape(-1)[slots, None]).to(x.dtype)
        out.index_add_(0, tokens, y)
    return out


def experts_fixed_shape(x: Tensor, weights: Tensor, ids: Tensor, experts: nn.ModuleList) -> Tensor:
    """The same sum at fixed shapes: every expert over every token, weighted by 0 where not routed."""
    combine = torch.zeros(x.shape[0], len(experts), dtype=weights.dtype, device=x.device).scatter_(1, ids, weights)
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        out = out + (expert(x) * combine[:, e : e + 1]).to(x.dtype)
    return out


class SparseMoE(nn.Module):
    """A sparse layer's MLP (`mlp.`): router `gate`, routed `experts`, optional `shared_experts`."""

    def __init__(self, hidden_size: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = Router(hidden_size, cfg)
        self.experts = nn.ModuleList(Expert(hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.shared_experts = (
            Expert(hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )
        self._joined: tuple[Tensor, Tensor] | None = None
        self.route_sink: list[Tensor] | None = None
        """Where each forward appends its tokens' experts, packed (`recording_routes`); None: not recording."""

    def join_experts(self) -> None:
        """Store the experts' weights as two stacked tensors, gate|up (E, 2I, hidden) and down
        (E, hidden, I), the parameters becoming views of them (values unchanged): what the fused
        kernel reads (`moe_kernels`), with no copy to refresh after a push (pushes copy into the
        views: `TorchEngine` never swaps a storage parameters share)."""
        with torch.no_grad():
            w13 = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self._experts()])
            w2 = torch.stack([e.down_proj.weight for e in self._experts()])
            inter = w2.shape[-1]
            for i, e in enumerate(self._experts()):
                e.gate_proj.weight.data = w13[i, :inter]
                e.up_proj.weight.data = w13[i, inter:]
                e.down_proj.weight.data = w2[i]
        self._joined = (w13, w2)

    def joined_experts(self) -> tuple[Tensor, Tensor] | None:
        """The stacked (gate|up, down) tensors the parameters are still views of, or None."""
        if self._joined is None:
            return None
        first = self._experts()[0]
        w13, w2 = self._joined
        if first.gate_proj.weight.data_ptr() != w13.data_ptr() or first.down_proj.weight.data_ptr() != w2.data_ptr():
            self._joined = None  # the parameters were given new storage (moved, re-cast): no longer joined
        return self._joined

    def weights_in_dtype(self, weights: Tensor, dtype: torch.dtype) -> Tensor:
        """The routing weights as transformers multiplies the experts' outputs by them: Qwen3-MoE's in
        the model's dtype (its router returns them so), GLM-4.5's in float32 (its router is float32),
        the product rounded to the model's dtype."""
        return weights.to(dtype) if self.cfg.router == "softmax_topk" else weights

    def _experts(self) -> list[Expert]:
        return [e for e in self.experts if isinstance(e, Expert)]

    def forward(
        self, x: Tensor, fixed_shape: bool = False, kernels: DecodeOps | None = None
    ) -> Tensor:  # (..., hidden) -> (..., hidden)
        """The layer's MLP output. `fixed_shape` (what CUDA graphs capture): the fused kernel where
        `kernels` has one and the experts are joined (`join_experts`), else `experts_fixed_shape`;
        otherwise the reference, `experts_by_expert`."""
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(flat)
        if self.route_sink is not None:
            self.route_sink.append(packed_routes(ids, self.cfg.num_experts))
        joined = self.joined_experts()
        if fixed_shape and isinstance(kernels, DecodeKernels) and joined is not None:
            out = kernels.fused_experts(flat, self.weights_in_dtype(weights, x.dtype), ids, *joined)
        else:
            combine = experts_fixed_shape if fixed_shape else experts_by_expert
            out = combine(flat, self.weights_in_dtype(weights, x.dtype), ids, self.experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(x.shape)


def packed_routes(ids: Tensor, num_experts: int) -> Tensor:
    """Expert ids in the smallest integer type that holds them: uint8 where experts <= 256, else int16."""
    return ids.to(torch.uint8 if num_experts <= 256 else torch.int16)


_SPARSE_LAYERS: weakref.WeakKeyDictionary[nn.Module, list[SparseMoE]] = weakref.WeakKeyDictionary()


def sparse_layers(module: nn.Module) -> list[SparseMoE]:
    """The sparse layers under `module`, in the order they run (found once: a model's tree is fixed
    once built, and walking it every round cost a tenth of a tiny MoE's step)."""
    found = _SPARSE_LAYERS.get(module)
    if found is None:
        found = _SPARSE_LAYERS[module] = [m for m in module.modules() if isinstance(m, SparseMoE)]
    return found


@contextlib.contextmanager
def recording_routes(module: nn.Module | None) -> Iterator[list[Tensor]]:
    """While open, every sparse layer under `module` (the trunk, `Qwen3WithMTP.model`: not the
    draft's) appends the experts each token of its forward is routed to, (tokens, k) packed
    (`packed_routes`), in the order the layers run. What a sample's routes are made of: the trainer's
    routing replay needs the choice of the pass that produced each token (the engine's
    rounds collect them from the verify pass). None: records nothing (the list stays empty)."""
    sparse = [] if module is None else sparse_layers(module)
    routes: list[Tensor] = []
    for m in sparse:
        m.route_sink = routes
    try:
        yield routes
    finally:
        for m in sparse:
            m.route_sink = None


def stacked_routes(routes: list[Tensor], batch: int, tokens: int) -> Tensor:
    """One forward's records (`recording_routes`) over (batch, tokens) as (sparse layers, batch,
    tokens, k), packed; a trunk without sparse layers gives (0, batch, tokens, 0)."""
    if not routes:
        return torch.empty(0, batch, tokens, 0, dtype=torch.uint8)
    return torch.stack([r.view(batch, tokens, -1) for r in routes])


def sequence_routes(trunk: nn.Module, forward: Callable[[], object], batch: int, tokens: int) -> Tensor:
    """The experts of every token of one forward over (batch, tokens) in every sparse layer of
    `trunk`: (sparse layers, batch, tokens, k), packed."""
    with recording_routes(trunk) as routes:
        forward()
    return stacked_routes(routes, batch, tokens)
