"""The checkpoint bridge: Hugging Face names (the naming contract) <-> megatron-core's layout.

One `plan` of entries serves both directions, so import and export cannot drift apart. Each
entry maps one Megatron parameter to one or more contract tensors:

- ``linear_qkv`` fuses q/k/v *per query group*: for each of the ``num_key_value_heads`` groups,
  ``heads_per_group * head_dim`` query rows, then ``head_dim`` key rows, then ``head_dim`` value rows
  (the order megatron/core/transformer/attention.py splits the projection output in).
  Its bias (``add_qkv_bias``: Qwen2) is fused the same way, q/k/v biases per group.
- ``linear_fc1`` stacks gate over up (SwiGLU: ``silu(gate) * up``).
- ``q_layernorm`` / ``k_layernorm`` exist where the family has q/k norms (Qwen3, GLM-4.5's
  use_qk_norm), as ``q_norm`` / ``k_norm`` do in the contract (`trainer.policy.gpt.model_config`).
- a sparse layer (mixture of experts): ``mlp.router.weight`` is ``mlp.gate.weight``, the router's
  ``expert_bias`` *buffer* is ``mlp.gate.e_score_correction_bias`` (sigmoid routers), each
  ``mlp.experts.local_experts.{l}.linear_fc1`` (SequentialMLP) stacks expert e's gate over up and
  ``linear_fc2`` is its down, ``mlp.shared_experts.linear_fc1/fc2`` the shared experts' likewise.
- everything else is a rename (norms, o/down projections, embedding, output layer).

The layer norm before attention/MLP is its own module in the local (CPU) spec
(``input_layernorm`` / ``pre_mlp_layernorm``) and fused into the next linear in the
TransformerEngine spec (``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``);
the plan uses whichever names the built model actually has.

Tensor parallelism: a Megatron parameter carries ``tensor_model_parallel``, ``partition_dim`` and
``partition_stride``; sharding and gathering are derived from those attributes only (stride 2 is
the gated fc1, whose rank r stores ``[gate_r; up_r]``). Export is a generator that gathers one
parameter at a time over the tensor-parallel group, so peak extra memory is one full tensor.
Every rank of the group must drive the generator in lockstep (the gathers are collective).
A routed expert is sharded over the expert-tensor-parallel group. Expert parallelism: local slot
l of expert-parallel rank r is expert ``r * E / EP + l`` (`ExpertLayout`); import takes each rank's
experts from the full checkpoint, export gathers slot l of every rank at once (one layer's slot
across the EP group: peak extra memory EP tensors) and names them by their global ids.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from sidecar.errors import WeightMismatchError
from sidecar.model.config import ModelConfig
from trainer.policy.gpt import family, model_config

MTP_PREFIX = "mtp."  # draft tensors are "mtp.layers.{j}.<sub-name>" (DeepSeek-V3 names)
MIMO_PREFIX = "model.mtp_"  # MiMo's: "model.mtp_layers.{j}.<sub-name>"


def draft_prefix(hf_config: Mapping[str, Any]) -> str:
    """What the draft head's parameter names (``layers.{j}.*``) are prefixed with in the contract."""
    return MIMO_PREFIX if family(hf_config).mtp_layout == "mimo" else MTP_PREFIX


def is_draft_name(name: str, hf_config: Mapping[str, Any]) -> bool:
    """Whether a contract name is one of the MTP layers' (not the trunk's)."""
    return name.startswith(draft_prefix(hf_config) + "layers.")


class CheckpointMismatchError(WeightMismatchError):
    """A checkpoint's tensors do not fit the model (missing, unexpected, or wrong shape)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One Megatron parameter (or buffer: the expert-score bias) and the contract tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    fuse: str  # "copy" | "qkv" | "fc1"
    expert: int = -1
    """The global expert id of a routed expert's entry (its names'), -1 for every other entry."""


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """Which routed experts this rank holds: experts ``rank * local .. rank * local + local - 1``
    of every sparse layer, as Megatron's ``SequentialMLP.local_experts.{0..local-1}``."""

    rank: int = 0
    world: int = 1
    local: int = 0

    def global_id(self, local: int, rank: int | None = None) -> int:
        return (self.rank if rank is None else rank) * self.local + local


