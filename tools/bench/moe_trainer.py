#!/usr/bin/env python
"""The trainer's step on a mixture of experts against a dense model of equal active parameters, on CPU.

    specrl bench moe-trainer [--rows 8] [--seq 64] [--repeats 5] [--replay]
    specrl bench moe-trainer --gap CHECKPOINT [--prompts 64] [--seed 0]
    specrl bench moe-trainer --learning OUT --seeds 100 101 ...

`specrl bench moe`'s two shapes (hidden 128, 4 layers, 8/2 heads, vocab 256; the MoE 32 experts,
top 4, expert width 128; the dense MLP 512 wide: a token multiplies the same parameters in both), no
draft, as the trainer's Megatron-core policy (`trainer.policy.policy.Policy`: local spec, SequentialMLP
experts, allgather dispatcher, one process). One update (`Policy.train_step`: forward, backward,
Muon + AdamW) on `--rows` random sequences of `--seq` tokens; one torch thread; MoE and dense
alternate `--repeats` times after a warm-up step; printed: medians of process CPU seconds per step
and the ratio. `--replay`: the MoE replays routes (its own live choice, recorded once: the cost of
replay itself, no change of experts).

`--gap CHECKPOINT` (an MoE checkpoint, e.g. `tests/trainer/rl/test_moe_learning.py`'s warmed-up policy): the
sampler-vs-trainer log-prob gap per token. The sidecar's engine (`TorchEngine`, float32, plain
decoding) samples `--prompts` arithmetic prompts at temperature 1 with every position's routes
(`routes="sequence"`); the trainer's policy (`Policy.from_checkpoint`) scores the same tokens with
live routing (replay off) and with those routes replayed (on), first with its router as the
sampler's (float32), then perturbed as a real deployment's is: the router's input and weight
rounded to bfloat16 before its float32 matmul (a trainer that keeps activations and weights in bf16,
as Megatron with `moe_router_dtype` fp32 does, against a float32 sampler; the rest of the model
stays float32, so the gap is the routing's). Printed: per setting the gap's mean, p99 and max over
the response tokens (`trainer.policy.losses.mismatch_metrics`) and the routing agreement (the share of
token x sparse-layer choices where the trainer's live router picks the sampler's experts, measured
in the replaying forward: `train/routing_agreement`).

`--learning OUT`: `tests/trainer/rl/test_moe_learning.py`'s runs (its `rl_run`: the checkpoint, warm-up, draft
fit and 20 RL steps with routing replay, one per seed) at speculation_k 3 and 0 for each of
`--seeds`, kept under OUT; printed per run the held-out reward before and after, τ and the largest
step's gap mean and p99, then the paired TOST of k3 − k0 at ±0.05 (`trainer.rl.equivalence`, the dense
comparison's test) with its false-equivalence rate and power simulated at the observed spread.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from sidecar.model.model import ModelConfig  # noqa: E402
from sidecar.model.moe import MoEConfig  # noqa: E402
from trainer.policy.policy import (  # noqa: E402
    Policy,
    TrainBatch,
    moe,
)

EXPERTS, TOP, WIDTH = 32, 4, 128
SHAPE = dict(vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=512, num_nextn_predict_layers=0, intermediate_size=TOP * WIDTH)  # fmt: skip


def policies() -> dict[str, Policy]:
    experts = MoEConfig(num_experts=EXPERTS, num_experts_per_tok=TOP, moe_intermediate_size=WIDTH, norm_topk_prob=True)
    return {
        "moe": Policy(ModelConfig.tiny(**SHAPE, architectures=["Qwen3MoeForCausalLM"], moe=experts), Policy.Config()),
        "dense": Policy(ModelConfig.tiny(**SHAPE), Policy.Config()),
    }


def bf16_router(router: Any) -> None:
    """Round `router`'s weight (in place) and every input to bfloat16; its logits stay a float32 matmul."""
    router.weight.data = router.weight.data.to(torch.bfloat16).float()

    def rounded(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0].to(torch.bfloat16).float(), *args[1:])

    router.register_forward_pre_hook(rounded)


