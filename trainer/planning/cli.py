"""`specrl plan`: will speculation pay at this model size, batch and response length, on this hardware?

Why a command: users of every RL framework ask it before they spend GPU hours, and the answer
depends on inputs they can measure (or this project measures for them): the costs of a decode
round on their node (`specrl bench gpu`) or a published GPU profile, the acceptance per draft
position (a sidecar's GetStats, a run's metrics), the response lengths. The simulator is
`trainer.planning.step_model`; this module turns options into its inputs, refusing inconsistent
ones with what to fix.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import click

from sidecar.config_io import retired_option
from trainer.planning import inputs
from trainer.planning.cost_table import CostTableError, load_costs
from trainer.planning.experts import render_union, union_rows
from trainer.planning.hardware import profile
from trainer.planning.report import PAYS_MARGIN, PlanContext, as_json, render
from trainer.planning.roofline import DRAFT_KINDS, DraftShape, RooflineConfig, RooflineCosts
from trainer.planning.shapes import ModelShape, load_shape
from trainer.planning.step_model import (
    Acceptance,
    EngineSplit,
    LengthDistribution,
    Plan,
    RoundCosts,
    StepInputs,
    plan_step,
)

KV_MEMORY_FRACTION = 0.9
"""Of an engine's GPU memory, what weights and KV cache may use (the rest: activations, graphs)."""


@dataclass(kw_only=True, slots=True)
class PlanOptions:
    """Everything `specrl plan` takes (the click options, typed)."""

    model: str
    hardware: str | None = None
    costs: Path | None = None
    costs_table: str | None = None
    gpus_per_engine: int = 1
    engines: int = 1
    prompts: int = 64
    samples: int = 8
    prompt_tokens: int = 256
    max_new_tokens: int = 8192
    lengths: str | None = None
    lengths_from: Path | None = None
    acceptance: str | None = None
    acceptance_from: str | None = None
    spread: float = 0.0
    draft_kind: str = "eagle3"
    draft_vocab_size: int = 32000
    ngram_host_us: float = 0.0
    ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7)
    max_batch_size: int | None = None
    generation_share: float | None = None
    train_seconds: float | None = None
    train_ms_per_token: float | None = None
    sync_seconds: float = 0.0
    sync_gbps: float | None = None
    async_lag: int = 0
    memory_efficiency: float = 0.8
    compute_efficiency: float = 0.6
    forward_overhead_ms: float = 0.0
    replications: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "gpus_per_engine",
            "engines",
            "prompts",
            "samples",
            "prompt_tokens",
            "max_new_tokens",
            "replications",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.spread <= 1.0:
            raise ValueError(f"--spread must lie in [0, 1] (a relative standard deviation), got {self.spread}")


def _costs(opts: PlanOptions, shape: ModelShape, assumed: list[str]) -> RoundCosts:
    if (opts.hardware is None) == (opts.costs is None):
        raise click.UsageError(
            "give exactly one of --hardware NAME (a bundled GPU profile) or --costs FILE (a table measured "
            "by specrl bench gpu on your node)"
        )
    if opts.costs is not None:
        try:
            table = load_costs(opts.costs, opts.costs_table)
        except CostTableError as e:
            raise click.BadParameter(str(e), param_hint="--costs") from None
        assumed.append(
            "costs from the measured table (its draft is the engine's; --draft-kind and the efficiencies do not apply)"
        )
        return table
    assert opts.hardware is not None
    try:
        hw = profile(opts.hardware)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--hardware") from None
    try:
        cfg = RooflineConfig(
            memory_efficiency=opts.memory_efficiency,
            compute_efficiency=opts.compute_efficiency,
            forward_overhead_s=opts.forward_overhead_ms / 1e3,
            gpus=opts.gpus_per_engine,
            draft=DraftShape(
                kind=opts.draft_kind, vocab=opts.draft_vocab_size, host_s_per_row=opts.ngram_host_us / 1e6
            ),
        )
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    weights = shape.total_params * shape.weight_bytes_per_param
    memory = hw.memory_gb * 1e9 * opts.gpus_per_engine * KV_MEMORY_FRACTION
    if weights >= memory:
        need = math.ceil(weights / (hw.memory_gb * 1e9 * KV_MEMORY_FRACTION))
        raise click.UsageError(
            f"{shape.name} has {weights / 1e9:.0f} GB of bf16 weights; {opts.gpus_per_engine} x {hw.name} hold "
            f"{memory / 1e9:.0f} GB for weights and KV: raise --gpus-per-engine to at least {need + 1}"
        )
    assumed.append(
        f"{hw.name}: {hw.source}; achieved {opts.memory_efficiency:g} of the bandwidth and {opts.compute_efficiency:g} "
        f"of the peak; {opts.forward_overhead_ms:g} ms host time per forward"
    )
    if opts.draft_kind == "ngram":
        assumed.append(f"n-gram draft: no forward, {opts.ngram_host_us:g} us of host lookup per row and round")
    else:
        assumed.append(
            f"{opts.draft_kind} draft: one decoder layer"
            + (f", {opts.draft_vocab_size}-token head" if opts.draft_kind == "eagle3" else "")
        )
    return RooflineCosts(shape, hw, cfg)


