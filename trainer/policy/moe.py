"""Mixture-of-experts policies in Megatron-core: the router's RL settings and routing replay.

The experts a config.json describes (`sidecar.model.moe.MoEConfig`, the engine's reading of it) in
Megatron's vocabulary (`megatron_kwargs`):

- Qwen3-MoE's softmax top-k: ``moe_router_score_function="softmax"``; ``norm_topk_prob`` true is a
  softmax over the k chosen logits (``moe_router_pre_softmax=False``: equal to renormalising the
  chosen probabilities), false the chosen entries of the softmax over all E
  (``moe_router_pre_softmax=True``).
- GLM-4.5's sigmoid router: ``moe_router_score_function="sigmoid"``, the expert-score bias
  (``moe_router_enable_expert_bias``: Megatron's ``router.expert_bias`` buffer is config.json's
  ``e_score_correction_bias``), ``n_group``/``topk_group`` as ``moe_router_num_groups`` /
  ``moe_router_group_topk``, ``routed_scaling_factor`` as ``moe_router_topk_scaling_factor``, the
  ``n_shared_experts`` as one shared MLP ``n × moe_intermediate_size`` wide. Megatron scores a group
  by its best ``k // topk_group`` experts where transformers takes the best two, and always
  renormalises sigmoid weights: configs where that differs are refused (`check`).
- which layers are sparse: ``moe_layer_freq`` as a 0/1 list from ``MoEConfig.is_sparse``.

RL settings (`RouterConfig`, the run config's ``train.router``): RL post-training keeps the routing
the sampler used rather than rebalancing it, so the load-balancing loss is 0, the expert-score bias
is never updated, the router computes in float32, and the router may be frozen (the peers' choices:
slime, verl, NeMo RL and SkyRL switch load balancing off; NeMo RL freezes the router).

Routing replay (Rollout Routing Replay, arXiv:2510.11370; Megatron's
``transformer/moe/router_replay.py``): the experts the sampler chose for each token (`Routes`, one
row per sequence position, every sparse layer in order) are the trainer's choice in its forward,
while the routing *weights* are recomputed from the live router logits (so the router still learns).
Megatron's `RouterReplay` replays every token or none; `PositionReplay` replays the tokens that carry
a route and routes the others live (the last generated token, which is never an input to the
sampler, and padding), counting how often the live router agrees with the given choice
(``train/routing_agreement``). Megatron flattens a layer's tokens sequence-major, (S, B) -> S·B, and
the replayed ids follow that order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from sidecar.model.moe import MoEConfig

RoutingReplay = Literal["off", "rollout"]
ROUTING_REPLAY_MODES: tuple[RoutingReplay, ...] = ("off", "rollout")


@dataclass(kw_only=True, slots=True)
class RouterConfig:
    """How an MoE policy's routers train (ignored for a dense policy)."""

    aux_loss_coeff: float = 0.0
    """Weight of Megatron's load-balancing loss (its ``aux_loss``). 0 for RL: the loss pushes the
    router away from the routing that sampled the rollouts, and the trainer's log-probs away from the
    sampler's (NeMo RL: "seq_aux_loss causes logprob error divergence for grpo"). Raise it only to
    rebalance a router on purpose."""
    expert_bias_update_rate: float = 0.0
    """Step of the expert-score bias update (``e_score_correction_bias``, sigmoid routers). 0 for RL:
    the bias is part of the served model, and a bias that moves by load changes the experts of
    tokens the policy gradient never saw. The trainer applies no update at any rate yet: a rate
    above 0 is refused (`check`)."""
    dtype: Literal["float32", "float64"] = "float32"
    """What the router's logits, scores and top-k are computed in, whatever the model's dtype: a
    choice must not flip with the rounding of bf16 logits, and the sidecar's router is float32."""
    frozen: bool = False
    """Keep the router's weights (and expert-score bias) fixed: no optimizer sees them, so the
    routing stays the checkpoint's (NeMo RL's choice for GRPO on MoE)."""

    def __post_init__(self) -> None:
        if not self.aux_loss_coeff >= 0.0:
            raise ValueError(
                f"router.aux_loss_coeff must be >= 0 (0: no load-balancing loss), got {self.aux_loss_coeff}"
            )
        if self.expert_bias_update_rate != 0.0:
            raise ValueError(
                f"router.expert_bias_update_rate={self.expert_bias_update_rate}: the trainer does not update the "
                "expert-score bias (RL keeps it as served); set it to 0"
            )
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"router.dtype must be 'float32' or 'float64', got {self.dtype!r}")


