#!/usr/bin/env python
"""Speculative vs plain decoding in the embedded engine, side by side in one run.

    specrl bench engine [--model DIR] [--batches 1,4,16,64] [--ks 1,2,3,5,7] [--repeats 3]
                          [--temperature 0] [--threads 1]

For each batch size B and draft length k, generates the same prompts with k = 0 (plain) and
with speculation, interleaved, `--repeats` times (batches smaller than --min-prompts run in
turn over that many prompts, so B = 1 is not one prompt's luck), and prints medians of:
- tokens/s of both and the realised speedup (spec over plain, each measured in this run);
- tau (acceptance length = generated tokens / verify steps, bonus included) and the
  acceptance rate per draft position;
- c = (time of one draft step) / (time of one plain target decode step) at batch B, both
  including their sampling, timed on the same KV context length;
- the analytical bound tau / (1 + k c) and the realised speedup as a fraction of it;
- peak resident memory of the process (getrusage maxrss) after each batch size.

The model (built on first use into --model): a Qwen3-shaped target (hidden 512, 12 layers,
8/4 heads, vocab 4096) with random weights whose residual branches are scaled down (0.08)
and whose output logits are sharpened (x4), so that the next token depends mostly — not
only — on the current one, like a peaked LM continuation; its MTP layer is the
"bigram" draft (logits = lm_head(norm(embed(x_{t+1})))); --fit-steps N then trains it on
the target's own greedy outputs (specrl bench fit-draft logic: detached hidden states, trunk
frozen) — off by default, since the few thousand tokens a CPU affords over-fit.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sidecar.engine.sampling import RowSampling, filtered_probs, sample_from
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.kv_cache import KVCache
from sidecar.model.model import Qwen3WithMTP
from sidecar.types import GenerationRequest, SamplingParams, SpeculationCounters
from tools.bench.common import (
    BENCH_CONFIG,
    ensure_bench_checkpoint,
    median_time,
    subcommand,
)


@torch.inference_mode()
def step_costs(
    model: Qwen3WithMTP, batch: int, context: int, sp: SamplingParams, ks: list[int]
) -> tuple[float, float, dict[int, float]]:
    """CPU seconds of one draft step, one plain target decode step, and a k+1-token verify.

    All at batch B on a KV context of `context` tokens, each including its sampling work.
    """
    cfg = model.config
    rows = RowSampling.of([sp] * batch)

    def cache(layers: int) -> KVCache:
        c = KVCache(
            num_layers=layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=cfg.dtype,
            device="cpu",
            batch=batch,
            capacity=context + max(ks) + 8,
        )
        c.lengths = [context] * batch
        return c

    target, mtp = cache(cfg.num_hidden_layers), cache(1)
    hidden = torch.randn(batch, 1, cfg.hidden_size)

    def target_step(width: int) -> None:
        tokens = torch.randint(0, cfg.vocab_size, (batch, width))
        plan = target.plan([width] * batch)
        h = model.trunk_step(tokens, target, plan)
        probs = filtered_probs(model.logits(h).float(), rows)
        sample_from(probs[:, -1], torch.rand(batch))

    def draft_step() -> None:
        tokens = torch.randint(0, cfg.vocab_size, (batch, 1))
        plan = mtp.plan([1] * batch)
        g = model.mtp_step(0, tokens, hidden, mtp, plan)
        sample_from(filtered_probs(model.mtp_head(0, g[:, 0]), rows), torch.rand(batch))

    draft_step()
    target_step(1)
    t_draft = median_time(draft_step, 15)
    t_target = median_time(lambda: target_step(1), 15)
    t_verify = {k: median_time(lambda k=k: target_step(k + 1), 15) for k in ks}
    return t_draft, t_target, t_verify


def run(
    engine: TorchEngine, batches: list[list[list[int]]], sp: SamplingParams, k: int
) -> tuple[float, SpeculationCounters]:
    """Generate each batch of prompts in turn; CPU seconds and counters over all of them."""
    snapshot = SpeculationCounters()
    snapshot.add(engine.stats()[-1].counters)
    start = time.process_time()
    for prompts in batches:
        samples = engine.generate(GenerationRequest(prompts=prompts, sampling=sp, speculation_k=k))
        assert sum(len(s.token_ids) for s in samples) == len(prompts) * sp.max_new_tokens
    seconds = time.process_time() - start
    return seconds, engine.stats()[-1].counters.minus(snapshot)


def step_breakdown(engine: TorchEngine, prompts: list[list[int]], sp: SamplingParams, ks: list[int]) -> None:
    """Where a round's CPU time goes inside the engine (cProfile on CPU time): verify, draft, rest."""
    for k in [0, *ks]:
        prof = cProfile.Profile(time.process_time)
        prof.enable()
        engine.generate(GenerationRequest(prompts=prompts, sampling=sp, speculation_k=k))
        prof.disable()
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        cum = {f[2]: (v[0], v[3]) for f, v in stats.items() if f[0].endswith(("speculative.py", "torch_engine.py"))}
        steps, t_verify = cum["verify"]
        t_draft = cum.get("draft", (0, 0.0))[1]
        t_rest = cum["_decode"][1] - t_verify - t_draft
        print(
            f"  breakdown B={len(prompts)} k={k}: {steps} rounds; per round verify {t_verify / steps * 1e3:.1f} ms, "
            f"draft {t_draft / steps * 1e3:.1f} ms, rest (accept, rollback, bookkeeping) {t_rest / steps * 1e3:.2f} ms",
            flush=True,
        )