def expert_layout(hf_config: Mapping[str, Any]) -> ExpertLayout:
    """This rank's share of the experts (all of them without expert parallelism)."""
    from megatron.core import parallel_state

    experts = model_config(hf_config).moe
    if experts is None:
        return ExpertLayout()
    if not parallel_state.model_parallel_is_initialized():
        return ExpertLayout(local=experts.num_experts)
    world = parallel_state.get_expert_model_parallel_world_size()
    return ExpertLayout(
        rank=parallel_state.get_expert_model_parallel_rank(), world=world, local=experts.num_experts // world
    )


def _mlp_entries(m: str, h: str, sparse: bool, config: ModelConfig, layout: ExpertLayout) -> list[Entry]:
    """A layer's MLP: the dense SwiGLU, or the router, this rank's experts and the shared experts."""
    if not sparse:
        return [
            Entry(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "fc1"),
            Entry(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "copy"),
        ]
    assert config.moe is not None
    out = [Entry(m + "mlp.router.weight", (h + "mlp.gate.weight",), "copy")]
    if config.moe.router == "sigmoid_grouped":
        out.append(Entry(m + "mlp.router.expert_bias", (h + "mlp.gate.e_score_correction_bias",), "copy"))
    for local in range(layout.local):
        e, x = layout.global_id(local), f"{m}mlp.experts.local_experts.{local}."
        out += [
            Entry(
                x + "linear_fc1.weight",
                (h + f"mlp.experts.{e}.gate_proj.weight", h + f"mlp.experts.{e}.up_proj.weight"),
                "fc1",
                e,
            ),
            Entry(x + "linear_fc2.weight", (h + f"mlp.experts.{e}.down_proj.weight",), "copy", e),
        ]
    if config.moe.n_shared_experts:
        s = h + "mlp.shared_experts."
        out += [
            Entry(m + "mlp.shared_experts.linear_fc1.weight", (s + "gate_proj.weight", s + "up_proj.weight"), "fc1"),
            Entry(m + "mlp.shared_experts.linear_fc2.weight", (s + "down_proj.weight",), "copy"),
        ]
    return out