def gap_table(checkpoint: Path, prompts: int, seed: int) -> str:
    """The `--gap` arm: the sampler's samples scored by the trainer, router float32 and bf16, replay off and on."""
    import random

    from sidecar.engine.torch_engine import TorchEngine
    from sidecar.types import GenerationRequest, SamplingParams
    from trainer.policy.losses import mismatch_metrics
    from trainer.rl.tasks import ArithmeticTask, prompt_ids
    from trainer.tokenizer import CharTokenizer

    task, tok = ArithmeticTask(regime="zero", digits=2), CharTokenizer()
    rng = random.Random(seed)
    asked = [prompt_ids(task, tok, task.sample(rng, "train")) for _ in range(prompts)]
    engine = TorchEngine.from_checkpoint(checkpoint, speculation_k=0, max_batch_size=64)
    request = GenerationRequest(
        prompts=asked,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=(tok.eos_id,), seed=seed),
        request_id="gap",
        routes="sequence",
    )
    samples = sorted(engine.generate(request), key=lambda s: s.prompt_index)
    batch = TrainBatch.from_sequences(
        asked,
        [s.token_ids for s in samples],
        torch.zeros(len(samples)),
        rollout_logprobs=[s.logprobs for s in samples],
        pad_id=tok.pad_id,
    )
    lengths = [len(a) + len(s.token_ids) for a, s in zip(asked, samples, strict=True)]
    routes = moe.batch_routes(samples, lengths, batch.tokens.shape[1])
    rows = [
        "| trainer's router | replay | gap mean | gap p99 | gap max | routing agreement |",
        "|---|---|---|---|---|---|",
    ]
    for router in ("float32", "bf16-rounded"):
        policy = Policy.from_checkpoint(checkpoint, Policy.Config())
        if router != "float32":
            for r in moe.routers(policy.model):
                bf16_router(r)
        live = policy.logprobs(batch.tokens)
        moe.take_agreement(policy.replay_slots)
        replayed = policy.logprobs(batch.tokens, routes)
        agreed, compared = moe.take_agreement(policy.replay_slots)
        for replay, logp in (("off", live), ("on", replayed)):
            m = mismatch_metrics(logp, batch.rollout_logprobs, batch.mask)  # type: ignore[arg-type]
            rows.append(
                f"| {router} | {replay} | {m['mismatch_logprob_abs_mean']:.2e} | {m['mismatch_logprob_abs_p99']:.2e} | "
                f"{m['mismatch_logprob_abs_max']:.2e} | {agreed / compared:.4f} |"
            )
    tokens = int(batch.mask.sum())
    return (
        "\n".join(rows)
        + f"\n({len(samples)} samples, {tokens} response tokens, {len(moe.routers(policy.model))} sparse layers)"
    )


def learning(out: Path, seeds: list[int]) -> str:
    """The `--learning` arm: both arms per seed, then the paired TOST of the final held-out reward."""
    from tests.trainer.rl.test_moe_learning import MARGIN, rl_run
    from trainer.rl.equivalence import tost_operating_characteristics, tost_paired

    lines, diffs = [], []
    for seed in seeds:
        final = {}
        for k in (3, 0):
            run = rl_run(out, seed, k)
            before, after = run["before"]["reward/eval_mean"], run["after"]["reward/eval_mean"]
            se = math.hypot(run["before"]["reward/eval_stderr"], run["after"]["reward/eval_stderr"])
            taus = [m.get("spec/acceptance_length", 1.0) for m in run["history"]]
            mean = max(m["mismatch/logprob_abs_mean"] for m in run["history"])
            p99 = max(m["mismatch/logprob_abs_p99"] for m in run["history"])
            lines.append(
                f"seed {seed} k{k}: {before:.3f} -> {after:.3f} ({(after - before) / se:+.1f} se), "
                f"tau {statistics.mean(taus):.2f}, gap mean {mean:.1e} p99 {p99:.1e}"
            )
            final[k] = after
        diffs.append(final[3] - final[0])
    result = tost_paired(diffs, margin=MARGIN)
    lines.append(f"k3 - k0 {statistics.mean(diffs):+.3f} (sd {statistics.stdev(diffs):.3f}): {result.describe()}")
    oc = tost_operating_characteristics(len(diffs), statistics.stdev(diffs), MARGIN)
    lines.append(oc.describe())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--replay", action="store_true")
    ap.add_argument(
        "--gap", type=Path, metavar="CHECKPOINT", help="the sampler-vs-trainer gap arm on this MoE checkpoint"
    )
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--learning", type=Path, metavar="OUT", help="the learning comparison, runs kept under OUT")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.learning is not None:
        print(learning(args.learning, args.seeds))
        return 0
    if args.gap is not None:
        print(gap_table(args.gap, args.prompts, args.seed))
        return 0
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, SHAPE["vocab_size"], (args.rows, args.seq), generator=gen)
    advantages = torch.randn(args.rows, generator=gen)
    built = policies()
    routes = None
    if args.replay:
        built["moe"].logprobs(tokens)
        routes = moe.last_routes(built["moe"].replay_slots, args.rows, live=True)
    times: dict[str, list[float]] = {name: [] for name in built}
    for repeat in range(args.repeats + 1):
        for name, policy in built.items():
            batch = TrainBatch(
                tokens=tokens,
                mask=torch.ones(args.rows, args.seq - 1),
                advantages=advantages,
                routes=routes if name == "moe" else None,
            )
            start = time.process_time()
            policy.train_step(batch)
            if repeat:  # the first round warms up
                times[name].append(time.process_time() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print("| rows x seq | MoE s/step | dense s/step | MoE / dense | replay |\n|---|---|---|---|---|")
    print(
        f"| {args.rows} x {args.seq} | {medians['moe']:.3f} | {medians['dense']:.3f} | "
        f"{medians['moe'] / medians['dense']:.2f}x | {'on' if args.replay else 'off'} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