def _lengths(opts: PlanOptions) -> LengthDistribution:
    if (opts.lengths is None) == (opts.lengths_from is None):
        raise click.UsageError(
            "give exactly one of --lengths ('1200', 'lognormal:mean=6000,cv=0.6', 'q0=3,q50=20,q100=40') or "
            "--lengths-from RUN_DIR"
        )
    try:
        dist = (
            inputs.parse_lengths(opts.lengths, opts.max_new_tokens)
            if opts.lengths is not None
            else inputs.lengths_from_run(opts.lengths_from)  # type: ignore[arg-type]
        )
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--lengths") from None
    if dist.max > opts.max_new_tokens:
        raise click.UsageError(
            f"response lengths reach {dist.max} tokens but --max-new-tokens is {opts.max_new_tokens}: raise it"
        )
    return dist


def _acceptance(opts: PlanOptions, ks: list[int]) -> Acceptance | None:
    if not any(ks):
        return None
    if (opts.acceptance is None) == (opts.acceptance_from is None):
        raise click.UsageError(
            "give exactly one of --acceptance ('0.8,0.7,0.6' per position, or 'tau=2.47@3') or --acceptance-from "
            "RUN_DIR|HOST:PORT (a run's metrics or a sidecar's GetStats)"
        )
    try:
        if opts.acceptance is not None:
            return inputs.parse_acceptance(opts.acceptance, opts.spread)
        src = opts.acceptance_from
        assert src is not None
        if Path(src).is_dir():
            return inputs.acceptance_from_run(Path(src), opts.spread)
        return inputs.acceptance_from_sidecar(src, opts.spread)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--acceptance") from None


