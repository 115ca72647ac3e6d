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
k chosen by `speculation.controller.SpeculationPolicy` from the engine's own measurements (seconds of
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import sidecar
from sidecar.engine.admission import REASONS, Admission
from sidecar.engine.base import Engine
from sidecar.engine.config import EngineConfig
from sidecar.engine.decode_round import RoundInput
from sidecar.engine.drafters import make_drafter
from sidecar.engine.round_graphs import FixedRounds, batch_bucket, make_rounds
from sidecar.engine.rows import (
    CATCH_UP_POSITIONS,
    REASON_STOP,
    BatchTensors,
    Pending,
    Sequence,
    add_rounds,
    cost_clock,
    gather_pending,
    sequence_seed,
    step_counters,
)
from sidecar.engine.sampling import (
    AcceptanceRule,
    rejection_sample,
)
from sidecar.engine.scoring import score
from sidecar.engine.served_weights import ServedWeights
from sidecar.engine.speculation_settings import SpeculationSettings
from sidecar.engine.validation import validate_request
from sidecar.engine.version_ledger import VersionLedger
from sidecar.errors import InvalidRequestError, KVCacheCapacityError
from sidecar.model.checkpoint import load_checkpoint
from sidecar.model.decode_kernels import DecodeKernels, DecodeOps
from sidecar.model.eagle3 import Eagle3Draft
from sidecar.model.eagle3_checkpoint import load_eagle3_draft
from sidecar.model.kv_pages import KVPages, blocks_for, pool_blocks
from sidecar.model.model import Qwen3WithMTP, build_model
from sidecar.speculation.config import RowState, SpeculationDecision, SpeculationPolicyConfig
from sidecar.speculation.controller import SpeculationPolicy
from sidecar.types import (
    EngineInfo,
    FinishReason,
    GenerationRequest,
    ModelInfo,
    Sample,
    SamplingParams,
    ScoreRequest,
    VersionStats,
)


