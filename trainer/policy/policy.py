"""The trainer's policy: megatron-core trunk + MTP draft head, their optimizers, and one RL step.

What the RL loop uses:

    policy = Policy.from_checkpoint("ckpt/", Policy.Config(...))   # or Policy(model_config, cfg)
    logp = policy.logprobs(tokens)                                 # (B, S-1) float32, no grad
    metrics = policy.train_step(batch)                             # one GRPO/DAPO + draft update
    metrics = policy.train_draft_step(tokens, mask)                # draft only (warm-up on in-domain data)
    for name, tensor in policy.export_named_tensors(): ...         # naming contract, bounded memory
    names = policy.export_names()                                  # their order, for a streamed push
    policy.save("run/step_10"); policy.load("run/step_10")         # resume bit for bit

A step is ordered so that the two objectives cannot touch each other: the policy loss is
backpropagated, then the draft loss on *detached* trunk outputs (computed before any weight
moves), then gradients are reduced (tensor-parallel q/k-norm sums, data-parallel sums), each
optimizer clips its own gradients and steps. The trunk's optimizer is the Muon/AdamW hybrid from
`muon` (Q, K, V orthogonalised per query group); the draft has its own hybrid and clip.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from muon import HybridOptimizer, HybridOptimizerConfig, QKVLayout, build_optimizer
from sidecar.model.eagle3 import PUSH_PREFIX, Eagle3Config, Eagle3Draft
from sidecar.model.model import ModelConfig
from trainer.draft.objective import DraftConfig, DraftHead, Eagle3Head, MTPDraft, draft_loss, draft_step_tokens
from trainer.policy import bridge, gpt, moe, platform
from trainer.policy.data_parallel import (
    adopt_main_grads,
    balanced_rows,
    reduce_metrics,
    reduce_mismatch,
    row_lengths,
    wrap,
)
from trainer.policy.losses import BatchTotals, GRPOConfig, mismatch_metrics, policy_loss
from trainer.policy.moe import RouterConfig
from trainer.schedules import LRScheduleConfig, build_scheduler

MOE_TENSOR_PARALLEL = (
    "training a mixture of experts with tensor_parallel > 1 needs Megatron-core's sequence parallelism, which "
    "the trainer does not use yet (its log-probs and exports run at any tensor-parallel size): train with "
    "tensor_parallel=1 and shard the experts with expert_parallel"
)


@dataclass(kw_only=True, slots=True)
class TrainBatch:
    """One batch of samples, right-padded; every (B, S-1) tensor is aligned with tokens[:, 1:]."""

    tokens: Tensor
    """(B, S) int64 prompt + response token ids, right-padded."""
    mask: Tensor
    """(B, S-1) 1 where tokens[:, 1:] is a response token that counts in the loss (0 on prompt,
    padding and filtered groups)."""
    advantages: Tensor
    """(B,) one advantage per sample (`trainer.policy.losses.group_advantages`)."""
    old_logprobs: Tensor | None = None
    """(B, S-1) log-probs the PPO ratio is taken against; None: the current policy's (on-policy)."""
    rollout_logprobs: Tensor | None = None
    """(B, S-1) the engine's reported log-probs, for the training–inference mismatch metric."""
    ref_logprobs: Tensor | None = None
    """(B, S-1) reference policy log-probs, needed when GRPOConfig.kl_coef > 0."""
    generated: Tensor | None = None
    """(B, S-1) 1 on every generated token, including those of groups the loss filters out:
    where the training–inference mismatch metric is taken; None: `mask`."""
    routes: Tensor | None = None
    """(B, S, sparse layers, k) int64: the experts the sampler chose for each token as an input, in
    every sparse layer, -1 on positions the trainer routes live (each sample's last token, padding);
    the forwards replay them (routing replay, `trainer.policy.moe`). None: live routing."""
    off_policy: bool = False
    """The samples came from an older policy (asynchronous RL): the loss weights each token by
    its truncated importance weight against `rollout_logprobs` (`trainer.policy.losses.policy_loss`)."""

    def __post_init__(self) -> None:
        b, s = self.tokens.shape
        for name in ("mask", "old_logprobs", "rollout_logprobs", "ref_logprobs", "generated"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (b, s - 1):
                raise ValueError(
                    f"{name} must be (B, S-1) = ({b}, {s - 1}) aligned with tokens[:, 1:], got {tuple(t.shape)}"
                )
        if self.off_policy and self.rollout_logprobs is None:
            raise ValueError("an off-policy batch needs rollout_logprobs (the sampling policy's log-probs)")
        if tuple(self.advantages.shape) != (b,):
            raise ValueError(f"advantages must be (B,) = ({b},), got {tuple(self.advantages.shape)}")
        if self.routes is not None and (self.routes.ndim != 4 or tuple(self.routes.shape[:2]) != (b, s)):
            raise ValueError(
                f"routes must be (B, S, sparse layers, k) with (B, S) = ({b}, {s}) the tokens', got {tuple(self.routes.shape)}"
            )

    def select(self, rows: Tensor) -> TrainBatch:
        """The samples at `rows` (1-D int64 indices), every field sliced alike."""

        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[rows]

        return TrainBatch(
            tokens=self.tokens[rows],
            mask=self.mask[rows],
            advantages=self.advantages[rows],
            old_logprobs=pick(self.old_logprobs),
            rollout_logprobs=pick(self.rollout_logprobs),
            ref_logprobs=pick(self.ref_logprobs),
            generated=pick(self.generated),
            routes=pick(self.routes),
            off_policy=self.off_policy,
        )

    def crop(self, seq: int) -> TrainBatch:
        """The first `seq` token columns (and seq - 1 of every aligned field): drops padding that
        no row of this batch uses. Causal attention makes the kept positions' outputs unchanged."""

        def cut(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[:, : seq - 1]

        return TrainBatch(
            tokens=self.tokens[:, :seq],
            mask=self.mask[:, : seq - 1],
            advantages=self.advantages,
            old_logprobs=cut(self.old_logprobs),
            rollout_logprobs=cut(self.rollout_logprobs),
            ref_logprobs=cut(self.ref_logprobs),
            generated=cut(self.generated),
            routes=None if self.routes is None else self.routes[:, :seq],
            off_policy=self.off_policy,
        )

    def data_parallel_share(self, rank: int, replicas: int) -> TrainBatch:
        """Data-parallel replica `rank`'s token-balanced rows of `replicas` (`trainer.policy.data_parallel`),
        cropped to the longest of them; the whole batch when `replicas` is 1."""
        if replicas == 1:
            return self
        lengths = row_lengths(self.generated if self.generated is not None else self.mask)
        rows = balanced_rows(lengths, replicas)[rank]
        return self.select(torch.tensor(rows, dtype=torch.long)).crop(max(lengths[r] for r in rows))

    @classmethod
    def from_sequences(
        cls,
        prompts: list[list[int]],
        responses: list[list[int]],
        advantages: Tensor,  # (B,)
        rollout_logprobs: list[list[float]] | None = None,
        pad_id: int = 0,
        loss_masks: list[list[int]] | None = None,
    ) -> TrainBatch:
        """Pack prompt/response token lists (and the engine's per-token log-probs) into a batch.
        `loss_masks`: per response, 1 on the tokens the loss counts and 0 on the others (a multi-turn
        episode's observations, `trainer.rl.episodes`); None: every response token counts."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        if loss_masks is not None and [len(m) for m in loss_masks] != [len(r) for r in responses]:
            raise ValueError("each loss mask must have one entry per response token")
        seq = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
        b = len(prompts)
        tokens = torch.full((b, seq), pad_id, dtype=torch.long)
        mask = torch.zeros(b, seq - 1)
        rollout = torch.zeros(b, seq - 1) if rollout_logprobs is not None else None
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            tokens[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
            mask[i, len(p) - 1 : len(p) - 1 + len(r)] = (
                1.0 if loss_masks is None else torch.tensor(loss_masks[i]).float()
            )
            if rollout is not None and rollout_logprobs is not None:
                rollout[i, len(p) - 1 : len(p) - 1 + len(r)] = torch.tensor(rollout_logprobs[i], dtype=torch.float32)
        return cls(tokens=tokens, mask=mask, advantages=advantages.float(), rollout_logprobs=rollout)


class Policy:
    """megatron-core policy + MTP draft head + optimizers, on this rank's shard of the model."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Everything about training the policy; the model's shape comes from its ModelConfig."""

        tensor_parallel: int = 1
        """Tensor-parallel size (must divide heads, kv heads, ffn and vocab)."""
        expert_parallel: int = 1
        """Expert-parallel size of a mixture of experts (must divide num_experts and the world):
        each of these ranks holds num_experts / expert_parallel of every sparse layer's experts, the
        tokens exchanged by Megatron's allgather dispatcher. 1 for a dense model."""
        router: RouterConfig = field(default_factory=RouterConfig)
        """How an MoE policy's routers train (`trainer.policy.moe.RouterConfig`); ignored when dense."""
        data_parallel: int = 1
        """Data-parallel replicas: the process group must hold data_parallel x tensor_parallel
        ranks. Every rank is given the whole batch and trains its replica's token-balanced share;
        gradients are summed by megatron-core's DistributedDataParallel (`trainer.policy.data_parallel`)."""
        seed: int = 1234
        """Seed of initialisation (for weights the checkpoint lacks) and of every RNG."""
        temperature: float = 1.0
        """Rollout temperature: log-probs are log_softmax(logits / T) (T = 1 for greedy)."""
        grpo: GRPOConfig = field(default_factory=GRPOConfig)
        optimizer: HybridOptimizerConfig = field(default_factory=lambda: HybridOptimizerConfig(lr=1e-5))
        """Trunk optimizer (Muon for hidden matrices, AdamW for the rest)."""
        clip_grad: float = 1.0
        """Max global gradient norm of the trunk."""
        draft: DraftConfig = field(default_factory=DraftConfig)
        """The draft: whether it trains in the same step, its objective, optimizer, clip, schedule."""
        micro_batch_rows: int = 0
        """Rows per forward/backward; an update accumulates the gradients of all micro-batches, each
        normalised by the whole batch's counts, so it equals the unsplit update up to float32
        summation order (tested). 0: the whole batch in one forward."""
        lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
        """Learning-rate schedule of the trunk optimizer."""
        total_updates: int = 0
        """Optimizer updates of the whole run: the span of a schedule whose total_steps is 0."""

        def __post_init__(self) -> None:
            if self.tensor_parallel < 1:
                raise ValueError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
            if self.expert_parallel < 1:
                raise ValueError(f"expert_parallel must be >= 1, got {self.expert_parallel}")
            if self.data_parallel < 1:
                raise ValueError(f"data_parallel must be >= 1, got {self.data_parallel}")
            if self.micro_batch_rows < 0:
                raise ValueError(f"micro_batch_rows must be >= 0 (0: whole batch), got {self.micro_batch_rows}")
            if self.total_updates < 0:
                raise ValueError(f"total_updates must be >= 0, got {self.total_updates}")
            if not self.temperature >= 0.0:
                raise ValueError(f"temperature must be >= 0, got {self.temperature}")
            for name in ("clip_grad",):
                if not getattr(self, name) > 0.0:
                    raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def __init__(
        self,
        model_config: ModelConfig,
        cfg: Policy.Config,
        tensors: dict[str, Tensor] | None = None,
        eagle3: Eagle3Draft | Eagle3Config | None = None,
    ) -> None:
        """Build on the current process group (a world of one is created if none exists).

        `tensors`: contract-named weights (trunk, and draft if present); None keeps the seeded
        random initialisation (the draft is initialised when the checkpoint has no ``mtp.*``).
        `eagle3`: train an EAGLE-3 draft (a served one's weights, or a fresh one of that shape)
        instead of the MTP layers; the checkpoint's ``mtp.*`` tensors, if any, are then not loaded.
        """
        platform.apply_cpu_accommodations()
        if not dist.is_initialized():
            platform.init_single_process_group()
        platform.initialize_model_parallel(cfg.tensor_parallel, 1, seed=cfg.seed, expert_parallel=cfg.expert_parallel)
        world = dist.get_world_size()
        if world != cfg.data_parallel * cfg.tensor_parallel:
            raise ValueError(
                f"{world} processes but data_parallel={cfg.data_parallel} x tensor_parallel={cfg.tensor_parallel}: "
                "launch data_parallel x tensor_parallel processes (torchrun --nproc-per-node, --nnodes)"
            )
        self.cfg = cfg
        self.model_config = model_config
        self.hf = model_config.to_hf_dict()
        self.model = gpt.build_gpt_model(
            self.hf, tensor_parallel=cfg.tensor_parallel, expert_parallel=cfg.expert_parallel, router=cfg.router
        )
        self.replay_slots = moe.install_replay(self.model) if model_config.moe is not None else []
        """The routers' replay slots (`trainer.policy.moe.PositionReplay`), in sparse-layer order; [] when dense."""
        if cfg.router.frozen:
            for name, p in self.model.named_parameters():
                if moe.is_router_name(name):
                    p.requires_grad_(False)
        self.draft: DraftHead | None = None
        self.taps: tuple[int, ...] = ()
        """Trunk layers whose input the draft reads (EAGLE-3's low/middle/high); () for MTP."""
        if eagle3 is not None:
            if isinstance(eagle3, Eagle3Draft):
                eagle3.config.check_target(model_config)
                self.draft = Eagle3Head.of(eagle3).to(platform.device())
            else:
                eagle3.check_target(model_config)
                torch.manual_seed(cfg.seed)
                self.draft = Eagle3Head(eagle3).to(platform.device())
                self.draft.init_weights()
            self.taps = self.draft.config.aux_layers(model_config.num_hidden_layers)
            if tensors is not None:
                tensors = {k: v for k, v in tensors.items() if not bridge.is_draft_name(k, self.hf)}
        elif model_config.num_nextn_predict_layers > 0:
            torch.manual_seed(cfg.seed)
            self.draft = MTPDraft(model_config).to(platform.device())
            self.draft.init_weights()
        if tensors is not None:
            self.load_tensors(tensors)
        # data parallel: megatron-core DDP sums each backward's gradients over the replicas into
        # contiguous buffers (`main_grad`); the trunk's buckets are reduced while the backward
        # runs, the small draft's in one synchronous call (its unused chain layers get no grad)
        self._ddp: list[Any] = []  # megatron.core DistributedDataParallel (untyped)
        if cfg.data_parallel > 1:
            self._ddp.append(wrap(self.model, self.model.config, overlap=True))
            if self.draft is not None and cfg.draft.train:
                self._ddp.append(wrap(self.draft, self.model.config, overlap=False))
        self.step_count = 0
        self.optimizer = self._build_trunk_optimizer()
        self.draft_optimizer = (
            build_optimizer(self.draft.named_parameters(), cfg.draft.optimizer) if self.draft is not None else None
        )
        total = cfg.total_updates or None
        self.scheduler = build_scheduler(self.optimizer, cfg.lr_schedule, total)
        self.draft_scheduler = (
            build_scheduler(self.draft_optimizer, cfg.draft.lr_schedule, total)
            if self.draft_optimizer is not None
            else None
        )

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, cfg: Policy.Config, eagle3: Eagle3Draft | Eagle3Config | None = None
    ) -> Policy:
        """Load a naming-contract checkpoint (config.json + model.safetensors); `eagle3` as in `__init__`."""
        from sidecar.model.checkpoint import load_checkpoint

        model_config, tensors = load_checkpoint(path)
        return cls(model_config, cfg, tensors, eagle3)

    def _build_trunk_optimizer(self) -> HybridOptimizer:
        from megatron.core import parallel_state

        c = self.model_config
        layout = QKVLayout.from_heads(
            num_attention_heads=c.num_attention_heads, num_query_groups=c.num_key_value_heads, head_dim=c.head_dim
        )
        tp_group = parallel_state.get_tensor_model_parallel_group() if self.cfg.tensor_parallel > 1 else None
        ep_group = parallel_state.get_expert_model_parallel_group() if self.cfg.expert_parallel > 1 else None
        return build_optimizer(
            self.model.named_parameters(),
            self.cfg.optimizer,
            qkv_layout=layout,
            tp_group=tp_group,
            expert_group=ep_group,
        )

    # ---- weights -------------------------------------------------------------------------
    def load_tensors(self, tensors: dict[str, Tensor]) -> None:
        """Copy contract-named tensors in (trunk always; the draft's when present)."""
        bridge.load_trunk(self.model, tensors, self.hf)
        prefix = bridge.draft_prefix(self.hf)
        draft = {k[len(prefix) :]: v for k, v in tensors.items() if bridge.is_draft_name(k, self.hf)}
        if draft and isinstance(self.draft, Eagle3Head):
            raise bridge.CheckpointMismatchError("mtp.* tensors given to a policy that trains an EAGLE-3 draft")
        if draft and self.draft is None:
            raise bridge.CheckpointMismatchError("checkpoint has mtp.* tensors but num_nextn_predict_layers is 0")
        if draft and self.draft is not None:
            own = {k for k, _ in self.draft.named_parameters()}
            if set(draft) != own:
                raise bridge.CheckpointMismatchError(
                    f"draft tensors differ: missing {sorted(own - set(draft))[:5]}, unexpected {sorted(set(draft) - own)[:5]}"
                )
            with torch.no_grad():
                for name, p in self.draft.named_parameters():
                    p.copy_(draft[name])

    def export_named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """(contract name, full tensor): trunk then draft, one tensor gathered at a time.

        Collective under tensor parallelism: every rank must consume the whole iterator.
        """
        yield from bridge.export_trunk(self.model, self.hf)
        if isinstance(self.draft, MTPDraft):
            yield from bridge.export_draft(self.draft, self.hf)
        elif isinstance(self.draft, Eagle3Head):  # a push's DRAFT part; the token maps stay as served
            for name, p in self.draft.named_parameters():
                yield PUSH_PREFIX + name, p.detach().clone()

    def export_names(self) -> list[str]:
        """The names `export_named_tensors` yields, in its order (a streamed push's manifest)."""
        if isinstance(self.draft, Eagle3Head):
            return bridge.export_names(self.model, self.hf) + [
                PUSH_PREFIX + n for n, _ in self.draft.named_parameters()
            ]
        return bridge.export_names(self.model, self.hf) + (
            bridge.draft_names(self.draft, self.hf) if isinstance(self.draft, MTPDraft) else []
        )

    def save_draft(self, path: str | Path) -> None:
        """Write the EAGLE-3 draft as a draft directory (`specrl serve --draft`, SGLang's and vLLM's
        EAGLE-3 loaders) from rank 0. The MTP draft is part of the checkpoint `save_hf` writes."""
        from sidecar.model.eagle3_checkpoint import save_eagle3_draft

        if not isinstance(self.draft, Eagle3Head):
            raise ValueError("this policy trains no EAGLE-3 draft (its draft, if any, is saved with save_hf)")
        if not dist.is_initialized() or dist.get_rank() == 0:
            save_eagle3_draft(path, self.draft)
        if dist.is_initialized():
            dist.barrier()

    def save_hf(self, path: str | Path) -> None:
        """Write a serving checkpoint (config.json + model.safetensors, naming contract: the trunk
        and the MTP layers) from rank 0; an EAGLE-3 draft is not part of it (`save_draft`).

        Collective (all ranks gather); holds the full state dict on rank 0 while writing.
        """
        from sidecar.model.checkpoint import save_checkpoint

        tensors = {n: t for n, t in self.export_named_tensors() if not n.startswith(PUSH_PREFIX)}
        if not dist.is_initialized() or dist.get_rank() == 0:
            save_checkpoint(path, self.model_config, tensors)
        if dist.is_initialized():
            dist.barrier()

    # ---- forward -------------------------------------------------------------------------
    def logprobs(self, tokens: Tensor, routes: Tensor | None = None) -> Tensor:  # tokens (B, S) -> (B, S-1) float32
        """log p(tokens[:, t+1] | tokens[:, :t+1]) at the rollout temperature, no grad; `routes`
        (`TrainBatch.routes`) replayed where given."""
        self.model.eval()
        with torch.no_grad(), self._routing(routes):
            logits, _ = gpt.forward(self.model, tokens.to(platform.device()))
            return gpt.token_logprobs(logits[:, :-1], tokens[:, 1:].to(logits.device), self.cfg.temperature)

    def draft_logits(self, tokens: Tensor, layer: int = 0) -> Tensor:  # (B, S) -> (B, S-1-layer, V)
        """Teacher-forced draft logits of chain step `layer` (position t predicts tokens[t+layer+2])."""
        if self.draft is None:
            raise ValueError("this model has no draft head (num_nextn_predict_layers is 0)")
        self.model.eval()
        with torch.no_grad():
            _, inputs = self._trunk(tokens)
            outs = self.draft.chain(tokens, inputs, lambda ids: gpt.embed(self.model, ids), depth=layer + 1)
            return self.draft.logits(layer, outs[layer], gpt.shared_head(self.model))

    # ---- training ------------------------------------------------------------------------
    def backward(self, batch: TrainBatch) -> dict[str, float]:
        """Forward both objectives and accumulate their (reduced) gradients; no weight changes.

        `batch` is the whole batch on every rank. With `micro_batch_rows`, and with data
        parallelism (each replica takes its share, `TrainBatch.data_parallel_share`), the rows go
        through in slices whose losses are each divided by the whole batch's token (or sample)
        counts, so the gradients summed over slices and replicas are the unsplit batch's; metrics
        that are shares (losses, clip fractions) are summed likewise."""
        from megatron.core import parallel_state

        if self.replay_slots and self.cfg.tensor_parallel > 1:
            raise ValueError(MOE_TENSOR_PARALLEL)
        dev = platform.device()
        mask_all = batch.mask.to(dev)
        totals = BatchTotals.of(mask_all)
        train_draft = self.draft is not None and self.cfg.draft.train
        step_tokens = (
            draft_step_tokens(self.cfg.draft, len(self.draft.layers), mask_all)
            if train_draft and self.draft is not None
            else None
        )
        replicas = self.cfg.data_parallel
        local = batch.data_parallel_share(parallel_state.get_data_parallel_rank() if replicas > 1 else 0, replicas)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        if train_draft and self.draft_optimizer is not None:
            self.draft_optimizer.zero_grad(set_to_none=True)
        for ddp in self._ddp:
            ddp.zero_grad_buffer()
        moe.take_agreement(self.replay_slots)  # count this batch's forwards only
        rows = local.tokens.shape[0]
        size = self.cfg.micro_batch_rows or rows
        metrics: dict[str, float] = {}
        logps: list[Tensor] = []
        for start in range(0, rows, size):
            part = slice(start, min(rows, start + size))
            with contextlib.ExitStack() as stack:
                if part.stop < rows:  # reduce once, during the last slice's backward
                    for ddp in self._ddp:
                        stack.enter_context(ddp.no_sync())
                tokens = local.tokens[part].to(dev)
                mask = local.mask[part].to(dev)
                with self._routing(None if local.routes is None else local.routes[part]):
                    logits, hidden = self._trunk(tokens)
                logp = gpt.token_logprobs(logits[:, :-1], tokens[:, 1:], self.cfg.temperature)
                old = local.old_logprobs[part].to(dev) if local.old_logprobs is not None else logp.detach()
                ref = local.ref_logprobs[part].to(dev) if local.ref_logprobs is not None else None
                adv = local.advantages[part].to(dev)
                behaviour = None
                if local.off_policy:
                    assert local.rollout_logprobs is not None
                    behaviour = local.rollout_logprobs[part].to(dev)
                out = policy_loss(
                    logp, old, adv, mask, self.cfg.grpo, ref_logprobs=ref, totals=totals, behaviour_logprobs=behaviour
                )
                out.loss.backward()
                _add(metrics, out.metrics)
                logps.append(logp.detach())
                if train_draft:
                    _add(metrics, self._draft_backward(tokens, hidden, logits, mask, step_tokens))
        group = parallel_state.get_data_parallel_group() if replicas > 1 else None
        agreed, compared = moe.take_agreement(self.replay_slots)
        if local.routes is not None:
            metrics["routing_agreed"], metrics["routing_compared"] = float(agreed), float(compared)
        if group is not None:
            metrics = reduce_metrics(metrics, group)
        if "routing_compared" in metrics:  # a share of the summed counts, not a sum of shares
            compared_all = metrics.pop("routing_compared")
            agreed_all = metrics.pop("routing_agreed")
            metrics["routing_agreement"] = agreed_all / compared_all if compared_all else 1.0
        if local.rollout_logprobs is not None:
            where = local.generated.to(dev) if local.generated is not None else local.mask.to(dev)
            rollout = local.rollout_logprobs.to(dev)
            train = torch.cat(logps)
            metrics.update(
                reduce_mismatch(train, rollout, where, group)
                if group is not None
                else mismatch_metrics(train, rollout, where)
            )
        self._reduce_gradients([self.model] + ([self.draft] if self.draft is not None else []))
        return metrics

    def _draft_backward(
        self, tokens: Tensor, hidden: Tensor, logits: Tensor, mask: Tensor, step_tokens: list[float] | None = None
    ) -> dict[str, float]:
        # tokens (B, S); hidden (B, S, H); logits (B, S, V/tp); mask (B, S-1). Trunk tensors enter detached.
        # Gradients accumulate into the draft's .grad (the caller zeroes them once per update).
        assert self.draft is not None and self.draft_optimizer is not None
        self.draft.train()
        dloss, dmetrics = draft_loss(
            self.draft,
            self.cfg.draft,
            tokens,
            hidden,
            gpt.gather_vocab(logits.detach()),
            mask,
            embed=lambda ids: gpt.embed(self.model, ids),
            head=gpt.shared_head(self.model),
            temperature=self.cfg.temperature,
            step_tokens=step_tokens,
        )
        dloss.backward()
        return dmetrics

    def _routing(self, routes: Tensor | None) -> contextlib.AbstractContextManager[None]:
        """Replay `routes` (`TrainBatch.routes`) in the forwards inside; live routing when None or dense."""
        if routes is None:
            return contextlib.nullcontext()
        if not self.replay_slots:
            raise ValueError("routes given to a dense policy: routing replay needs a mixture of experts")
        return moe.replaying(self.replay_slots, routes.to(platform.device()))

    def _trunk(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """The trunk's forward: (logits (B, S, V/tp), the draft's input): the final hidden states
        (B, S, H) for MTP, the taps (B, S, 3H) for EAGLE-3 (`gpt.forward_taps`: the same
        computation, the taps only captured)."""
        if self.taps:
            logits, _, taps = gpt.forward_taps(self.model, tokens, self.taps)
            return logits, taps
        return cast(tuple[Tensor, Tensor], gpt.forward(self.model, tokens))

    def trunk_outputs(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """(logits (B, S, V/tp), the draft's input (`_trunk`)) on `tokens`, without gradients."""
        self.model.eval()
        with torch.no_grad():
            return self._trunk(tokens.to(platform.device()))

    def train_draft_step(
        self, tokens: Tensor, mask: Tensor, trunk: tuple[Tensor, Tensor] | None = None
    ) -> dict[str, float]:
        """Update only the draft head on `tokens` (B, S) with `mask` (B, S-1); the trunk runs
        without gradients. For warming a draft up on in-domain data before RL. `trunk`: the
        trunk's `trunk_outputs(tokens)`, when the caller kept them (the trunk does not change
        here, so a sample's outputs can be computed once and reused every epoch)."""
        if self.draft is None or self.draft_optimizer is None:
            raise ValueError("this model has no draft head (num_nextn_predict_layers is 0)")
        if self.cfg.data_parallel > 1:
            raise ValueError(
                "train_draft_step trains on the tokens it is given, in one replica: warm the draft up with "
                "data_parallel=1 (specrl warmup runs in one process)"
            )
        dev = platform.device()
        tokens, mask = tokens.to(dev), mask.to(dev)
        if trunk is None:
            logits, hidden = self.trunk_outputs(tokens)
        else:
            logits, hidden = trunk[0].to(dev), trunk[1].to(dev)
            if logits.shape[:2] != tokens.shape or hidden.shape[:2] != tokens.shape:
                raise ValueError(
                    f"trunk outputs {tuple(logits.shape)} / {tuple(hidden.shape)} do not match tokens "
                    f"{tuple(tokens.shape)}: pass trunk_outputs(tokens) of these very tokens"
                )
        self.draft_optimizer.zero_grad(set_to_none=True)
        metrics = self._draft_backward(tokens, hidden, logits, mask)
        self._reduce_gradients([self.draft])
        metrics["draft_grad_norm"] = float(self.draft_optimizer.clip_grad_norm_(self.cfg.draft.clip_grad))
        self.draft_optimizer.step()
        if self.draft_scheduler is not None:
            self.draft_scheduler.step()
        return metrics

    def _reduce_gradients(self, modules: list[torch.nn.Module]) -> None:
        """Finish the data-parallel sums (DDP buffers become .grad), then sum q/k-norm grads over
        TP (each rank saw only its heads)."""
        from megatron.core import parallel_state

        for ddp in self._ddp:
            if ddp.module in modules:
                ddp.finish_grad_sync()
                adopt_main_grads(ddp.module)
        if self.cfg.tensor_parallel > 1 and self.model in modules:
            tp_group = parallel_state.get_tensor_model_parallel_group()
            for name, p in self.model.named_parameters():
                if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
                    dist.all_reduce(p.grad, group=tp_group)

    def step(self) -> dict[str, float]:
        """Clip and apply the accumulated gradients (each optimizer with its own clip)."""
        metrics = {
            "grad_norm": float(self.optimizer.clip_grad_norm_(self.cfg.clip_grad)),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
        }
        self.optimizer.step()
        self.scheduler.step()
        if self.draft is not None and self.cfg.draft.train and self.draft_optimizer is not None:
            metrics["draft_grad_norm"] = float(self.draft_optimizer.clip_grad_norm_(self.cfg.draft.clip_grad))
            metrics["draft_lr"] = float(self.draft_optimizer.param_groups[0]["lr"])
            self.draft_optimizer.step()
            if self.draft_scheduler is not None:
                self.draft_scheduler.step()
        self.step_count += 1
        return metrics

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One update of policy and draft on `batch`; returns loss, clip, mismatch and draft metrics."""
        metrics = self.backward(batch)
        metrics.update(self.step())
        metrics["step"] = float(self.step_count)
        return metrics

    def train_updates(
        self, batch: TrainBatch, *, epochs: int = 1, mini_batches: int = 1, seed: int = 0
    ) -> dict[str, float]:
        """PPO-style: `epochs` passes over `batch`, each split into `mini_batches` updates (rows
        shuffled per epoch by `seed`). Every update after the first moves the policy away from the
        one that sampled, so `batch.old_logprobs` must hold the log-probs of the policy before the
        first update (`Policy.logprobs`; the loop's separate log-prob pass). Mini-batches without
        a counted token (all groups filtered) are skipped. Returns the updates' mean metrics."""
        if epochs < 1 or mini_batches < 1:
            raise ValueError(f"epochs and mini_batches must be >= 1, got {epochs} and {mini_batches}")
        rows = batch.tokens.shape[0]
        if mini_batches > rows:
            raise ValueError(f"mini_batches={mini_batches} exceeds the batch's {rows} rows")
        if (epochs > 1 or mini_batches > 1) and batch.old_logprobs is None:
            raise ValueError("several updates per batch need batch.old_logprobs (the sampling policy's log-probs)")
        if epochs == 1 and mini_batches == 1:
            return self.train_step(batch)
        gen = torch.Generator().manual_seed(seed)
        sums: dict[str, float] = {}
        updates = 0
        for _ in range(epochs):
            order = torch.randperm(rows, generator=gen)
            for chunk in order.tensor_split(mini_batches):
                part = batch.select(chunk)
                if float(part.mask.sum()) == 0.0:
                    continue
                _add(sums, self.train_step(part))
                updates += 1
        out = {k: v / updates for k, v in sums.items()} if updates else {}
        out["updates"] = float(updates)
        out["step"] = float(self.step_count)
        return out

    # ---- checkpoints ---------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write a resumable checkpoint (see `trainer.policy.checkpointing`)."""
        from trainer.policy.checkpointing import save_policy

        save_policy(self, Path(path))

    def load(self, path: str | Path) -> None:
        """Restore a checkpoint written by `save` (same model and parallel layout)."""
        from trainer.policy.checkpointing import load_policy

        load_policy(self, Path(path))

    def state(self) -> dict[str, Any]:
        """Model, draft and optimizer state of this rank (for `trainer.policy.checkpointing`)."""
        return {
            "model": {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")},
            "draft": self.draft.state_dict() if self.draft is not None else None,
            "optimizer": self.optimizer.state_dict(),
            "draft_optimizer": self.draft_optimizer.state_dict() if self.draft_optimizer is not None else None,
            "scheduler": self.scheduler.state_dict(),
            "draft_scheduler": self.draft_scheduler.state_dict() if self.draft_scheduler is not None else None,
            "step": self.step_count,
        }


def _add(into: dict[str, float], metrics: dict[str, float]) -> None:
    for key, value in metrics.items():
        into[key] = into.get(key, 0.0) + value