def check(moe: MoEConfig, *, tensor_parallel: int, expert_parallel: int) -> None:
    """Raise ValueError naming the key where Megatron cannot build (or shard) `moe` as the engine runs it."""
    if moe.num_experts % expert_parallel:
        raise ValueError(
            f"num_experts={moe.num_experts} is not divisible by expert_parallel={expert_parallel}; choose an "
            "expert-parallel size that divides the experts"
        )
    for key, value in (
        ("moe_intermediate_size", moe.moe_intermediate_size),
        ("n_shared_experts x moe_intermediate_size", moe.n_shared_experts * moe.moe_intermediate_size),
    ):
        if value % tensor_parallel:
            raise ValueError(
                f"{key}={value} is not divisible by tensor_parallel={tensor_parallel}; choose one that divides it"
            )
    if moe.router == "sigmoid_grouped":
        if moe.n_group > 1 and moe.num_experts_per_tok // moe.topk_group != 2:
            raise ValueError(
                f"n_group={moe.n_group}, topk_group={moe.topk_group}, num_experts_per_tok={moe.num_experts_per_tok}: "
                "transformers scores a group by its best two experts, Megatron-core by its best "
                "num_experts_per_tok // topk_group; the trainer cannot route this model as it is served"
            )
        if not moe.norm_topk_prob and moe.num_experts_per_tok > 1:
            raise ValueError(
                "norm_topk_prob=false with a sigmoid router: Megatron-core always renormalises sigmoid weights; "
                "the trainer cannot route this model as it is served"
            )


def megatron_kwargs(
    moe: MoEConfig, num_layers: int, router: RouterConfig, *, tensor_parallel: int, expert_parallel: int
) -> dict[str, Any]:
    """The ``TransformerConfig`` keys of `moe` (module docstring)."""
    check(moe, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel)
    sigmoid = moe.router == "sigmoid_grouped"
    out: dict[str, Any] = {
        "num_moe_experts": moe.num_experts,
        "moe_router_topk": moe.num_experts_per_tok,
        "moe_ffn_hidden_size": moe.moe_intermediate_size,
        "moe_layer_freq": [1 if moe.is_sparse(i) else 0 for i in range(num_layers)],
        "moe_router_score_function": "sigmoid" if sigmoid else "softmax",
        "moe_router_pre_softmax": not sigmoid and not moe.norm_topk_prob,
        "moe_router_dtype": "fp64" if router.dtype == "float64" else "fp32",
        "moe_router_load_balancing_type": "aux_loss" if router.aux_loss_coeff > 0 else "none",
        "moe_aux_loss_coeff": router.aux_loss_coeff,
        "moe_token_dispatcher_type": "allgather",  # the dispatcher that runs on gloo (docs/moe.md)
        "moe_grouped_gemm": False,  # SequentialMLP: grouped GEMM needs CUDA kernels
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "moe_enable_routing_replay": True,  # routers get a replay slot; `PositionReplay` drives it
        "expert_model_parallel_size": expert_parallel,
    }
    if sigmoid:
        out |= {
            "moe_router_enable_expert_bias": True,
            "moe_router_bias_update_rate": router.expert_bias_update_rate,
            "moe_router_topk_scaling_factor": moe.routed_scaling_factor,
        }
        if moe.n_group > 1:
            out |= {"moe_router_num_groups": moe.n_group, "moe_router_group_topk": moe.topk_group}
        if moe.n_shared_experts:
            out["moe_shared_expert_intermediate_size"] = moe.n_shared_experts * moe.moe_intermediate_size
    return out


def routers(model: nn.Module) -> list[Any]:
    """The Megatron ``TopKRouter`` of every sparse layer of `model`'s decoder, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def is_router_name(name: str) -> bool:
    """Whether a Megatron parameter/buffer name is a router's (weight or expert-score bias)."""
    return ".mlp.router." in name


class PositionReplay:
    """One router's replay slot: the given experts where a token has them, live routing elsewhere.

    Installed as the router's ``router_replay`` (Megatron calls ``get_replay_topk`` in place of its
    top-k); `set` gives the next forward's ids, (S·B, k) int64 in Megatron's token order, -1 rows
    routed live. The weights are the live scores at the chosen ids in every case (Megatron's own
    REPLAY_FORWARD rule), so they carry the router's gradient."""

    def __init__(self) -> None:
        self.target: Tensor | None = None
        self.live: Tensor | None = None  # (S·B, k) the live router's choice in the last forward
        self.chosen: Tensor | None = None  # (S·B, k) the experts the last forward used
        self.agreed = 0
        self.compared = 0

    def set(self, target: Tensor | None) -> None:
        self.target = target

    def get_replay_topk(
        self, scores: Tensor, topk: int, num_groups: int | None, group_topk: int | None, default_compute_topk: Any
    ) -> tuple[Tensor, Tensor]:
        probs, ids = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.live = self.chosen = ids.detach()
        if self.target is None:
            return probs, ids
        target = self.target.to(ids.device)
        if target.shape != ids.shape:
            raise ValueError(
                f"replayed routes {tuple(target.shape)} do not match the forward's tokens {tuple(ids.shape)}"
            )
        given = target[:, 0] >= 0
        with torch.no_grad():
            same = (ids[given].sort(dim=-1).values == target[given].sort(dim=-1).values).all(dim=-1)
            self.agreed += int(same.sum())
            self.compared += int(given.sum())
        chosen = torch.where(given[:, None], target, ids)
        self.chosen = chosen.detach()
        return scores.gather(1, chosen), chosen