SUBCOMMANDS = {"step": "engine_step"}


def main(argv: list[str] | None = None) -> int:
    merged = subcommand(argv, SUBCOMMANDS, "specrl bench engine")
    if merged is not None:
        return merged
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="subcommand: step (engine step time, this checkout against another: `specrl bench engine step --help`)",
    )
    ap.add_argument("--model", type=Path, default=Path("/tmp/specrl-bench-engine-model"))
    ap.add_argument("--fit-steps", type=int, default=0, help="self-distillation steps for the draft (0: bigram draft)")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--ks", default="1,2,3,5,7")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-length", type=int, default=16)
    ap.add_argument("--min-prompts", type=int, default=4, help="small batches run in turn over this many prompts")
    ap.add_argument("--new-tokens", default="128,128,64,64", help="per batch size (one value or one per batch)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--breakdown", action="store_true", help="also profile where a round's time goes (B = 1 only)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared 2-core box thrashes with 2)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ensure_bench_checkpoint(args.model, args.fit_steps)
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    news = [int(n) for n in args.new_tokens.split(",")]
    news = news * len(batches) if len(news) == 1 else news[: len(batches)]
    if len(news) != len(batches):
        ap.error(f"--new-tokens needs one value or one per batch size ({len(batches)})")
    engine = TorchEngine.from_checkpoint(
        args.model, speculation_k=0, max_speculation_k=max(ks), max_batch_size=max(batches)
    )
    model = engine.model
    gen = torch.Generator().manual_seed(1)
    print(
        f"model: hidden {BENCH_CONFIG.hidden_size}, {BENCH_CONFIG.num_hidden_layers} layers, vocab "
        f"{BENCH_CONFIG.vocab_size}; temperature {args.temperature}; threads {args.threads}; repeats {args.repeats}"
    )
    header = (
        "| B | k | tau | accept/pos | c | v_k | bound tau/(1+kc) | bound tau/(v_k+kc) | plain tok/s | spec tok/s "
        "| speedup | of bound | of v-bound |"
    )
    lines = [header, "|---" * 13 + "|"]
    print(header, flush=True)
    for batch, new in zip(batches, news, strict=True):
        sp = SamplingParams(temperature=args.temperature, max_new_tokens=new, seed=3)
        rounds = max(1, -(-args.min_prompts // batch))  # B = 1 averages over several prompts too
        prompts = [
            torch.randint(0, BENCH_CONFIG.vocab_size, (batch, args.prompt_length), generator=gen).tolist()
            for _ in range(rounds)
        ]
        run(engine, prompts[:1], SamplingParams(temperature=args.temperature, max_new_tokens=4), 1)  # warm up
        times: dict[int, list[float]] = {k: [] for k in [0, *ks]}
        counters: dict[int, SpeculationCounters] = {k: SpeculationCounters() for k in ks}
        for _ in range(args.repeats):
            for k in [0, *ks]:
                seconds, c = run(engine, prompts, sp, k)
                times[k].append(seconds)
                if k:
                    counters[k].add(c)
        t_draft, t_target, t_verify = step_costs(model, batch, args.prompt_length + new // 2, sp, ks)
        c_ratio = t_draft / t_target
        plain = rounds * batch * new / statistics.median(times[0])
        for k in ks:
            cnt = counters[k]
            tau = cnt.acceptance_length
            acc = cnt.accepted_per_position + [0] * k
            per_pos = "/".join(f"{acc[i] / max(cnt.drafted_per_position[i], 1):.2f}" for i in range(k))
            spec = rounds * batch * new / statistics.median(times[k])
            bound = tau / (1 + k * c_ratio)
            v_k = t_verify[k] / t_target
            v_bound = tau / (v_k + k * c_ratio)
            speedup = spec / plain
            row = (
                f"| {batch} | {k} | {tau:.2f} | {per_pos} | {c_ratio:.3f} | {v_k:.2f} | {bound:.2f} | {v_bound:.2f} "
                f"| {plain:.1f} | {spec:.1f} | {speedup:.2f}x | {speedup / bound:.0%} | {speedup / v_bound:.0%} |"
            )
            lines.append(row)
            print(row, flush=True)
        if args.breakdown and batch == 1:
            step_breakdown(engine, prompts[0], sp, ks)
        rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(
            f"  B={batch}: target step {t_target * 1e3:.1f} ms, draft step {t_draft * 1e3:.1f} ms, "
            f"peak RSS so far {rss_mib:.0f} MiB",
            flush=True,
        )
    print("\n".join(["", *lines]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
