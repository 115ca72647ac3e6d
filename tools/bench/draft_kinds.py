#!/usr/bin/env python3
"""EAGLE-3 against MTP on the demo workload, side by side, and what online training adds.

1. The demo's warm policy (`DemoConfig`: 24 layers of width 128, supervised warm-up; kept under
   --out and reused). Its MTP layer serves the MTP arm; the same trunk without it serves the
   EAGLE-3 arm (an EAGLE-3 draft is for targets without MTP layers).
2. Draft-init of each kind at the same budget (the demo's: prompts, steps, learning rate, chain
   depth), on the same completions of the policy.
3. For each k: τ (tokens per verify step) and generation tokens per CPU second of each arm on
   the same held-out prompts (temperature 1, the demo's response length, one torch thread),
   and the speedup over plain decoding of the same target measured in the same pass; the
   measurements alternate between arms and repeat (medians), so load falls on both alike.
4. --draft-vocab-sizes 0,50,25,12: the MTP arm alone with its head over a reduced draft vocabulary
   (`draft_vocab_size`, FR-Spec; 0: the full vocabulary): each engine first counts its own
   tokens on --prompts training prompts (temperature 1, k = max --ks), then τ and generation
   tokens per CPU second are measured as in 3, beside the weight bytes one draft token reads
   (the MTP layer plus the head's rows).
5. --online-steps N: the analogue of the study's "online adaptation rescues a weak draft": an
   EAGLE-3 draft initialised weakly (--weak-steps of draft-init) served through N steps of the
   demo's RL, once trained online and once frozen (`draft.train` off); τ per step of each.

    OMP_NUM_THREADS=1 specrl bench draft-kinds --out /tmp/kinds --ks 1,2,3,4,5
    OMP_NUM_THREADS=1 specrl bench draft-kinds --out /tmp/kinds --online-steps 20
    OMP_NUM_THREADS=1 specrl bench draft-kinds --out /tmp/kinds --ks 3 --draft-vocab-sizes 0,50,25,12
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path

import torch

from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.checkpoint import load_checkpoint, save_checkpoint
from sidecar.model.model import build_model
from sidecar.types import GenerationRequest, SamplingParams
from trainer.cli.demo import DemoConfig, demo_model_config
from trainer.rl.config import demo_config
from trainer.rl.loop import train
from trainer.rl.tasks import ArithmeticTask
from trainer.rl.warmup import draft_init, make_model, supervised_warmup
from trainer.tokenizer import CharTokenizer

TASK, TOK = ArithmeticTask(regime="zero", digits=2), CharTokenizer()


def prepare(out: Path, demo: DemoConfig, kinds: tuple[str, ...] = ("mtp", "eagle3")) -> dict[str, float]:
    """warm (MTP layer, untrained), target (the same trunk, no MTP), mtp and eagle3 drafts (of
    `kinds`); CPU seconds of each draft-init."""
    seconds: dict[str, float] = {}
    if not (out / "warm" / "config.json").is_file():
        make_model(out / "init", demo_model_config(demo.layers), seed=0)
        supervised_warmup(out / "init", out / "warm", TASK, TOK, demo.warmup)
    if "eagle3" in kinds and not (out / "target" / "config.json").is_file():
        config, tensors = load_checkpoint(out / "warm")
        stripped = {n: t for n, t in tensors.items() if not n.startswith("mtp.")}
        save_checkpoint(out / "target", dataclasses.replace(config, num_nextn_predict_layers=0), stripped)
    for kind, source, dest in (("mtp", "warm", "mtp_policy"), ("eagle3", "target", "eagle3")):
        if kind in kinds and not (out / dest / "config.json").is_file():
            t = time.process_time()
            draft_init(out / source, out / dest, TASK, TOK, dataclasses.replace(demo.draft_init, kind=kind))
            seconds[kind] = time.process_time() - t
    return seconds


def measure(engine: TorchEngine, prompts: list[list[int]], k: int, new_tokens: int) -> tuple[float, float]:
    """(τ, generated tokens per CPU second) of one generation at draft length k."""
    request = GenerationRequest(
        prompts=prompts,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=(TOK.eos_id,), seed=1),
        speculation_k=k,
    )
    start = time.process_time()
    samples = engine.generate(request)
    seconds = time.process_time() - start
    tokens = sum(s.counters.generated_tokens for s in samples)
    return tokens / max(sum(s.counters.verify_steps for s in samples), 1), tokens / seconds


def compare(
    out: Path, ks: list[int], n_prompts: int, new_tokens: int, repeats: int
) -> dict[str, dict[str, list[float]]]:
    rng = random.Random(99)
    prompts = [TOK.encode(TASK.sample(rng, "eval").prompt) for _ in range(n_prompts)]
    round_k = max(ks)
    engines = {
        "mtp": TorchEngine.from_checkpoint(out / "mtp_policy", speculation_k=0, max_speculation_k=round_k),
        "eagle3": TorchEngine.from_checkpoint(
            out / "target", speculation_k=0, max_speculation_k=round_k, draft=out / "eagle3"
        ),
    }
    for engine in engines.values():  # warm-up at the measured shapes (a first batch pays one-time costs)
        for k in (0, round_k):
            measure(engine, prompts, k, new_tokens)
    runs: dict[str, dict[str, list[list[float]]]] = {arm: {} for arm in engines}
    for r in range(repeats):
        for k in [0, *ks]:
            arms = list(engines) if (r + k) % 2 == 0 else list(engines)[::-1]
            for arm in arms:
                runs[arm].setdefault(str(k), []).append(list(measure(engines[arm], prompts, k, new_tokens)))
    result: dict[str, dict[str, list[float]]] = {}
    for arm, by_k in runs.items():
        result[arm] = {k: [statistics.median(x[i] for x in v) for i in range(2)] for k, v in by_k.items()}
    return result


def vocab_sizes(
    out: Path, sizes: list[int], k: int, n_prompts: int, new_tokens: int, repeats: int
) -> dict[str, dict[str, float]]:
    """Per draft_vocab_size: τ and tokens per CPU second at k (medians), plain tokens per CPU second,
    and the weight bytes one draft token reads."""
    config, tensors = load_checkpoint(out / "mtp_policy")
    model = build_model(config)
    model.load_state_dict(tensors, strict=True)
    rng = random.Random(99)
    prompts = [TOK.encode(TASK.sample(rng, "eval").prompt) for _ in range(n_prompts)]
    counted = [TOK.encode(TASK.sample(rng, "train").prompt) for _ in range(n_prompts)]
    engines = {n: TorchEngine(model, speculation_k=0, max_speculation_k=k, draft_vocab_size=n) for n in sizes}
    for engine in engines.values():  # its own tokens on other prompts choose the subset; then the shapes warm up
        measure(engine, counted, k, new_tokens)
        measure(engine, prompts, 0, new_tokens)
    runs: dict[int, dict[int, list[tuple[float, float]]]] = {n: {0: [], k: []} for n in sizes}
    for r in range(repeats):
        for n in sizes if r % 2 == 0 else sizes[::-1]:
            for kk in (0, k):
                runs[n][kk].append(measure(engines[n], prompts, kk, new_tokens))
    layer = sum(p.numel() * p.element_size() for p in model.mtp_layer(0).parameters())
    row = config.hidden_size * model.output_weight().element_size()
    result: dict[str, dict[str, float]] = {}
    for n, by_k in runs.items():
        plain = statistics.median(x[1] for x in by_k[0])
        spec = statistics.median(x[1] for x in by_k[k])
        result[str(n)] = {
            "tau": statistics.median(x[0] for x in by_k[k]),
            "tokens_per_cpu_s": spec,
            "plain_tokens_per_cpu_s": plain,
            "speedup": spec / plain,
            "head_bytes": (n or config.vocab_size) * row,
            "draft_token_bytes": layer + (n or config.vocab_size) * row,
            "coverage": coverage(engines[n]),
        }
    return result


def coverage(engine: TorchEngine) -> float:
    """The share of the tokens the engine counted that its draft vocabulary holds (1: the full one)."""
    vocab = engine.drafter.vocab
    if vocab is None:
        return 1.0
    return float(vocab.counts[vocab.ids.cpu()].sum() / vocab.counts.sum().clamp(min=1))


def online(out: Path, demo: DemoConfig, steps: int, weak_steps: int) -> dict[str, list[float]]:
    weak = out / f"eagle3_weak{weak_steps}"
    if not (weak / "config.json").is_file():
        draft_init(
            out / "target", weak, TASK, TOK, dataclasses.replace(demo.draft_init, kind="eagle3", steps=weak_steps)
        )
    taus: dict[str, list[float]] = {}
    for arm, train_draft in (("online", True), ("frozen", False)):
        cfg = demo_config(out / "target", out / "runs" / f"{arm}_weak{weak_steps}_{steps}")
        cfg.draft.eagle3 = weak
        cfg.draft.train = train_draft
        cfg.steps = steps
        cfg.eval_every = 0
        cfg.rollout.measure_plain = False
        history = train(cfg, progress=False)
        taus[arm] = [m["spec/acceptance_length"] for m in history]
    return taus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--ks", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 2, 3, 4, 5], help='"": skip'
    )
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--draft-vocab-sizes",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[],
        help="MTP arm only: draft_vocab_size values to compare at k = max(--ks) (0: the full vocabulary)",
    )
    ap.add_argument("--online-steps", type=int, default=0, help="RL steps of the online-update comparison (0: skip)")
    ap.add_argument("--weak-steps", type=int, default=10, help="draft-init steps of the weak EAGLE-3 start")
    args = ap.parse_args()
    torch.set_num_threads(1)
    demo = DemoConfig()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.draft_vocab_sizes:
        prepare(args.out, demo, kinds=("mtp",))
        k = max(args.ks)
        sizes = vocab_sizes(args.out, args.draft_vocab_sizes, k, args.prompts, args.new_tokens, args.repeats)
        full = sizes.get("0")
        print(
            f"| draft_vocab_size | tokens it holds | head bytes | draft-token bytes | τ (k = {k}) | tokens/CPU s "
            "| gen speedup |"
        )
        print("|---|---|---|---|---|---|---|")
        for n, m in sizes.items():
            share = f" ({m['draft_token_bytes'] / full['draft_token_bytes']:.2f}x)" if full else ""
            print(
                f"| {'full' if n == '0' else n} | {m['coverage']:.1%} | {m['head_bytes'] / 1024:.1f} KiB | {m['draft_token_bytes'] / 1024:.1f} KiB{share} "
                f"| {m['tau']:.2f} | {m['tokens_per_cpu_s']:.0f} | {m['speedup']:.2f}x |"
            )
        (args.out / "draft_vocab.json").write_text(json.dumps(sizes, indent=2))
        return
    results: dict[str, object] = {"draft_init_cpu_seconds": prepare(args.out, demo)}
    if args.ks:
        table = compare(args.out, args.ks, args.prompts, args.new_tokens, args.repeats)
        results["compare"] = table
        print("| k | τ MTP | τ EAGLE-3 | gen speedup MTP | gen speedup EAGLE-3 |")
        print("|---|---|---|---|---|")
        for k in args.ks:
            m, e = table["mtp"][str(k)], table["eagle3"][str(k)]
            print(
                f"| {k} | {m[0]:.2f} | {e[0]:.2f} | {m[1] / table['mtp']['0'][1]:.2f}x "
                f"| {e[1] / table['eagle3']['0'][1]:.2f}x |"
            )
    if args.online_steps:
        taus = online(args.out, demo, args.online_steps, args.weak_steps)
        results["online"] = taus
        for arm, series in taus.items():
            tail = statistics.mean(series[-5:])
            print(f"{arm}: τ step 1 {series[0]:.2f}, last 5 steps {tail:.2f}: " + " ".join(f"{t:.2f}" for t in series))
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"draft-init CPU seconds: {results['draft_init_cpu_seconds']}")


if __name__ == "__main__":
    main()