class TorchEngine(Admission, ServedWeights, SpeculationSettings, Engine):
    """Embedded engine over a `Qwen3WithMTP`; see the module docstring."""

    def __init__(
        self,
        model: Qwen3WithMTP,
        config: EngineConfig | None = None,
        *,
        draft: Eagle3Draft | None = None,
        name: str = "",
        policy: SpeculationPolicyConfig | None = None,
        clock: Callable[[], float] | None = None,
        **settings: Any,
    ) -> None:
        """Serve `model` as `config` says (`EngineConfig`; its docstrings say what each setting
        does). `settings`: `EngineConfig` fields as keywords, over `config`'s (tools and tests write
        `TorchEngine(model, speculation_k=2)`); the config's own checks apply either way.

        `draft`: an EAGLE-3 draft for a target without MTP layers (`drafters`; `from_checkpoint`
        loads `config.draft`); `policy`: the controller's knobs (its max_speculation_k is set by
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
        max_speculation_k, max_batch_size, kv_block_size = (
            config.max_speculation_k,
            config.max_batch_size,
            config.kv_block_size,
        )
        self.model = model
        if model.output_weight().device.type == "cuda":
            model.join_projections()  # the decode path reads q|k|v and gate|up as they are: no copies
        self._acceptance_rule: AcceptanceRule = rejection_sample  # only `wrong_rules.with_acceptance_rule` changes it
        self.config = model.config
        self.device = model.output_weight().device
        self.name = name
        self.drafter = make_drafter(model, draft, config.draft_vocab_size)
        self.draft_vocab_size = 0 if self.drafter.vocab is None else config.draft_vocab_size
        self.num_mtp = self.drafter.num_layers  # draft layers (one KV cache each), of either kind
        self.max_speculation_k = max_speculation_k if self.num_mtp else 0
        context = self.config.max_position_embeddings
        self.max_context = context if config.max_context is None else config.max_context
        if not 2 <= self.max_context <= context:
            raise ValueError(f"max_context must be in [2, max_position_embeddings={context}], got {self.max_context}")
        self.max_batch_size = max_batch_size
        slots = self._slots_per_row()
        self._pages = KVPages(
            num_blocks=pool_blocks(
                budget=config.kv_cache_bytes,
                block_bytes=kv_block_size * self.drafter.token_bytes(),
                max_rows=max_batch_size,
                max_slots=slots,
                block_size=kv_block_size,
                device=self.device,
            ),
            block_size=kv_block_size,
            max_rows=max_batch_size,
            max_slots=slots,
            device=self.device,
        )
        # Without a draft speculation is unavailable: the default k is 0.
        self._k = min(config.speculation_k, self.max_speculation_k) if self.num_mtp else 0
        self._auto = False  # new requests that do not pin k get the controller's k
        self._policy_config = policy
        self._policy: SpeculationPolicy | None = None  # kept while auto rows may still run
        self._last_round_k = 0  # drafts of the previous decode step (a larger refresh is a catch-up)
        self.set_speculation_k(self._k)
        self._clock = clock or cost_clock(self.device)
        if config.speculation_auto:
            self.set_speculation_auto(self._k)
        self._version = 0
        self._stats = VersionLedger()
        self._queue: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._live: dict[str, int] = {}  # request id -> unfinished sequences
        self._cache = self.drafter.target_cache(0, slots, pages=self._pages)
        self._mtp_caches = [self.drafter.new_cache(0, slots, pages=self._pages) for _ in range(self.num_mtp)]
        self._admissions = 0  # sequences admitted so far (`Sequence.admitted`: preemption's order)
        self._preempted = False  # the latest round preempted rows (admission waits a step)
        self._batch: BatchTensors | None = None
        self._rounds = make_rounds(config.compile, self.device)
        self.kernels: DecodeOps = (
            DecodeKernels.for_device(self.device) if isinstance(self._rounds, FixedRounds) else DecodeOps()
        )
        """What this engine's cached forwards run (`decode_kernels`): fused Triton kernels with
        fixed-shape rounds on CUDA where Triton is installed, else torch's operators (the eager
        rounds of `compile: off` are the reference). Set on the model at every step: engines may
        share a model."""
        self._swaps = 0  # weight updates swapped in (`ServedWeights._swap_in`)
        self._timed_drafts = False  # rounds of pinned k as automatic k's (two graphs): `warm_up` in auto mode
        self._weights_checked: tuple[int, int] | None = None  # (swaps, decode-weight builds) last checked
        self.compile = config.compile

    def warm_up(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Run a fixed-shape round at every batch bucket, plainly and at the default k, before
        serving (in automatic k's form, two graphs a round, when the engine is in auto mode): on
        CUDA those shapes' graphs are captured here rather than in the first requests that meet
        them (longer contexts, other k and refresh widths are captured when they first occur). `progress(done, total)` after each shape; returns the graphs captured. The
        warm-up's requests pin k (the controller learns nothing from them) and its tokens leave no
        trace in the statistics. Nothing to do without fixed-shape rounds (`compile` off, or auto on
        a CPU)."""
        if not isinstance(self._rounds, FixedRounds):
            return 0
        if self.has_work():
            raise RuntimeError("warm_up runs before serving: the engine already has requests")
        buckets = sorted({batch_bucket(b, self.max_batch_size) for b in range(1, self.max_batch_size + 1)})
        shapes = [(b, k) for b in buckets for k in sorted({0, self._k})]
        before = self._rounds.captured
        # automatic k times the draft phase, so its rounds are two graphs, one a phase: those too
        self._timed_drafts = self._auto
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
            self._timed_drafts = False
        self._stats = VersionLedger()
        self._stats.serve(self._version)
        if self.drafter.vocab is not None:
            self.drafter.vocab.forget()  # nor in the reduced draft vocabulary's counts
        return self._rounds.captured - before

    def _slots_per_row(self) -> int:  # a row's context and the scratch columns a verify writes past it
        return self.max_context + self.max_speculation_k + 2

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
                vocab_size=c.vocab_size,
                hidden_size=c.hidden_size,
                num_layers=c.num_hidden_layers,
                max_position_embeddings=c.max_position_embeddings,
                rope_type=rope.rope_type,
                rope_factor=rope.factor,
                num_mtp_layers=c.num_nextn_predict_layers,
                dtype=c.torch_dtype,
                eos_token_ids=tuple(c.eos_token_id),
            ),
            engine="torch",
            engine_version=sidecar.__version__,
            device_kind=self.device.type,
            device_name=torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            speculation_method=self.drafter.name,
            speculation_k=self._k,
            max_speculation_k=self.max_speculation_k,
            speculation_status=self.speculation_status(),
        )

    @property
    def weight_version(self) -> int:
        return self._version

    def validate(self, request: GenerationRequest) -> None:
        validate_request(request, self.config, self.max_speculation_k)
        longest = max(len(p) for p in request.prompts) + request.sampling.max_new_tokens
        if longest > self.max_context:
            raise KVCacheCapacityError(
                f"a sequence of prompt + max_new_tokens = {longest} tokens does not fit a KV cache row of "
                f"max_context={self.max_context} tokens: shorten it, or serve with a larger max_context "
                "(and a KV budget that holds it)"
            )
        blocks = blocks_for(longest + self.max_speculation_k + 2, self._pages.block_size)
        if blocks > self._pages.usable:
            raise KVCacheCapacityError(
                f"a sequence of prompt + max_new_tokens = {longest} tokens needs {blocks} KV blocks of "
                f"{self._pages.block_size} tokens, the whole pool holds {self._pages.usable}: shorten it, or serve "
                "with a larger KV budget"
            )

    def num_queued(self) -> int:
        return len(self._queue)

    def num_running(self) -> int:
        return len(self._running)

    def stats(self) -> list[VersionStats]:
        return self._stats.recent()

    def earlier_stats(self) -> VersionStats:
        return self._stats.earlier

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> None:
        self.validate(request)
        if not request.request_id:
            raise InvalidRequestError("request_id is empty; the server assigns one before submit")
        if request.request_id in self._live:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already running; ids must be unique")
        k = self._k if request.speculation_k is None else request.speculation_k
        auto = request.speculation_k is None and self._auto and self._k > 0
        params = request.sampling
        if params.stop_at_eos and self.config.eos_token_id:
            # Resolved once here, so the per-token stop check stays a plain membership test.
            stops = tuple(dict.fromkeys((*params.stop_token_ids, *self.config.eos_token_id)))
            params = dataclasses.replace(params, stop_token_ids=stops)
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        for p, prompt in enumerate(request.prompts):
            for s in range(request.samples_per_prompt):
                self._queue.append(
                    Sequence(
                        request_id=request.request_id,
                        prompt_index=p,
                        sample_index=s,
                        prompt=list(prompt),
                        params=params,
                        k=k,
                        speculation_auto=auto,
                        seed=sequence_seed(seed, p, s),
                    )
                )
        self._live[request.request_id] = len(request.prompts) * request.samples_per_prompt

    def abort(self, request_id: str) -> list[Sample]:
        if request_id not in self._live:
            return []
        out = [s.to_sample(FinishReason.ABORT) for s in self._queue if s.request_id == request_id]
        self._queue = deque(s for s in self._queue if s.request_id != request_id)
        keep = [i for i, s in enumerate(self._running) if s.request_id != request_id]
        out += [s.to_sample(FinishReason.ABORT) for s in self._running if s.request_id == request_id]
        self._keep_rows(keep)
        del self._live[request_id]
        return out

    def _finish(self, seq: Sequence, reason: FinishReason) -> Sample:
        self._live[seq.request_id] -= 1
        if not self._live[seq.request_id]:
            del self._live[seq.request_id]
        sample = seq.to_sample(reason)
        stats = self._stats[self._version]
        stats.samples_finished += 1
        stats.samples_nonfinite += sample.nonfinite
        return sample

    def _keep_rows(self, keep: list[int]) -> None:
        """Keep the rows `keep`: each row that leaves has its place taken by a kept row from the
        end of the batch, so the block table changes one row per leaving row, not every row after
        it (the rows' order is free: a row's tokens do not depend on its batch)."""
        n = len(self._running)
        if keep == list(range(n)):
            return
        kept = set(keep)
        movers = iter([i for i in range(len(keep), n) if i in kept])
        keep = [i if i in kept else next(movers) for i in range(len(keep))]
        self._running = [self._running[i] for i in keep]
        self._cache.keep_rows(keep)
        for c in self._mtp_caches:
            c.keep_rows(keep)
        self._batch = None

    def _count(self, seq: Sequence, drafted: int, accepted: int, generated: int) -> None:
        step = step_counters(drafted, accepted, generated)
        seq.counters.add(step)
        self._stats[self._version].counters.add(step)

    # ---- the loop --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Sample]:
        start = time.perf_counter()
        finished: list[Sample] = []
        self.model.kernels = self.kernels
        with self.model.frozen_weights():
            if self._running:
                finished += self._decode()
            if self._queue and len(self._running) < self.max_batch_size:
                finished += self._admit()
        if finished or self._running:
            self._stats[self._version].busy_seconds += time.perf_counter() - start
        return finished

    def _decode(self) -> list[Sample]:
        """One speculative round (draft → verify → accept → roll back) for every running row.

        Device work apart from building the round's inputs; its result comes back in one packed
        host copy (`rows.round_outcome`)."""
        self._reserve_blocks()
        seqs = self._running
        b, dev = len(seqs), self.device
        if self._batch is None:
            self._batch = BatchTensors.of(seqs, dev)
        batch = self._batch
        started = self._clock()
        policy = self._policy if any(s.speculation_auto for s in seqs) else None
        decision: SpeculationDecision | None = (
            policy.decide(b, self._tokens_left(seqs), [self._row_state(s) for s in seqs])
            if policy is not None
            else None
        )
        auto_k = decision.k if decision is not None else 0
        row_k = [
            min(auto_k if s.speculation_auto else s.k, s.params.max_new_tokens - len(s.output) - 1)
            if s.pending is not None
            else 0
            for s in seqs
        ]
        round_k = max(row_k)
        host = torch.tensor(
            [[len(s.output), s.last_tokens(1)[0], k, len(s.prompt) - 1] for s, k in zip(seqs, row_k, strict=True)]
        ).to(dev)
        inp = RoundInput(
            out_len=host[:, 0],
            last=host[:, 1],
            num_draft=host[:, 2],
            next_position=host[:, 0] + host[:, 3],
            round_k=round_k,
            num_new=[k + 1 for k in row_k],
        )
        catch_up = False
        if round_k > 0:
            num_refresh = [s.num_pending if k else 0 for s, k in zip(seqs, row_k, strict=True)]
            width = max(num_refresh)
            catch_up = width > self._last_round_k + 1  # positions skipped by plain rounds (see CATCH_UP_POSITIONS)
            # MTP position t of each pending entry: they end at t = n - 2 (n = the row's length)
            ends = [s.length - 1 - n for s, n in zip(seqs, num_refresh, strict=True)]
            inp.refresh_tokens = torch.tensor(
                [s.last_tokens(n) + [0] * (width - n) for s, n in zip(seqs, num_refresh, strict=True)]
            ).to(dev)
            inp.refresh_hidden = gather_pending(seqs, num_refresh, width)
            inp.refresh_positions = (torch.tensor(ends)[:, None] + torch.arange(width)[None, :]).to(dev)
            inp.num_refresh = num_refresh
        drafted_at = started

        def drafted() -> None:  # the draft phase's cost, not its launch
            nonlocal drafted_at
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            drafted_at = self._clock()

        if round_k > 0:
            self.drafter.prepare()  # a reduced draft vocabulary: re-chosen when due, its rows current
        old_lengths = list(self._cache.lengths)
        moved = (self._swaps, self.model.decode_builds)  # weights move only by a push or a rebuild
        if isinstance(self._rounds, FixedRounds) and self._rounds.capture and moved != self._weights_checked:
            self._rounds.check_weights(self._read_tensors())
            self._weights_checked = moved
        out = self._rounds.run(
            self.drafter,
            self._cache,
            self._mtp_caches,
            batch,
            inp,
            self._acceptance_rule,
            drafted if policy is not None or self._timed_drafts else None,
        )
        packed = out.packed.tolist()  # the one host copy

        finished, keep = [], []
        emitted_total = ended = 0
        ends_: list[tuple[int, int, bool]] = []  # per row: output length before the step, emitted, stopped
        evidence: tuple[list[int], list[int]] = ([], [])  # per drafting row: drafts before its end, accepted
        width_out = round_k + 1
        num_accepted: list[int] = []
        if self.drafter.vocab is not None:  # the reduced draft vocabulary counts what the policy emits
            self.drafter.observe([int(t) for row in packed for t in row[: int(row[2 * width_out + 1])]])
        for i, s in enumerate(seqs):
            row = packed[i]
            a, n, reason = int(row[2 * width_out]), int(row[2 * width_out + 1]), int(row[2 * width_out + 2])
            num_accepted.append(a)
            before = len(s.output)
            s.extend(row[:n], row[width_out : width_out + n], self._version)
            add_rounds(s.counters, [row_k[i]], [a], n)
            if row_k[i]:  # an accepted stop token ends the row: the drafts after it say nothing
                evidence[0].append(min(row_k[i], n))
                evidence[1].append(min(a, n))
            emitted_total += n
            ends_.append((before, n, reason == REASON_STOP))
            if reason:
                ended += reason == REASON_STOP
                finished.append(self._finish(s, REASONS[reason]))
                if policy is not None:
                    policy.observe_finished_row(*s.position_one())
                continue
            if s.drafts and self.num_mtp and s.pending is not None:
                new_pending = Pending(base=out.hidden, row=i, start=0, count=a + 1)
                if row_k[i]:  # the round consumed the row's pending states
                    s.pending = [new_pending]
                else:  # a round without drafting: keep only the latest positions (see CATCH_UP_POSITIONS)
                    s.pending = [*s.pending, new_pending]
                    while len(s.pending) > 1 and s.num_pending - s.pending[0].count >= CATCH_UP_POSITIONS:
                        s.pending.pop(0)
            keep.append(i)
        add_rounds(self._stats[self._version].counters, row_k, num_accepted, emitted_total)
        self._cache.truncate([n + a + 1 for n, a in zip(old_lengths, num_accepted, strict=True)])
        reserve = self.max_speculation_k + 2  # what the next round writes: those blocks are kept
        for i in range(b):  # whole blocks of rejected drafts past that go back to the pool
            self._pages.trim(i, max(c.lengths[i] for c in [self._cache, *self._mtp_caches]) + reserve)
        self._keep_rows(keep)
        if policy is not None:  # the controller learns from the steps it decided
            policy.observe_acceptance(*evidence)
            policy.observe_step(
                batch=b,
                k=round_k,
                draft_seconds=drafted_at - started,
                step_seconds=self._clock() - started,
                tokens=emitted_total,
                chosen=round_k == auto_k,
                catch_up=catch_up,
                ended=ended,
                rows=ends_,
            )
        self._last_round_k = round_k
        return finished

    def _read_tensors(self) -> list[torch.Tensor]:
        """Every tensor a round's forwards read (a captured graph holds their addresses). Read after
        a push or a rebuild of the decode weights only: in between nothing here moves them (writes
        into parameters in place, and `DecodeWeights.refresh`, keep every address)."""
        fused = [t for w in self.model.decode_weights() for t in w.tensors()]
        return [
            *self.model.parameters(),
            *self.drafter.pushed_parameters().values(),
            *fused,
            *self.drafter.head_tensors(),
        ]

    @staticmethod
    def _row_state(s: Sequence) -> RowState:
        """What the controller knows of a row: its output length and the tokens it may still emit."""
        return RowState(len(s.output), left=s.params.max_new_tokens - len(s.output))

    def _tokens_left(self, seqs: list[Sequence]) -> int | None:
        """The most tokens a row may still emit, when no queued request waits for a finished
        row's place (None otherwise: the controller then maximises throughput, not the batch's end)."""
        if self._queue or not seqs:
            return None
        return max(s.params.max_new_tokens - len(s.output) for s in seqs)

    # ---- scoring -----------------------------------------------------------------------------
    def score(self, request: ScoreRequest) -> list[list[float]]:
        """Teacher-forced log-probs with the plain full forward (`scoring.score`)."""
        return score(self.model, request)
