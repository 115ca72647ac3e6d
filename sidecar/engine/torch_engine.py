"""The embedded PyTorch engine: continuous batching with speculative decoding (CPU and CUDA).

One `step()` = admit queued sequences (one prefill forward, which emits their first token)
and advance every running sequence by one speculative round: draft k tokens with the draft
(`drafters`: the MTP layer(s), or a separate EAGLE-3 draft), verify them in one target forward
over k+1 positions, accept by exact rejection sampling, roll back the rejected KV entries
(`speculative.py` holds the pure steps, `sampling.py` the acceptance rule). k = 0 is plain
decoding through the same path.

Reproducibility: each uniform a sequence uses is a pure function of (its seed, the output
position where the round starts, role, index) — `counter_rng`, a hash computed on the device — with
the seed from (request seed, prompt_index, sample_index). A round at output position n draws k
draft samples, k acceptance tests and the final token. So a sequence's tokens do not depend on the
other sequences in its batch (batched == unbatched), and no per-row host work draws them.

The KV caches are paged (`kv_cache`, `kv_pages`): one pool of blocks sized by a memory budget,
allocated once, a row holding the blocks its tokens fill and a prompt's samples sharing its full
blocks. Sequences are admitted while free blocks hold their prompt and a round's writes; when
blocks run out mid-generation the latest admitted rows are preempted (blocks freed, requeued first)
and resume later by recomputing their prefix — with the same tokens, since every uniform is keyed
by output position. A round's result comes back in one packed host copy.

Reported log-probs: log_softmax(target_logits / T) of each emitted token, float32, T = the
request temperature (1 when temperature is 0), before top-k/top-p filtering — the quantity
an RL trainer recomputes.

Weight updates land between steps; sequences in flight keep their cached prefix (computed
with the old weights) and continue with the new ones (`Sample.last_weight_version`).

Adaptive k (`set_speculation_auto`): sequences that do not pin k take, in each decode step, the
k chosen by `speculation.controller.SpeculationController` from the engine's own measurements (seconds of
the draft phase and of the whole step, per batch size; per-position acceptance). Such sequences
keep their latest `CATCH_UP_POSITIONS` MTP inputs pending while k = 0, so drafting can resume at
any step at the cost of an ordinary draft phase (older skipped positions are never fed to the MTP
layer: its cache keeps a gap there, which can only lower acceptance, never exactness); k changing
between rounds never changes what is accepted (each round is an exact rejection-sampling round), so
outputs stay lossless. At temperature > 0 a sequence's tokens then depend on the k chosen per
round (k decides how many uniforms a round draws), which depends on measured timings: auto mode
is exactly distributed but not bit-reproducible across runs; pin k for bit-reproducible samples.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

import sidecar
from sidecar.engine.base import Engine
from sidecar.engine.commit import commit_prefill, commit_round, emitted_ids, verify_union
from sidecar.engine.config import EngineConfig
from sidecar.engine.decode_round import RoundOutput
from sidecar.engine.drafters import make_drafter
from sidecar.engine.round_graphs import FixedRounds, batch_bucket
from sidecar.engine.row_scheduler import RowScheduler, StepPlan, row_order
from sidecar.engine.rows import Sequence, add_rounds, cost_clock, sequence_seed
from sidecar.engine.runner import Prefill, Runner
from sidecar.engine.scoring import score
from sidecar.engine.served_weights import ServedWeights
from sidecar.engine.speculation_settings import SpeculationSettings, expert_reads_of
from sidecar.engine.validation import validate_request
from sidecar.engine.version_ledger import VersionLedger
from sidecar.errors import InvalidRequestError, KVCacheCapacityError
from sidecar.model.checkpoint import load_checkpoint
from sidecar.model.eagle3 import Eagle3Draft
from sidecar.model.eagle3_checkpoint import load_eagle3_draft
from sidecar.model.kv_pages import KVPages, blocks_for, pool_blocks
from sidecar.model.model import Qwen3WithMTP, build_model
from sidecar.model.moe import packed_routes
from sidecar.model.prefix_cache import PrefixCache
from sidecar.speculation.config import RowState, SpeculationControllerConfig, SpeculationDecision
from sidecar.speculation.controller import SpeculationController
from sidecar.types import (
    EngineInfo,
    FinishReason,
    GenerationRequest,
    KVUsage,
    ModelInfo,
    Sample,
    SamplingParams,
    ScoreRequest,
    SpeculationStatus,
    TensorSpec,
    VersionStats,
    WeightSelector,
)

UNION_EVERY = 8
"""Automatic k on a mixture-of-experts target measures the experts one decode round in this many
reads (`commit.verify_union`, from the round's routes: a copy of the round's expert ids to the host), for
its cost model's union (`SpeculationController.observe_expert_union`)."""