def plan(hf_config: Mapping[str, Any], megatron_names: set[str], layout: ExpertLayout | None = None) -> list[Entry]:
    """The trunk's entries in contract order (embedding, layers, final norm, output layer); a sparse
    layer's routed experts are this rank's (`layout`: `expert_layout` by default)."""
    config = model_config(hf_config)
    layout = layout if layout is not None else expert_layout(hf_config)
    entries = [Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "copy")]
    for i in range(int(hf_config["num_hidden_layers"])):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        te_qkv_norm = m + "self_attention.linear_qkv.layer_norm_weight" in megatron_names
        te_fc1_norm = m + "mlp.linear_fc1.layer_norm_weight" in megatron_names
        in_norm = "self_attention.linear_qkv.layer_norm_weight" if te_qkv_norm else "input_layernorm.weight"
        mlp_norm = "mlp.linear_fc1.layer_norm_weight" if te_fc1_norm else "pre_mlp_layernorm.weight"
        entries += [
            Entry(m + in_norm, (h + "input_layernorm.weight",), "copy"),
            Entry(
                m + "self_attention.linear_qkv.weight",
                tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"),
                "qkv",
            ),
        ]
        if config.attention_bias:
            entries.append(
                Entry(m + "self_attention.linear_qkv.bias", tuple(h + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv")
            )
        if config.qk_norm:
            entries += [
                Entry(m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",), "copy"),
                Entry(m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",), "copy"),
            ]
        entries += [
            Entry(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), "copy"),
            Entry(m + mlp_norm, (h + "post_attention_layernorm.weight",), "copy"),
            *_mlp_entries(m, h, config.is_sparse(i), config, layout),
        ]
    entries.append(Entry("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"))
    if not hf_config.get("tie_word_embeddings", False):
        entries.append(Entry("output_layer.weight", ("lm_head.weight",), "copy"))
    missing = [e.megatron for e in entries if e.megatron not in megatron_names]
    if missing:
        raise CheckpointMismatchError(
            f"the Megatron model lacks parameters the plan expects: {missing[:5]} "
            "(was it built from the same config, with pipeline parallel 1?)"
        )
    return entries


def _names_on(entry: Entry, layout: ExpertLayout, rank: int) -> tuple[str, ...]:
    """`entry`'s contract names as expert-parallel rank `rank` holds them (its expert, same local slot)."""
    if entry.expert < 0 or rank == layout.rank:
        return entry.hf
    local = entry.expert - layout.global_id(0)
    mine, theirs = f".experts.{entry.expert}.", f".experts.{layout.global_id(local, rank)}."
    return tuple(n.replace(mine, theirs) for n in entry.hf)


def _all_names(entries: list[Entry], layout: ExpertLayout) -> list[str]:
    """Every contract name of the trunk, each expert-parallel rank's experts included, in export order."""
    out: list[str] = []
    for e in entries:
        ranks = range(layout.world) if e.expert >= 0 else [layout.rank]
        for rank in ranks:
            out += _names_on(e, layout, rank)
    return out


def _tensors(model: nn.Module) -> dict[str, Tensor]:
    """The model's parameters and the routers' expert-score bias (a buffer in Megatron)."""
    out: dict[str, Tensor] = dict(model.named_parameters())
    out |= {n: b for n, b in model.named_buffers() if n.endswith("mlp.router.expert_bias")}
    return out


def _heads(hf_config: Mapping[str, Any]) -> tuple[int, int, int]:
    heads, groups = int(hf_config["num_attention_heads"]), int(hf_config["num_key_value_heads"])
    head_dim = int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads)
    return heads, groups, head_dim


def fuse(entry: Entry, tensors: list[Tensor], hf_config: Mapping[str, Any]) -> Tensor:
    """Contract tensors -> the full (unsharded) Megatron tensor."""
    if entry.fuse == "copy":
        return tensors[0]
    if entry.fuse == "fc1":
        return torch.cat(tensors, dim=0)  # (2*ffn, hidden): gate over up
    heads, groups, d = _heads(hf_config)
    q, k, v = tensors  # (heads*d, H), (groups*d, H), (groups*d, H); or their biases (heads*d,), ...
    tail = q.shape[1:]
    q = q.reshape(groups, heads // groups * d, *tail)
    k = k.reshape(groups, d, *tail)
    v = v.reshape(groups, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)  # per group: its q heads, then k, then v


def split(entry: Entry, full: Tensor, hf_config: Mapping[str, Any]) -> list[Tensor]:
    """The full Megatron tensor -> contract tensors (inverse of `fuse`)."""
    if entry.fuse == "copy":
        return [full]
    if entry.fuse == "fc1":
        return list(full.chunk(2, dim=0))
    heads, groups, d = _heads(hf_config)
    tail = full.shape[1:]  # (H,) of the weight, () of the bias
    q, k, v = full.reshape(groups, (heads // groups + 2) * d, *tail).split([heads // groups * d, d, d], dim=1)
    return [q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)]


def _tp(param: Tensor) -> tuple[bool, int, int]:
    return (
        bool(getattr(param, "tensor_model_parallel", False)),
        int(getattr(param, "partition_dim", 0)),
        int(getattr(param, "partition_stride", 1)),
    )


def shard(full: Tensor, param: Tensor, rank: int, world: int) -> Tensor:
    """This rank's piece of `full` for `param` (Megatron's strided split: chunks r, r+world, ...)."""
    parallel, dim, stride = _tp(param)
    if not parallel or world == 1:
        return full
    pieces = torch.split(full, full.shape[dim] // (stride * world), dim=dim)
    return torch.cat(pieces[rank::world], dim=dim)


def unshard(shards: list[Tensor], param: Tensor) -> Tensor:
    """Reassemble the full tensor from every rank's shard (inverse of `shard`)."""
    parallel, dim, stride = _tp(param)
    if not parallel or len(shards) == 1:
        return shards[0]
    per_rank = [s.chunk(stride, dim=dim) for s in shards]  # [rank][stride piece]
    return torch.cat([per_rank[r][s] for s in range(stride) for r in range(len(shards))], dim=dim)


def _tp_group(expert: bool = False) -> tuple[dist.ProcessGroup | None, int, int]:
    """The tensor-parallel group of a parameter: the expert-tensor-parallel one for a routed expert's."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None, 0, 1
    if expert:
        return (
            parallel_state.get_expert_tensor_parallel_group(),
            parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_world_size(),
        )
    return (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


@torch.no_grad()
def load_trunk(model: nn.Module, tensors: Mapping[str, Tensor], hf_config: Mapping[str, Any]) -> None:
    """Copy contract-named trunk tensors into a megatron-core GPTModel (this rank's shards, and
    under expert parallelism this rank's experts).

    Draft tensors (``mtp.*``, MiMo's ``model.mtp_layers.*``) are ignored here; anything else unknown or missing raises.
    """
    params = _tensors(model)
    layout = expert_layout(hf_config)
    entries = plan(hf_config, set(params), layout)
    wanted = set(_all_names(entries, layout))
    trunk = {k for k in tensors if not is_draft_name(k, hf_config)}
    if wanted != trunk:
        raise CheckpointMismatchError(
            f"checkpoint trunk tensors differ from the model: missing {sorted(wanted - trunk)[:5]}, "
            f"unexpected {sorted(trunk - wanted)[:5]}"
        )
    for e in entries:
        param = params[e.megatron]
        _, rank, world = _tp_group(expert=e.expert >= 0)
        piece = shard(fuse(e, [tensors[n] for n in e.hf], hf_config), param, rank, world)
        if piece.shape != param.shape:
            raise CheckpointMismatchError(
                f"{e.hf} -> {e.megatron}: shard shape {tuple(piece.shape)} != parameter shape {tuple(param.shape)}"
            )
        param.copy_(piece)


@torch.no_grad()
def export_trunk(model: nn.Module, hf_config: Mapping[str, Any]) -> Iterator[tuple[str, Tensor]]:
    """Yield (contract name, full tensor) for the trunk, one Megatron parameter at a time (a routed
    expert's: that local slot of every expert-parallel rank), in `export_names`' order.

    Collective under tensor and expert parallelism: every rank of the groups must iterate to the end.
    """
    from megatron.core import parallel_state

    params = _tensors(model)
    layout = expert_layout(hf_config)
    ep_group = parallel_state.get_expert_model_parallel_group() if layout.world > 1 else None
    for e in plan(hf_config, set(params), layout):
        param = params[e.megatron]
        local = param.detach()
        group, _, world = _tp_group(expert=e.expert >= 0)
        if world > 1 and _tp(param)[0]:
            shards = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(shards, local.contiguous(), group=group)
            full = unshard(shards, param)
        else:
            full = local.clone()
        if e.expert < 0 or ep_group is None:
            yield from zip(e.hf, split(e, full, hf_config), strict=True)
            continue
        owners = [torch.empty_like(full) for _ in range(layout.world)]
        dist.all_gather(owners, full.contiguous(), group=ep_group)
        for rank, tensor in enumerate(owners):
            yield from zip(_names_on(e, layout, rank), split(e, tensor, hf_config), strict=True)


def export_names(model: nn.Module, hf_config: Mapping[str, Any]) -> list[str]:
    """The contract names `export_trunk` yields, in its order, without touching any tensor."""
    layout = expert_layout(hf_config)
    return _all_names(plan(hf_config, set(_tensors(model)), layout), layout)


def draft_names(draft: nn.Module, hf_config: Mapping[str, Any]) -> list[str]:
    """The contract names `export_draft` yields, in its order."""
    return [draft_prefix(hf_config) + name for name, _ in draft.named_parameters()]


def export_draft(draft: nn.Module, hf_config: Mapping[str, Any]) -> Iterator[tuple[str, Tensor]]:
    """Yield (contract name, tensor) of the draft head (replicated; names already contract sub-names)."""
    prefix = draft_prefix(hf_config)
    for name, param in draft.named_parameters():
        yield prefix + name, param.detach().clone()
