"""RL on a tiny Qwen3-MoE learns: the held-out reward of the arithmetic task rises, with speculation
and routing replay on, and learns equivalently with speculation off.

The policy is transformers' `save_pretrained` of a random `Qwen3MoeForCausalLM` (8 experts, top 2,
the first layer dense) sized to the character tokenizer, warmed up part of the way on the
arithmetic task's reference solutions (`supervised_warmup`), its MTP draft grafted and fitted on
its own completions (`draft_init`), then 20 RL steps (8 prompts x 8 samples, temperature 1) with
`algorithm.routing_replay=rollout`, as `tests/trainer/rl/test_multi_turn_rl.py` does for a dense model.

Registered before any run (2026-12-02), not changed after:

- Learning (`test_rl_on_an_moe_raises_the_held_out_reward`): seeds 0 and 1 (the seed of the
  checkpoint, the warm-up, the draft fit and the RL run alike), speculation_k 3. Pass: the held-out
  reward (greedy, 128 problems fixed by the seed) after step 20 minus before step 1 exceeds 2
  standard errors of the difference, sqrt(se_before² + se_after²). Every step: τ
  (`spec/acceptance_length`) > 1, `train/routing_agreement` > 0.99 (float32 routers at equal
  weights), `mismatch/logprob_abs_max` < 1e-4 (the sidecar's log-probs are the trainer's); the
  gap's mean and p99 are logged.
- Equivalence (`test_an_moe_learns_equivalently_without_speculation`): the project's criterion for
  dense models (BENCHMARKS.md, "Learning with and without speculation"; `trainer.rl.equivalence`): a
  paired TOST of the final held-out reward, speculation_k 3 minus speculation_k 0 on the same seed
  (same checkpoint, prompts and held-out problems), margin ±0.05, α = 0.05 each side, over seeds 0
  and 1. Two seeds are what two shared CPU cores allow; with one degree of freedom the 90% interval
  is ±6.3 sd/√2 wide, so this test declares equivalence only when both seeds' differences are
  nearly equal and small: it is underpowered, and a failure to declare equivalence here is not
  evidence of a difference (the dense comparison used 24 seeds). Both arms must also learn (the
  criterion above).

A larger comparison, registered (2026-12-02 04:24 UTC) after the two-seed runs and before any of its
own: seeds 100-111 (12, none used before), both arms, the same runs and the same TOST (margin ±0.05,
α = 0.05 each side, one look after all 24 runs, no seed added or dropped), by
`specrl bench moe-trainer --learning OUT --seeds 100 ... 111`; reported in docs/moe.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from muon import HybridOptimizerConfig
from tests.family_fixtures import randomise
from trainer.policy.losses import GRPOConfig
from trainer.rl.config import RLConfig, RolloutConfig, SidecarsConfig, TaskConfig
from trainer.rl.equivalence import tost_paired
from trainer.rl.loop import train
from trainer.rl.tasks import ArithmeticTask
from trainer.tokenizer import CharTokenizer

SEEDS = (0, 1)
MARGIN = 0.05  # the dense comparison's margin, BENCHMARKS.md
SHAPE = dict(hidden_size=64, intermediate_size=192, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
             norm_topk_prob=True, mlp_only_layers=[0], num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128)  # fmt: skip


def moe_policy(root: Path, seed: int) -> Path:
    """The warmed-up MoE policy with its fitted MTP draft, written once per seed under `root`."""
    from trainer.rl.warmup import DraftInitConfig, WarmupConfig, draft_init, supervised_warmup

    out = root / f"policy{seed}"
    if (out / "config.json").exists():
        return out
    tok = CharTokenizer()
    task = ArithmeticTask(regime="zero", digits=2)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, **SHAPE)
    )
    randomise(model, seed)
    model.save_pretrained(root / f"hf{seed}")
    warm = WarmupConfig(steps=100, batch_size=32, lr=3e-3, seed=seed)
    supervised_warmup(root / f"hf{seed}", root / f"warm{seed}", task, tok, warm)
    fit = DraftInitConfig(prompts=256, steps=80, lr=3e-3, max_new_tokens=24, chain_depth=3, seed=seed)
    draft_init(root / f"warm{seed}", out, task, tok, fit)
    return out


_RUNS: dict[tuple[Path, int, int], dict[str, Any]] = {}


def rl_run(root: Path, seed: int, speculation_k: int) -> dict[str, Any]:
    """20 RL steps with routing replay; the held-out reward before and after and every step's metrics
    (run once per seed and k in a session: the equivalence test reuses the learning test's runs)."""
    if (root, seed, speculation_k) in _RUNS:
        return _RUNS[root, seed, speculation_k]
    run_dir = root / f"run{seed}_k{speculation_k}"
    cfg = RLConfig(
        model=moe_policy(root, seed),
        task=TaskConfig(kind="arithmetic", regime="zero", digits=2),
        rollout=RolloutConfig(
            prompts_per_step=8, samples_per_prompt=8, temperature=1.0, max_new_tokens=24, speculation_k=speculation_k
        ),
        algorithm=GRPOConfig(routing_replay="rollout"),
        optimizer=HybridOptimizerConfig(lr=3e-4),
        sidecars=SidecarsConfig(local=1),
        steps=20,
        eval_every=20,
        eval_size=128,
        seed=seed,
        run_dir=run_dir,
    )
    history = train(cfg, progress=False)
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    _RUNS[root, seed, speculation_k] = {"before": first, "after": history[-1], "history": history}
    return _RUNS[root, seed, speculation_k]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for the module: the equivalence test reuses the learning test's runs."""
    return tmp_path_factory.mktemp("moe-learning")


def _summary(run: dict[str, Any], label: str) -> tuple[float, list[str]]:
    """The run's final held-out reward (printed with τ, routing agreement and the gap) and every
    registered criterion it misses."""
    before, after = run["before"]["reward/eval_mean"], run["after"]["reward/eval_mean"]
    spread = (run["before"]["reward/eval_stderr"] ** 2 + run["after"]["reward/eval_stderr"] ** 2) ** 0.5
    gaps = [(m["mismatch/logprob_abs_mean"], m["mismatch/logprob_abs_p99"]) for m in run["history"]]
    taus = [m.get("spec/acceptance_length", 0.0) for m in run["history"]]
    agreement = [m["train/routing_agreement"] for m in run["history"]]
    print(
        f"{label}: held-out reward {before:.3f} -> {after:.3f} (2 SE of the difference: {2 * spread:.3f}); "
        f"tau mean {sum(taus) / len(taus):.2f}; routing agreement min {min(agreement):.4f}; "
        f"gap mean {max(g[0] for g in gaps):.2e} p99 {max(g[1] for g in gaps):.2e} (largest step)"
    )
    missed = []
    if not after - before > 2 * spread:
        missed.append(f"{label}: held-out reward {before:.3f} -> {after:.3f}, not beyond 2 SE ({2 * spread:.3f})")
    if not all(m["mismatch/logprob_abs_max"] < 1e-4 for m in run["history"]):
        missed.append(f"{label}: a step's log-prob gap to the sampler >= 1e-4")
    if not min(agreement) > 0.99:
        missed.append(f"{label}: routing agreement {min(agreement):.4f} <= 0.99")
    return after, missed


# The registered criteria as they came out (2026-12-02, docs/moe.md "Learning"): kept, and marked where
# they failed, so a change that makes them pass (or fail elsewhere) shows.
MISSED_SEED_1 = "registered and missed: seed 1 at k = 3 went 0.328 -> 0.359 against 2 SE of 0.119 (2026-12-02)"
MISSED_EQUIVALENCE = (
    "registered and not shown: k3 - k0 = -0.227, -0.148 over seeds 0 and 1 (90% CI [-0.434, +0.059]; "
    "the 12-seed run: +0.017 +- 0.026, CI [-0.029, +0.063], 20% power at margin 0.05), and seed 1 misses its 2 SE"
)


@pytest.mark.long
@pytest.mark.parametrize(
    "seed",
    [pytest.param(s, marks=pytest.mark.xfail(strict=True, reason=MISSED_SEED_1)) if s == 1 else s for s in SEEDS],
)
def test_rl_on_an_moe_raises_the_held_out_reward(root: Path, seed: int) -> None:
    torch.set_num_threads(1)
    run = rl_run(root, seed, 3)
    assert all(m["spec/acceptance_length"] > 1.0 for m in run["history"])
    _, missed = _summary(run, f"seed {seed} k3")
    assert not missed, missed


@pytest.mark.long
@pytest.mark.xfail(strict=True, reason=MISSED_EQUIVALENCE)
def test_an_moe_learns_equivalently_without_speculation(root: Path) -> None:
    torch.set_num_threads(1)
    diffs, missed = [], []
    for seed in SEEDS:  # every run first, then the verdicts: a miss does not hide the others' figures
        spec, spec_missed = _summary(rl_run(root, seed, 3), f"seed {seed} k3")
        plain, plain_missed = _summary(rl_run(root, seed, 0), f"seed {seed} k0")
        diffs.append(spec - plain)
        missed += spec_missed + plain_missed
    result = tost_paired(diffs, margin=MARGIN)
    print(f"k3 - k0 per seed {[round(d, 3) for d in diffs]}: {result.describe()}")
    assert result.equivalent and not missed, (result.describe(), missed)