class TorchEngine(Engine):
    """Embedded engine over a `Qwen3WithMTP`; see the module docstring. Composed of a scheduler
    (`scheduler`: queue, running rows, the block pool, preemption), a runner (`runner`: caches,
    prefill, rounds), the served weights (`weights`) and the speculation settings (`speculation`);
    `step()` reads plan → round → commit, then admission's plan → prefill → commit."""

    def __init__(
        self,
        model: Qwen3WithMTP,
        config: EngineConfig | None = None,
        *,
        draft: Eagle3Draft | None = None,
        name: str = "",
        controller: SpeculationControllerConfig | None = None,
        clock: Callable[[], float] | None = None,
        **settings: Any,
    ) -> None:
        """Serve `model` as `config` says (`EngineConfig`; its docstrings say what each setting
        does). `settings`: `EngineConfig` fields as keywords, over `config`'s (tools and tests write
        `TorchEngine(model, speculation_k=2)`); the config's own checks apply either way.

        `draft`: an EAGLE-3 draft for a target without MTP layers (`drafters`; `from_checkpoint`
        loads `config.draft`); `controller`: the controller's knobs (its max_speculation_k is set by
        the mode); `clock`: seconds, for the controller's cost measurements (tests inject one).
        Default: `cost_clock(device)`.

        KV caches: one pool of `kv_block_size`-token blocks allocated once, as many as
        `kv_cache_gib` holds (default on CUDA 90% of free memory; on a CPU, or where that is more,
        what `max_batch_size` rows of `max_context` tokens (default: the model's context) need); up to
        `max_batch_size` rows run at once, each holding the blocks its tokens fill. A request a row
        could never hold alone: `KVCacheCapacityError` (RESOURCE_EXHAUSTED).

        On a CUDA device the model's q|k|v and gate|up parameters are joined into one tensor each
        (`Qwen3WithMTP.join_projections`: views, same values), which the decode path reads without
        copies. `compile` chooses the rounds (`round_graphs`, `decode_round`)."""
        config = dataclasses.replace(config or EngineConfig(), **settings) if settings else config or EngineConfig()
        if config.kind != "torch":
            raise ValueError(f"TorchEngine serves engine.kind 'torch', got {config.kind!r}")
        self.engine_config = config
        """The settings this engine was built from."""
        self.model = model
        if model.output_weight().device.type == "cuda":
            model.join_projections()  # the decode path reads q|k|v and gate|up as they are: no copies
        self.config = model.config
        self.device = model.output_weight().device
        self.name = name
        self.drafter = make_drafter(model, draft, config.draft_vocab_size)
        self.draft_vocab_size = 0 if self.drafter.vocab is None else config.draft_vocab_size
        drafts = self.drafter.num_layers > 0  # draft layers (one KV cache each), of either kind
        self.max_speculation_k = config.max_speculation_k if drafts else 0
        context = self.config.max_position_embeddings
        self.max_context = context if config.max_context is None else config.max_context
        if not 2 <= self.max_context <= context:
            raise ValueError(f"max_context must be in [2, max_position_embeddings={context}], got {self.max_context}")
        self.max_batch_size = config.max_batch_size
        slots = self.max_context + self.max_speculation_k + 2
        self.slots_per_row = slots
        """KV slots a row may hold: its context and the scratch columns a verify writes past it."""
        block = config.kv_block_size
        pages = KVPages(
            num_blocks=pool_blocks(
                budget=config.kv_cache_bytes,
                block_bytes=block * self.drafter.token_bytes(),
                max_batch_size=self.max_batch_size,
                max_slots=slots,
                block_size=block,
                device=self.device,
            ),
            block_size=block,
            max_batch_size=self.max_batch_size,
            max_slots=slots,
            device=self.device,
        )
        if config.prefix_cache:
            pages.cache = PrefixCache(block)
        self.prefix_cache = pages.cache
        """Full blocks of rows that left, kept within a weight version (`prefix_cache`), or None."""
        self.scheduler = RowScheduler(
            pages, max_batch_size=self.max_batch_size, max_speculation_k=self.max_speculation_k, drafts=drafts
        )
        self.runner = Runner(
            model, self.drafter, pages, slots=slots, max_speculation_k=self.max_speculation_k, compile=config.compile
        )
        self.weights = ServedWeights(model, self.drafter)
        # Without a draft speculation is unavailable: the default k is 0.
        self.speculation = SpeculationSettings(
            min(config.speculation_k, self.max_speculation_k),
            max_speculation_k=self.max_speculation_k,
            has_draft=drafts,
            controller=controller,
            expert_reads=expert_reads_of(self.config),
        )
        self._clock = clock or cost_clock(self.device)
        if config.speculation_auto:
            self.set_speculation_auto(self.speculation.k)
        self._stats = VersionLedger()
        self._live: dict[str, int] = {}  # request id -> unfinished sequences
        self._last_round_k = 0  # drafts of the previous decode step (a larger refresh is a catch-up)
        self._rounds = 0  # rounds planned (automatic k measures every UNION_EVERY-th one's expert union)
        self.kernels = self.runner.kernels
        self.compile = config.compile
        moe, layers = self.config.moe, sum(map(self.config.is_sparse, range(self.config.num_hidden_layers)))
        self._no_routes = packed_routes(  # (sparse layers, 0, top k): a sample's routes before any position's
            torch.empty(layers, 0, 0 if moe is None else moe.num_experts_per_tok, dtype=torch.int64),
            0 if moe is None else moe.num_experts,
        )

    def warm_up(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Run a fixed-shape round at every batch bucket, plainly and at the default k, before
        serving (in automatic k's form, two graphs a round, when the engine is in auto mode): on
        CUDA those shapes' graphs are captured here rather than in the first requests that meet
        them (longer contexts, other k and refresh widths are captured when they first occur). `progress(done, total)` after each shape; returns the graphs captured. The
        warm-up's requests pin k (the controller learns nothing from them) and its tokens leave no
        trace in the statistics. Nothing to do without fixed-shape rounds (`compile` off, or auto on
        a CPU)."""
        if not isinstance(self.runner.rounds, FixedRounds):
            return 0
        if self.has_work():
            raise RuntimeError("warm_up runs before serving: the engine already has requests")
        buckets = sorted({batch_bucket(b, self.max_batch_size) for b in range(1, self.max_batch_size + 1)})
        shapes = [(b, k) for b in buckets for k in sorted({0, self.speculation.k})]
        before = self.runner.rounds.captured
        # automatic k times the draft phase, so its rounds are two graphs, one a phase: those too
        self.runner.timed_drafts = self.speculation.auto
        try:
            for i, (rows, k) in enumerate(shapes):
                self.generate(
                    GenerationRequest(
                        prompts=[[0, 0]] * rows,
                        sampling=SamplingParams(temperature=0.0, max_new_tokens=k + 2),
                        speculation_k=k,
                        request_id=f"warm-up-{rows}-{k}",
                    )
                )
                if progress is not None:
                    progress(i + 1, len(shapes))
        finally:
            self.runner.timed_drafts = False
        self._stats = VersionLedger()
        self._stats.serve(self.weights.version)
        self.scheduler.pages.drop_cache()  # nor in the prefix cache
        if self.drafter.vocab is not None:
            self.drafter.vocab.forget()  # nor in the reduced draft vocabulary's counts
        return self.runner.rounds.captured - before

    @classmethod
    def from_checkpoint(cls, path: str | Path, config: EngineConfig | None = None, **settings: Any) -> TorchEngine:
        """Load a checkpoint directory (config.json + safetensors) onto `config.device`, and the
        EAGLE-3 draft directory `config.draft` beside it (`eagle3_checkpoint`); `settings` as in
        `__init__`."""
        config = dataclasses.replace(config or EngineConfig(), **settings) if settings else config or EngineConfig()
        model_config, tensors = load_checkpoint(path)
        model = build_model(model_config, device=config.device)
        model.load_state_dict(tensors, strict=True)
        draft = config.draft
        return cls(
            model,
            config,
            draft=None if draft is None else load_eagle3_draft(draft, device=config.device, target=model_config),
            name=Path(path).name,
        )

    @classmethod
    def from_config(cls, path: str | Path, config: EngineConfig) -> TorchEngine:
        """`create_engine`'s entry: `from_checkpoint(path, config)`."""
        return cls.from_checkpoint(path, config)

    # ---- Engine interface: info and control --------------------------------------------------
    def info(self) -> EngineInfo:
        c = self.config
        rope = c.rope_config()
        return EngineInfo(
            model=ModelInfo(
                name=self.name,
                architecture=(c.architectures or ["Qwen3ForCausalLM"])[0],
                family=c.family,
                vocab_size=c.vocab_size,
                hidden_size=c.hidden_size,
                num_layers=c.num_hidden_layers,
                max_position_embeddings=c.max_position_embeddings,
                rope_type=rope.rope_type,
                rope_factor=rope.factor,
                num_mtp_layers=c.num_nextn_predict_layers,
                dtype=c.torch_dtype,
                eos_token_ids=tuple(c.eos_token_id),
                num_experts=0 if c.moe is None else c.moe.num_experts,
                num_experts_per_tok=0 if c.moe is None else c.moe.num_experts_per_tok,
                router="" if c.moe is None else c.moe.router,
                num_sparse_layers=sum(c.is_sparse(i) for i in range(c.num_hidden_layers)),
            ),
            engine="torch",
            engine_version=sidecar.__version__,
            device_kind=self.device.type,
            device_name=torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            speculation_method=self.drafter.name,
            speculation_k=self.speculation.k,
            max_speculation_k=self.max_speculation_k,
            speculation_status=self.speculation_status(),
        )

    @property
    def weight_version(self) -> int:
        return self.weights.version

    def validate(self, request: GenerationRequest) -> None:
        validate_request(request, self.config, self.max_speculation_k)
        longest = max(len(p) for p in request.prompts) + request.sampling.max_new_tokens
        if longest > self.max_context:
            raise KVCacheCapacityError(
                f"a sequence of prompt + max_new_tokens = {longest} tokens does not fit a KV cache row of "
                f"max_context={self.max_context} tokens: shorten it, or serve with a larger max_context "
                "(and a KV budget that holds it)"
            )
        blocks = blocks_for(longest + self.max_speculation_k + 2, self.scheduler.pages.block_size)
        if blocks > self.scheduler.pages.usable:
            raise KVCacheCapacityError(
                f"a sequence of prompt + max_new_tokens = {longest} tokens needs {blocks} KV blocks of "
                f"{self.scheduler.pages.block_size} tokens, the whole pool holds {self.scheduler.pages.usable}: shorten it, or serve "
                "with a larger KV budget"
            )

    def num_queued(self) -> int:
        return len(self.scheduler.queue)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def kv_usage(self) -> KVUsage:
        return self.scheduler.kv_usage()

    def stats(self) -> list[VersionStats]:
        return self._stats.recent()

    def earlier_stats(self) -> VersionStats:
        return self._stats.earlier

    # ---- speculation settings (`speculation_settings`) -------------------------------------------
    @property
    def speculation_k(self) -> int:
        return self.speculation.k

    @property
    def speculation_auto(self) -> bool:
        return self.speculation.auto

    def set_speculation_k(self, k: int) -> None:
        self.speculation.set_k(k)

    def set_speculation_auto(self, k: int) -> None:
        self.speculation.set_auto(k)

    def set_speculation_controller(self, controller: SpeculationController) -> None:
        """Auto mode with a given controller (tools and tests install a scripted or configured one)."""
        self.speculation.set_controller(controller)

    def speculation_status(self) -> SpeculationStatus:
        return self.speculation.status()

    def hold_drafting(self, why: str) -> bool:
        controller = self.speculation.controller
        if controller is None:
            return False
        controller.hold(why)  # also rows still running from an earlier automatic mode
        return self.speculation.auto

    # ---- served weights (`served_weights`) -------------------------------------------------------
    def weight_specs(self, selector: WeightSelector) -> list[TensorSpec]:
        return self.weights.specs(selector)

    def weight_checksums(self, selector: WeightSelector) -> dict[str, int]:
        return self.weights.checksums(selector)

    def update_weights(self, tensors: Mapping[str, torch.Tensor], selector: WeightSelector, version: int) -> None:
        self.weights.check_update(tensors, selector, version)
        self.weights.swap_in(tensors, adopt=False)
        self._served(version)

    def adopt_weights(
        self, tensors: Mapping[str, torch.Tensor], selector: WeightSelector, version: int
    ) -> dict[str, torch.Tensor]:
        """Serve `tensors` themselves where they can be the parameters' storage (same device,
        contiguous, and a parameter that shares its storage with nothing else); copy the rest.
        Returns the displaced storages (and the copied-from tensors), which nothing here holds
        any more."""
        self.weights.check_update(tensors, selector, version)
        free = self.weights.swap_in(tensors, adopt=True)
        self._served(version)
        return free

    def _served(self, version: int) -> None:
        self.weights.version = version
        self._stats.serve(version)
        self.scheduler.pages.drop_cache()  # never serve KV computed with other weights
        self.drafter.on_weight_push()
        if self.speculation.controller is not None:
            self.speculation.controller.on_weight_version()

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> None:
        self.validate(request)
        if not request.request_id:
            raise InvalidRequestError("request_id is empty; the server assigns one before submit")
        if request.request_id in self._live:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already running; ids must be unique")
        k = self.speculation.k if request.speculation_k is None else request.speculation_k
        auto = request.speculation_k is None and self.speculation.auto and self.speculation.k > 0
        params = request.sampling
        if params.stop_at_eos and self.config.eos_token_id:
            # Resolved once here, so the per-token stop check stays a plain membership test.
            stops = tuple(dict.fromkeys((*params.stop_token_ids, *self.config.eos_token_id)))
            params = dataclasses.replace(params, stop_token_ids=stops)
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        for p, prompt in enumerate(request.prompts):
            for s in range(request.samples_per_prompt):
                self.scheduler.queue.append(
                    Sequence(
                        request_id=request.request_id,
                        prompt_index=p,
                        sample_index=s,
                        prompt=list(prompt),
                        params=params,
                        k=k,
                        speculation_auto=auto,
                        seed=sequence_seed(seed, p, s),
                        use_prefix_cache=self.prefix_cache is not None,
                        routes=request.routes,
                        route_parts=[self._no_routes] if request.routes != "off" else [],
                    )
                )
        self._live[request.request_id] = len(request.prompts) * request.samples_per_prompt

    def abort(self, request_id: str) -> list[Sample]:
        if request_id not in self._live:
            return []
        queue, running = self.scheduler.queue, self.scheduler.running
        out = [s.to_sample(FinishReason.ABORT) for s in queue if s.request_id == request_id]
        self.scheduler.queue = deque(s for s in queue if s.request_id != request_id)
        keep = [i for i, s in enumerate(running) if s.request_id != request_id]
        out += [s.to_sample(FinishReason.ABORT) for s in running if s.request_id == request_id]
        self._keep_rows(keep)
        del self._live[request_id]
        return out

    def _finish(self, seq: Sequence, reason: FinishReason) -> Sample:
        self._live[seq.request_id] -= 1
        if not self._live[seq.request_id]:
            del self._live[seq.request_id]
        sample = seq.to_sample(reason)
        stats = self._stats[self.weights.version]
        stats.samples_finished += 1
        stats.samples_nonfinite += sample.nonfinite
        return sample

    def _keep_rows(self, keep: list[int]) -> None:
        """Keep the running rows `keep`, the scheduler's and the runner's alike (`row_order`)."""
        order = row_order(keep, len(self.scheduler.running))
        if order == list(range(len(self.scheduler.running))):
            return
        self.scheduler.keep_rows(order)
        self.runner.keep_rows(order)

    # ---- the loop --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Sample]:
        """One engine step: the running rows' round (plan → round → commit), then the queued
        sequences the freed rows and blocks hold (plan → prefill → commit)."""
        start = time.perf_counter()
        finished: list[Sample] = []
        self.model.kernels = self.kernels
        with self.model.frozen_weights():
            if self.scheduler.running:
                plan = self._plan_round()
                started = self._clock()
                timed = self.speculation.controller if any(s.speculation_auto for s in plan.rows) else None
                drafted_at = [started]

                def drafted() -> None:  # the draft phase's cost, not its launch
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    drafted_at[0] = self._clock()

                out = self.runner.round(
                    plan,
                    self.runner.round_input(plan),
                    self.weights.read_tensors,
                    self.weights.swaps,
                    drafted if timed is not None or self.runner.timed_drafts else None,
                )
                finished += self._commit_round(plan, out, started, drafted_at[0])
            if self.scheduler.queue and len(self.scheduler.running) < self.max_batch_size:
                new = self._plan_admission()
                if new:
                    hits = self.scheduler.prefix_hits(new, self.weights.version)
                    prefill = self.runner.prefill(new, hits)
                    finished += self._commit_prefill(new, prefill, hits)
        if finished or self.scheduler.running:
            self._stats[self.weights.version].busy_seconds += time.perf_counter() - start
        return finished

    def _plan_round(self) -> StepPlan:
        """The scheduler grows every row into the blocks the round may write (preempting the
        latest admitted where the pool runs out); the controller and each row's budget set its k."""
        preempted: list[Sequence] = []
        runner = self.runner
        while (p := self.scheduler.reserve(runner.cache.lengths, [c.lengths for c in runner.draft_caches])) is not None:
            preempted += p.preempted
            kept = set(p.keep)
            for i, s in enumerate(self.scheduler.running):
                if i not in kept:
                    self._cache_blocks(i, s)  # a resumed row finds its own blocks while they stay
            self._keep_rows(p.keep)  # the rows kept, in their new places: reserve again (their needs fit now)
        seqs = self.scheduler.running
        controller = self.speculation.controller if any(s.speculation_auto for s in seqs) else None
        decision: SpeculationDecision | None = (
            controller.decide(len(seqs), self._tokens_left(seqs), [self._row_state(s) for s in seqs])
            if controller is not None
            else None
        )
        auto_k = decision.k if decision is not None else 0
        row_k = [
            min(auto_k if s.speculation_auto else s.k, s.params.max_new_tokens - len(s.output) - 1)
            if s.pending is not None
            else 0
            for s in seqs
        ]
        refresh = [s.num_pending if k else 0 for s, k in zip(seqs, row_k, strict=True)]
        lengths = list(runner.cache.lengths)
        measure = controller is not None and controller.union is not None and self._rounds % UNION_EVERY == 0
        self._rounds += 1
        return StepPlan(
            rows=list(seqs),
            preempted=preempted,
            row_k=row_k,
            refresh=refresh,
            lengths=lengths,
            decision=decision,
            record_routes=measure or any(s.routes != "off" for s in seqs),
        )

    def _commit_round(self, plan: StepPlan, out: RoundOutput, started: float, drafted_at: float) -> list[Sample]:
        """The round's packed result into the rows' tokens and counters, the statistics, the
        rows that end, the caches rolled back, and the controller's measurements."""
        packed = out.packed.tolist()  # the one host copy
        version = self.weights.version
        if self.drafter.vocab is not None:  # the reduced draft vocabulary counts what the policy emits
            self.drafter.observe(emitted_ids(plan, packed))
        done = commit_round(plan, out, packed, version, self.drafter.num_layers > 0)
        finished = [self._finish(s, reason) for s, reason in done.finished]
        decision = plan.decision
        controller = self.speculation.controller if decision is not None else None
        if controller is not None:
            for s, _ in done.finished:
                controller.observe_finished_row(*s.position_one())
        add_rounds(self._stats[version].counters, plan.row_k, done.num_accepted, done.emitted)
        self.runner.roll_back(plan.lengths, done.num_accepted, self.scheduler.pages)
        kept = set(done.keep)
        for i, s in enumerate(plan.rows):
            if i not in kept:
                self._cache_blocks(i, s)
        self._keep_rows(done.keep)
        if controller is not None and decision is not None:  # the controller learns from the steps it decided
            if out.routes is not None and controller.union is not None:
                controller.observe_expert_union(*verify_union(out.routes, plan.row_k, controller.union.experts))
            controller.observe_acceptance(*done.evidence)
            controller.observe_step(
                batch=len(plan.rows),
                k=plan.round_k,
                draft_seconds=drafted_at - started,
                step_seconds=self._clock() - started,
                tokens=done.emitted,
                chosen=plan.round_k == decision.k,
                catch_up=plan.round_k > 0 and max(plan.refresh) > self._last_round_k + 1,  # see CATCH_UP_POSITIONS
                ended=done.stopped,
                rows=done.ends,
            )
        self._last_round_k = plan.round_k
        return finished

    def _plan_admission(self) -> list[Sequence]:
        """The queued sequences the free rows and blocks hold now (`RowScheduler.admissible`), less
        any the pool no longer holds once automatic k refused them a draft."""
        new = self.scheduler.admissible()
        if not new:
            return []
        self.drafter.observe([t for s in new if not s.output for t in s.prompt])
        auto = [s for s in new if s.speculation_auto]  # rows that pin k are never refused a draft: not asked
        pinned = [s for s in new if not s.speculation_auto]
        running, controller = self.scheduler.running, self.speculation.controller
        if (
            auto
            and controller is not None
            and not controller.may_draft(
                len(running) + len(new),
                self._tokens_left([*running, *new]),
                [self._row_state(s) for s in [*running, *pinned, *auto]],
                joining=len(auto),  # the last rows
                prompt_tokens=_draft_prefill_saved(auto, pinned),
            )
        ):
            for s in auto:  # the controller has measured that this batch decodes best without a draft
                s.speculation_auto, s.k = False, 0
        self.scheduler.fit(new)  # drafting changed: sharing may have too
        return new

    def _commit_prefill(self, new: list[Sequence], prefill: Prefill, hits: list[list[int]]) -> list[Sample]:
        """A prefill's first tokens into the new rows; the draft's prefill; the rows that did not
        end join the batch: the scheduler's blocks (their prefix-cache hits among them), then the
        runner's caches."""
        stats = self._stats[self.weights.version]
        stats.prompt_tokens += sum(len(s.prompt) for s in new if not s.output)
        stats.prefill_tokens += sum(prefill.lengths) - sum(prefill.cached)
        stats.prefix_cache_hit_tokens += sum(prefill.cached)
        self.drafter.observe([int(row[0]) for row, s in zip(prefill.packed, new, strict=True) if not s.output])
        timer = (
            self.speculation.controller if any(s.speculation_auto for s in new) else None
        )  # learns what a refused draft saves
        timed = self.runner.prefill_draft(new, prefill, self._clock if timer is not None else None)
        if timer is not None and timed is not None:
            timer.observe_draft_prefill(*timed)
        done = commit_prefill(new, prefill, self.weights.version, self.drafter.num_layers > 0)
        add_rounds(stats.counters, [0] * done.emitted, [0] * done.emitted, done.emitted)
        finished = [self._finish(s, reason) for s, reason in done.finished]
        # a sequence that ended at its first token (a one-token turn) still leaves its prefix's
        # blocks for the next turn: one row per prefix joins, enters the cache and leaves at once
        ended: dict[tuple[int, bool], int] = {}
        if self.prefix_cache is not None:
            for i, (s, _) in zip([i for i in range(len(new)) if i not in set(done.keep)], done.finished, strict=True):
                ended.setdefault((prefill.source[i], self.scheduler.drafting(s)), i)
        rows = done.keep + list(ended.values())
        joined = set(rows)
        for i, h in enumerate(hits):
            if i not in joined:  # it ended at its prefill: the blocks it held go back
                self.scheduler.pages.release(h)
        if rows:
            seqs = [new[i] for i in rows]
            picked = [prefill.source[i] for i in rows]
            for s in seqs:
                s.kv_version, s.draft_gap = self.weights.version, False
            self.scheduler.add_rows(seqs, picked, prefill.lengths, [hits[i] for i in rows])
            self.runner.load(prefill, seqs, picked)
        if ended:
            first = len(self.scheduler.running) - len(ended)
            for row in range(first, len(self.scheduler.running)):
                self._cache_blocks(row, self.scheduler.running[row])
            self._keep_rows(list(range(first)))
        return finished

    def _cache_blocks(self, row: int, s: Sequence) -> None:
        """Row `row` leaves the batch: its blocks into the prefix cache (`RowScheduler.cache_row`)."""
        lengths = [c.lengths[row] for c in [self.runner.cache, *self.runner.draft_caches]]
        self.scheduler.cache_row(row, s, self.weights.version, lengths)

    @staticmethod
    def _row_state(s: Sequence) -> RowState:
        """What the controller knows of a row: its output length and the tokens it may still emit."""
        return RowState(len(s.output), left=s.params.max_new_tokens - len(s.output))

    def _tokens_left(self, seqs: list[Sequence]) -> int | None:
        """The most tokens a row may still emit, when no queued request waits for a finished
        row's place (None otherwise: the controller then maximises throughput, not the batch's end)."""
        if self.scheduler.queue or not seqs:
            return None
        return max(s.params.max_new_tokens - len(s.output) for s in seqs)

    # ---- scoring -----------------------------------------------------------------------------
    def score(self, request: ScoreRequest) -> list[list[float]]:
        """Teacher-forced log-probs with the plain full forward (`scoring.score`)."""
        return score(self.model, request)


def _draft_prefill_saved(auto: list[Sequence], pinned: list[Sequence]) -> int:
    """Draft prefill tokens that admitting the `auto` rows without a draft saves: their distinct
    prompts' positions, less those a drafting pinned row needs prefilled anyway."""
    needed = {tuple(s.prompt) for s in pinned if s.drafts}
    return sum(len(p) - 1 for p in {tuple(s.prompt) for s in auto} - needed)
