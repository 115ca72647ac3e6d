"""How a plan is told: per k the predicted generation and step time, speedups over plain, the
recommended k, whether speculation pays, what was assumed and what the model leaves out.

Why: a prediction a user acts on must carry its inputs and its blind spots with it; the same
text goes to the terminal and, as JSON, to a file a later run can be compared against.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from trainer.planning.step_model import LEFT_OUT, Acceptance, EngineSplit, LengthDistribution, Plan

PAYS_MARGIN = 0.03
"""A k > 0 'pays' when it predicts at least this much faster than plain; a closer call is not a
gain anyone could measure (BENCHMARKS.md, "Planning: `specrl plan`": the model's median errors
per k are 3-13% against the engine's measured generations)."""


@dataclass(kw_only=True, slots=True)
class PlanContext:
    """What a plan was computed from, for the report."""

    model: str
    costs: str
    fleet: EngineSplit
    lengths: LengthDistribution
    acceptance: Acceptance | None
    rest: str
    assumptions: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)
    """A mixture of experts: the union table's lines (`experts.render_union`); empty for a dense model."""


def verdict(plan: Plan) -> tuple[int, str]:
    """The recommended k and one sentence on whether speculation pays."""
    key = "exposed_generation" if plan.lag else "step"
    base = getattr(plan.plain, key)
    best = min(plan.ks, key=lambda p: (getattr(p, key), p.k))
    gain = base / getattr(best, key) - 1.0 if getattr(best, key) > 0 else 0.0
    what = "exposed generation" if plan.lag else "step"
    if best.k == 0 or gain < PAYS_MARGIN:
        runner = min((p for p in plan.ks if p.k), key=lambda p: getattr(p, key), default=None)
        if runner is None:
            return 0, "plain decoding only was planned"
        loss = getattr(runner, key) / base
        return 0, (
            f"speculation does not pay: the best k > 0 (k = {runner.k}) predicts a {what} of "
            f"{loss:.2f}x plain's (needs < {1 - PAYS_MARGIN:.2f}x to pay beyond the model's error)"
        )
    return best.k, (
        f"speculation pays: k = {best.k} predicts {best.generation_speedup:.2f}x generation and "
        f"{best.step_speedup:.2f}x {'per step' if not plan.lag else 'per step at lag ' + str(plan.lag)}"
    )


def render(plan: Plan, ctx: PlanContext) -> str:
    fl, lengths = ctx.fleet, ctx.lengths
    lines = [f"specrl plan: {ctx.model}", f"costs: {ctx.costs}"]
    lines.append(
        f"workload: {fl.prompts} prompts x {fl.samples_per_prompt} samples over {fl.engines} engine(s): "
        f"{fl.rows_per_engine} rows on the busiest, {fl.max_batch_size} decoding at once; prompt {fl.prompt_tokens} tokens; "
        f"response lengths {lengths.label or 'given'} (mean {lengths.mean:.0f}, max {lengths.max})"
    )
    if ctx.acceptance is not None:
        a = ctx.acceptance
        shown = "/".join(f"{x:.2f}" for x in a.alphas)
        lines.append(
            f"acceptance per draft position (given the ones before): {shown}"
            + (f", row spread {a.spread:g}" if a.spread else "")
        )
    lines.append(f"rest of the step: {ctx.rest}")
    lines.append("")
    exposed = " | exposed gen s" if plan.lag else ""
    lines.append(f"| k | tau | rows/round | generation s | gen x plain | step s | step x plain{exposed} |")
    lines.append("|---|---|---|---|---|---|---|" + ("---|" if plan.lag else ""))
    for p in plan.ks:
        row = (
            f"| {p.k} | {p.tau:.2f} | {p.mean_batch:.1f} | {p.generation:.4g} | {p.generation_speedup:.2f}x | "
            f"{p.step:.4g} | {p.step_speedup:.2f}x |"
        )
        if plan.lag:
            row += f" {p.exposed_generation:.4g} |"
        lines.append(row)
    k, sentence = verdict(plan)
    lines.append("")
    lines.append(f"recommended k = {k}: {sentence}")
    if plan.lag:
        lines.append(
            f"async RL at policy lag {plan.lag}: step and exposed generation (the part of generation the "
            "trainer waits for) from a pipeline of steps; speedups against plain at the same lag"
        )
    if ctx.experts:
        lines.append("")
        lines += ctx.experts
    if ctx.assumptions:
        lines.append("")
        lines.append("assumed:")
        lines += [f"  - {a}" for a in ctx.assumptions]
    lines.append("")
    lines.append("left out of the model:")
    lines += [f"  - {x}" for x in [*ctx.left_out, *LEFT_OUT]]
    return "\n".join(lines)


def as_json(plan: Plan, ctx: PlanContext) -> dict[str, Any]:
    k, sentence = verdict(plan)
    return {
        "model": ctx.model,
        "costs": ctx.costs,
        "fleet": asdict(ctx.fleet),
        "rows_per_engine": ctx.fleet.rows_per_engine,
        "lengths": {"label": ctx.lengths.label, "mean": ctx.lengths.mean, "max": ctx.lengths.max},
        "acceptance": list(ctx.acceptance.alphas) if ctx.acceptance else None,
        "lag": plan.lag,
        "ks": [asdict(p) for p in plan.ks],
        "recommended_k": k,
        "verdict": sentence,
        "assumed": ctx.assumptions,
        "left_out": [*ctx.left_out, *LEFT_OUT],
    }