def _max_batch(
    opts: PlanOptions, costs: RoundCosts, shape: ModelShape, lengths: LengthDistribution, rows: int
) -> tuple[int, str]:
    if opts.max_batch_size is not None:
        if opts.max_batch_size < 1:
            raise click.BadParameter(f"must be >= 1, got {opts.max_batch_size}", param_hint="--max-batch-size")
        return opts.max_batch_size, f"{opts.max_batch_size} rows decode at once per engine (given)"
    if not isinstance(costs, RooflineCosts):
        return rows, "every row of an engine decodes at once (no --max-batch-size given)"
    hw = costs.hw
    budget = hw.memory_gb * 1e9 * opts.gpus_per_engine * KV_MEMORY_FRACTION - shape.total_params * 2
    values = [float(v) for v in lengths.values]
    mean = sum(values) / len(values)
    live_context = opts.prompt_tokens + sum(v * v for v in values) / len(values) / (2 * mean)
    slots = int(budget // (shape.kv_bytes_per_token * live_context))
    if slots < 1:
        raise click.UsageError(
            f"one row's KV cache (~{live_context:.0f} tokens x {shape.kv_bytes_per_token / 1e3:.0f} kB) does not fit "
            f"beside the weights on {opts.gpus_per_engine} x {hw.name}: raise --gpus-per-engine"
        )
    return min(slots, rows), (
        f"{min(slots, rows)} rows decode at once per engine: the KV cache that fits in {KV_MEMORY_FRACTION:g} of "
        f"{opts.gpus_per_engine} x {hw.memory_gb:g} GB beside the weights, at a live row's mean context of "
        f"~{live_context:.0f} tokens (set --max-batch-size to override)"
    )


def _rest(opts: PlanOptions, shape: ModelShape, lengths: LengthDistribution) -> tuple[StepInputs | float, str]:
    """The non-generation phases: a generation share, seconds per step, or milliseconds per token;
    weight sync as latency plus the model's bf16 bytes over a bandwidth."""
    given = [opts.generation_share is not None, opts.train_seconds is not None, opts.train_ms_per_token is not None]
    if sum(given) > 1:
        raise click.UsageError("give one of --generation-share, --train-seconds or --train-ms-per-token")
    if opts.sync_gbps is not None and opts.sync_gbps <= 0:
        raise click.BadParameter(f"must be > 0, got {opts.sync_gbps}", param_hint="--sync-gbps")
    if opts.sync_seconds < 0:
        raise click.BadParameter(f"must be >= 0, got {opts.sync_seconds}", param_hint="--sync-seconds")
    sync = opts.sync_seconds
    sync_text = f"weight sync {sync:g} s"
    if opts.sync_gbps is not None:
        nbytes = shape.total_params * shape.weight_bytes_per_param
        sync += nbytes / (opts.sync_gbps * 1e9)
        sync_text = (
            f"weight sync {sync:.3g} s ({nbytes / 1e9:.1f} GB at {opts.sync_gbps:g} GB/s + {opts.sync_seconds:g} s)"
        )
    if opts.train_seconds is not None or opts.train_ms_per_token is not None:
        if (opts.train_seconds or 0) < 0 or (opts.train_ms_per_token or 0) < 0:
            raise click.UsageError("training time must be >= 0")
        if opts.train_ms_per_token is not None:
            tokens = opts.prompts * opts.samples * (opts.prompt_tokens + lengths.mean)
            train = opts.train_ms_per_token / 1e3 * tokens
            what = f"log-probs + training {opts.train_ms_per_token:g} ms/token x {tokens:.3g} tokens = {train:.3g} s"
        else:
            train = float(opts.train_seconds)  # type: ignore[arg-type]
            what = f"log-probs + training {train:g} s"
        return StepInputs(train_seconds=train, weight_sync_seconds=sync), f"{what}, {sync_text} per step (given)"
    if opts.sync_gbps is not None or opts.sync_seconds:
        raise click.UsageError(
            "a generation share already includes the weight sync in the rest of the step; give --sync-* "
            "with --train-seconds or --train-ms-per-token"
        )
    share = 0.7 if opts.generation_share is None else opts.generation_share
    if not 0 < share <= 1:
        raise click.BadParameter(f"a share lies in (0, 1], got {share}", param_hint="--generation-share")
    text = f"plain generation is {share:.0%} of a synchronous plain step" + (
        " (assumed: the reference study's 65-72%; set --generation-share, --train-seconds or --train-ms-per-token)"
        if opts.generation_share is None
        else " (given)"
    )
    return share, text


def make_plan(opts: PlanOptions) -> tuple[Plan, PlanContext]:
    """The plan and its context from the options; a click error says what to fix."""
    try:
        shape = load_shape(opts.model)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--model") from None
    ks = sorted({0, *opts.ks})
    if min(ks) < 0 or max(ks) > 16:
        raise click.BadParameter(f"draft lengths must lie in 0..16, got {list(opts.ks)}", param_hint="--ks")
    if opts.engines > opts.prompts:
        raise click.UsageError(
            f"--engines {opts.engines} > --prompts {opts.prompts}: each prompt's samples go to one engine, so "
            f"{opts.engines - opts.prompts} engines would idle; lower --engines or raise --prompts"
        )
    if opts.async_lag < 0:
        raise click.BadParameter(f"must be >= 0, got {opts.async_lag}", param_hint="--async-lag")
    assumed: list[str] = []
    costs = _costs(opts, shape, assumed)
    lengths = _lengths(opts)
    acceptance = _acceptance(opts, ks)
    if acceptance is not None and max(ks) > len(acceptance.alphas):
        assumed.append(
            f"draft positions beyond {len(acceptance.alphas)} keep the last given acceptance "
            f"({acceptance.alphas[-1]:.2f})"
        )
    rows = math.ceil(opts.prompts / opts.engines) * opts.samples
    max_batch_size, batch_note = _max_batch(opts, costs, shape, lengths, rows)
    assumed.append(batch_note)
    fleet = EngineSplit(
        prompts=opts.prompts,
        samples_per_prompt=opts.samples,
        engines=opts.engines,
        max_batch_size=max_batch_size,
        prompt_tokens=opts.prompt_tokens,
    )
    rest, rest_text = _rest(opts, shape, lengths)
    plan = plan_step(fleet, lengths, acceptance, ks, costs, rest, opts.async_lag, opts.replications, opts.seed)
    ctx = PlanContext(
        model=f"{shape.name} ({shape.total_params / 1e9:.1f}B parameters, {shape.active_params / 1e9:.1f}B active per token)",
        costs=costs.description,
        fleet=fleet,
        lengths=lengths,
        acceptance=acceptance,
        rest=rest_text,
        assumptions=assumed,
        left_out=costs.leaves_out(),
        experts=_experts(shape, costs, acceptance, plan, opts, lengths, max_batch_size),
    )
    return plan, ctx


def _experts(
    shape: ModelShape,
    costs: RoundCosts,
    acceptance: Acceptance | None,
    plan: Plan,
    opts: PlanOptions,
    lengths: LengthDistribution,
    max_batch_size: int,
) -> list[str]:
    """For a mixture of experts: the experts a round reads by batch and where speculation pays
    (`experts`), at the plan's best k > 0 (or the largest planned); empty for a dense model."""
    drafting = [p for p in plan.ks if p.k]
    if not shape.experts or acceptance is None or not drafting:
        return []
    k = min(drafting, key=lambda p: (p.step, p.k)).k
    kv_per_row = opts.prompt_tokens + lengths.mean / 2
    rows = union_rows(shape, costs, acceptance, k, kv_per_row, max(max_batch_size, 1))
    return render_union(shape, rows, k, acceptance.tau(k), PAYS_MARGIN)


@click.command("plan")
@click.option(
    "--model",
    required=True,
    help="Preset (qwen3-0.6b, qwen3-8b, qwen3-30b-a3b, qwen3-235b-a22b), config.json or its directory, or a size (70b).",
)
@click.option("--hardware", help="Bundled GPU profile: h100, h200, b200, gb200, a100, l40s, h20.")
@click.option(
    "--costs",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Cost table measured on your node (specrl bench gpu).",
)
@click.option("--costs-table", help="Which table of a --costs file holding several.")
@click.option(
    "--gpus-per-engine", type=int, default=1, show_default=True, help="GPUs one rollout engine spans (roofline)."
)
@click.option("--engines", type=int, default=1, show_default=True, help="Rollout engines sharing a step's prompts.")
@click.option("--prompts", type=int, default=64, show_default=True, help="Prompts per RL step.")
@click.option("--samples", type=int, default=8, show_default=True, help="Samples per prompt (G).")
@click.option("--prompt-tokens", type=int, default=256, show_default=True)
@click.option("--max-new-tokens", type=int, default=8192, show_default=True)
@click.option("--lengths", help="Response lengths: '1200', 'lognormal:mean=6000,cv=0.6', 'q0=3,q50=20,q100=40'.")
@click.option(
    "--lengths-from",
    type=click.Path(file_okay=False, path_type=Path),
    help="A run directory (its logged length percentiles).",
)
@click.option(
    "--acceptance", help="Acceptance per draft position given the ones before ('0.8,0.7,0.6') or 'tau=2.47@3'."
)
@click.option("--acceptance-from", help="A run directory (spec/accept_pos*) or a sidecar HOST:PORT (GetStats).")
@click.option("--spread", type=float, default=0.0, show_default=True, help="Relative sd of a row's acceptance.")
@click.option(
    "--draft-kind", type=click.Choice(DRAFT_KINDS), default="eagle3", show_default=True, help="Draft kind (roofline)."
)
@click.option("--draft-vocab-size", type=int, default=32000, show_default=True, help="EAGLE-3 draft head size.")
@retired_option("--draft", "--draft-kind")
@retired_option("--draft-vocab", "--draft-vocab-size")  # glossary: refused here
@click.option("--ngram-host-us", type=float, default=0.0, show_default=True, help="n-gram lookup us per row and round.")
@click.option(
    "--ks", default="1,2,3,4,5,6,7", show_default=True, help="Draft lengths to plan (plain is always included)."
)
@click.option(
    "--max-batch-size", type=int, help="Rows decoding at once per engine (default: what fits in memory / all)."
)
@retired_option("--max-batch", "--max-batch-size")  # glossary: refused here
@click.option(
    "--generation-share", type=float, help="Plain generation's share of a synchronous plain step (default 0.7)."
)
@click.option("--train-seconds", type=float, help="Log-probs + training seconds per step (instead of a share).")
@click.option(
    "--train-ms-per-token", type=float, help="Log-probs + training ms per token of the batch (prompt + response)."
)
@click.option("--sync-seconds", type=float, default=0.0, show_default=True, help="Weight sync latency per step (s).")
@click.option("--sync-gbps", type=float, help="Weight sync bandwidth (GB/s): adds the model's bf16 bytes over it.")
@click.option(
    "--async-lag", type=int, default=0, show_default=True, help="Policy lag of asynchronous RL (0: synchronous)."
)
@click.option("--memory-efficiency", type=float, default=0.8, show_default=True)
@click.option("--compute-efficiency", type=float, default=0.6, show_default=True)
@click.option(
    "--forward-overhead-ms", type=float, default=0.0, show_default=True, help="Host time per forward (roofline)."
)
@click.option("--replications", type=int, default=64, show_default=True, help="Simulated generations per k.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--plot", type=click.Path(dir_okay=False, path_type=Path), help="Also draw speedup against batch size and k (PNG)."
)
@click.option(
    "--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Also write the plan as JSON."
)
def plan(plot: Path | None, json_out: Path | None, ks: str, **kwargs: object) -> None:
    """Predict generation and RL step time per draft length k, and whether speculation pays."""
    try:
        parsed = tuple(int(k) for k in ks.split(","))
    except ValueError:
        raise click.BadParameter(f"comma-separated integers, got {ks!r}", param_hint="--ks") from None
    try:
        opts = PlanOptions(ks=parsed, **kwargs)  # type: ignore[arg-type]
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    result, ctx = make_plan(opts)
    click.echo(render(result, ctx))
    if json_out is not None:
        json_out.write_text(json.dumps(as_json(result, ctx), indent=2))
        click.echo(f"\nwrote {json_out}")
    if plot is not None:
        from trainer.planning.plot import BATCHES, plot_speedup

        if ctx.acceptance is None:
            raise click.UsageError("--plot needs an acceptance (plan at least one k > 0)")
        costs = _costs(opts, load_shape(opts.model), [])
        work = ctx.fleet.workload(ctx.lengths)
        batches = [b for b in BATCHES if b < ctx.fleet.max_batch_size] + [
            ctx.fleet.max_batch_size
        ]  # what fits in memory
        ks_drawn = [k for k in sorted(set(parsed)) if k > 0]
        plot_speedup(plot, work, ctx.acceptance, ks_drawn, costs, f"{ctx.model}\n{ctx.costs}", batches)
        click.echo(f"wrote {plot}")
