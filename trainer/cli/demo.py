"""`specrl demo`: the whole product on a laptop-sized problem, in minutes on a 2-core CPU.

1. make a small model (character tokenizer; deep-and-narrow so that a one-layer draft is cheap
   against the 24-layer target, which is what lets speculation win on a CPU),
2. supervised warm-up on the synthetic "zero" arithmetic task, so the policy earns reward, but
   short (about half the held-out problems right) so that RL has room to show learning,
3. in-domain draft initialisation on the policy's own completions,
4. two local `specrl serve` sidecars, RL steps with speculation (k = 3), a plain-decoding pass
   per step on the same prompts and weights to measure the speedup side by side,
5. the report: held-out reward before, during and after RL with its standard error, acceptance
   length per step, generation and step speedup against plain decoding.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from sidecar.model.model import ModelConfig
from trainer.rl.config import demo_config
from trainer.rl.loop import train
from trainer.rl.tasks import ArithmeticTask
from trainer.rl.warmup import (
    DraftInitConfig,
    Progress,
    WarmupConfig,
    acceptance_length,
    draft_init,
    make_model,
    supervised_warmup,
)
from trainer.tokenizer import CharTokenizer


def demo_model_config(layers: int = 12) -> ModelConfig:
    """vocab 99 (CharTokenizer), hidden 128, `layers` layers (12: ~2.4M parameters), one MTP layer."""
    return ModelConfig.tiny(
        vocab_size=CharTokenizer().vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        num_nextn_predict_layers=1,
    )


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    """Sizes of the demo's phases (defaults fit ~5 minutes on a free 2-core CPU)."""

    warmup: WarmupConfig = field(default_factory=lambda: WarmupConfig(steps=100, batch_size=32, lr=3e-3))
    """100 steps leave headroom for RL: held-out greedy reward ~0.5 (80 steps: 0.35, 120: 0.72,
    where RL had little left to show), ~0.35 sampled at temperature 1."""
    draft_init: DraftInitConfig = field(
        default_factory=lambda: DraftInitConfig(prompts=512, steps=120, lr=3e-3, chain_depth=4)
    )
    layers: int = 24
    """Target depth: the draft is one layer, so a deeper target makes drafting relatively cheaper."""
    rl_steps: int = 20
    """RL steps of `demo_config`'s 64 samples each (the held-out reward is evaluated before the first
    step, every `demo_config().eval_every` steps and after the last)."""
    acceptance_prompts: int = 32


@dataclass(kw_only=True, slots=True)
class DemoReport:
    tau_untrained_draft: float
    tau_initialised_draft: float
    eval_reward_before: float
    eval_reward_after: float
    eval_stderr_before: float
    eval_stderr_after: float
    eval_size: int
    eval_curve: list[tuple[int, float, float]]
    """(step, held-out reward, its standard error) at every evaluation."""
    steps: list[dict[str, float]]
    seconds: dict[str, float]

    def render(self) -> str:
        lines = ["", "specrl demo — report", ""]
        lines.append(
            f"draft acceptance length τ at k=3 (held-out prompts): untrained {self.tau_untrained_draft:.2f} "
            f"→ in-domain initialised {self.tau_initialised_draft:.2f}"
        )
        change = self.eval_reward_after - self.eval_reward_before
        se = math.hypot(self.eval_stderr_before, self.eval_stderr_after)
        verdict = (
            "an improvement beyond 2 standard errors"
            if change > 2 * se
            else "a worsening beyond 2 standard errors"
            if change < -2 * se
            else "within 2 standard errors: not distinguishable from noise"
        )
        lines.append(
            f"held-out reward (greedy, {self.eval_size} problems): before RL {self.eval_reward_before:.3f} "
            f"± {self.eval_stderr_before:.3f} → after RL {self.eval_reward_after:.3f} ± {self.eval_stderr_after:.3f} "
            f"(change {change:+.3f} ± {se:.3f}: {verdict})"
        )
        lines.append(
            "held-out reward by RL step: " + ", ".join(f"{step}: {m:.3f} ± {se:.3f}" for step, m, se in self.eval_curve)
        )
        lines.append("")
        lines.append("step  reward  τ     accept  gen spec s  gen plain s  gen speedup  step s  step speedup")
        for i, m in enumerate(self.steps, 1):
            lines.append(
                f"{i:>4}  {m['reward/train_mean']:.3f}  {m['spec/acceptance_length']:.2f}  "
                f"{m['spec/acceptance_rate']:.2f}    {m['time/generation']:>8.2f}  {m['time/generation_plain']:>11.2f}  "
                f"{m['speedup/generation']:>10.2f}x  {m['time/step']:>6.2f}  {m['speedup/step']:>11.2f}x"
            )
        gen = statistics.median(m["speedup/generation"] for m in self.steps)
        step = statistics.median(m["speedup/step"] for m in self.steps)
        lines.append("")
        lines.append(f"median generation speedup from speculation: {gen:.2f}x; median RL step speedup: {step:.2f}x")
        lines.append("phase seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in self.seconds.items()))
        return "\n".join(lines)


def run_demo(out: Path, cfg: DemoConfig | None = None, progress: Progress | None = None) -> DemoReport:
    """Run all phases under `out` (checkpoints, the RL run directory) and return the report."""
    cfg = cfg or DemoConfig()
    out = Path(out)
    task, tok = ArithmeticTask(regime="zero", digits=2), CharTokenizer()
    seconds: dict[str, float] = {}

    t = time.perf_counter()
    make_model(out / "init", demo_model_config(cfg.layers), seed=0)
    supervised_warmup(out / "init", out / "warm", task, tok, cfg.warmup, progress)
    seconds["warm-up"] = time.perf_counter() - t

    t = time.perf_counter()
    draft_init(out / "warm", out / "policy", task, tok, cfg.draft_init, progress)
    seconds["draft-init"] = time.perf_counter() - t

    rng = random.Random(99)
    prompts = [tok.encode(task.sample(rng, "eval").prompt) for _ in range(cfg.acceptance_prompts)]
    kw = {"k": 3, "temperature": 1.0, "max_new_tokens": 40, "stop": tok.eos_id}
    tau_before = acceptance_length(out / "warm", prompts, **kw)  # type: ignore[arg-type]
    tau_after = acceptance_length(out / "policy", prompts, **kw)  # type: ignore[arg-type]

    t = time.perf_counter()
    rl = demo_config(out / "policy", out / "run")
    rl.steps = cfg.rl_steps
    steps = train(rl, progress=progress is not None)
    seconds["RL"] = time.perf_counter() - t
    rows = [r for r in _read_metrics(out / "run") if "reward/eval_mean" in r]
    return DemoReport(
        tau_untrained_draft=tau_before,
        tau_initialised_draft=tau_after,
        eval_reward_before=rows[0]["reward/eval_mean"],
        eval_reward_after=rows[-1]["reward/eval_mean"],
        eval_stderr_before=rows[0]["reward/eval_stderr"],
        eval_stderr_after=rows[-1]["reward/eval_stderr"],
        eval_size=rl.eval_size,
        eval_curve=[(int(r["step"]), r["reward/eval_mean"], r["reward/eval_stderr"]) for r in rows],
        steps=steps,
        seconds=seconds,
    )


def _read_metrics(run_dir: Path) -> list[dict[str, float]]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