def install_replay(model: nn.Module) -> list[PositionReplay]:
    """Give every router of `model` its own `PositionReplay` (taken out of Megatron's global replay
    registry, which spans every model of the process) and return the slots in layer order; idempotent."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    slots = []
    for router in routers(model):
        if not isinstance(router.router_replay, PositionReplay):
            if router.router_replay in RouterReplay.global_router_replay_instances:
                RouterReplay.global_router_replay_instances.remove(router.router_replay)
            router.router_replay = PositionReplay()
        slots.append(router.router_replay)
    return slots


@contextlib.contextmanager
def replaying(slots: Sequence[PositionReplay], routes: Tensor | None) -> Iterator[None]:
    """Replay `routes` (B, S, sparse layers, k) int64, -1 where a position routes live, in the
    forwards inside; None: live routing (the slots still record the live choice)."""
    if routes is not None and routes.shape[2] != len(slots):
        raise ValueError(f"routes name {routes.shape[2]} sparse layers but the policy has {len(slots)}")
    for i, slot in enumerate(slots):
        slot.set(None if routes is None else routes[:, :, i].transpose(0, 1).reshape(-1, routes.shape[-1]))
    try:
        yield
    finally:
        for slot in slots:
            slot.set(None)


def last_routes(slots: Sequence[PositionReplay], batch: int, *, live: bool = False) -> Tensor:
    """The experts the last forward used (`live`: those its own router chose): (B, S, sparse layers, k) int64."""
    per_layer = []
    for slot in slots:
        ids = slot.live if live else slot.chosen
        assert ids is not None, "no forward has run"
        per_layer.append(ids.view(-1, batch, ids.shape[-1]).transpose(0, 1))
    return torch.stack(per_layer, dim=2)


def take_agreement(slots: Sequence[PositionReplay]) -> tuple[int, int]:
    """(agreeing, compared) token × layer choices since the last call, and reset the counts."""
    agreed, compared = sum(s.agreed for s in slots), sum(s.compared for s in slots)
    for s in slots:
        s.agreed = s.compared = 0
    return agreed, compared


def routes_asked(replay: RoutingReplay) -> str:
    """What a rollout request asks each sample's routes to be (`GenerationRequest.routes`): the whole
    sequence's when routing replay is on (the trainer's forward routes every input position), none
    when off."""
    return "sequence" if replay == "rollout" else "off"


def batch_routes(samples: Sequence[Any], lengths: Sequence[int], seq: int) -> Tensor:
    """The training batch's routes (`TrainBatch.routes`: (B, seq, sparse layers, k) int64, -1 where
    the trainer routes live) from each sample's ``routes`` (`sidecar.types.Routes`: ``expert_ids``
    (positions, sparse layers, k), row i the experts of position ``first_position + i`` as an input;
    a whole sequence of P prompt and T generated tokens carries P + T - 1 rows, first_position 0).
    `lengths`: each sample's P + T, its row's tokens in the batch."""
    packed: list[Tensor] = []
    for i, (sample, length) in enumerate(zip(samples, lengths, strict=True)):
        routes = getattr(sample, "routes", None)
        if routes is None:
            raise ValueError(
                f"sample {i} carries no routes but algorithm.routing_replay is 'rollout': the sidecar must return "
                "them (a sidecar that serves an MoE model and returns routes), or set algorithm.routing_replay=off"
            )
        ids, first = routes.expert_ids, int(routes.first_position)
        if ids.ndim != 3 or first < 0 or first + ids.shape[0] > length:
            raise ValueError(
                f"sample {i}: routes of shape {tuple(ids.shape)} from position {first} do not fit its {length} tokens "
                "(expected (positions, sparse layers, k) within the sequence)"
            )
        row = torch.full((seq, ids.shape[1], ids.shape[2]), -1, dtype=torch.long)
        row[first : first + ids.shape[0]] = ids.to(torch.long)
        packed.append(row)
    shapes = {tuple(p.shape[1:]) for p in packed}
    if len(shapes) > 1:
        raise ValueError(f"samples carry routes of different (sparse layers, k): {sorted(shapes)}")
    return torch.stack(packed)
