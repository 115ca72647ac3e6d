#!/usr/bin/env python
"""The paged KV cache against the static one, on one KV budget, at a long-tailed length mix (#48).

    specrl bench kv [--scale 0.03125] [--groups 24] [--group 8] [--prompt-length 16] [--budget-rows 4]
                      [--block-size N] [--k 0] [--arms static,paged] [--threads 1] [--out FILE] [--quick]

Issue #48's claim: with a long-tailed length mix (log-normal, median 1k tokens, p99 16k, max 32k,
G = 8) the paged cache holds >= 4x the concurrent rows of the static one, generation throughput at
that mix is higher, and prefill work per GRPO group drops by ~G. This measures all three on a CPU.

The workload: `--groups` prompts of `--prompt-length` random tokens, `--group` (G) samples each;
every sample is its own request (temperature 1, stop_at_eos off, a fixed seed each) whose
max_new_tokens is its response length, drawn log-normal with median 1024 and p99 16384
(sigma = ln 16 / z_0.99), capped at 32768, then multiplied by `--scale`. All requests are
submitted at once, a group's G together (so a group admitted in one step prefills its prompt
once), and the engine steps until every sample has its tokens: one rollout batch, start to end.

How many rows a cache holds is read two ways. Peak and mean running rows over the run (mean: the
drain, where the long tail runs nearly alone, weighs in, and more so the fewer the samples); and
the rows running after the steps that left requests waiting ("saturated"), which only the budget
bounds: the static arm's R. At the default budget the pool admits the default 24 groups' 192
samples in one step, so the paged arm has no saturated steps and its peak is the sample count;
`--arms paged --groups 96` runs it long enough to saturate (the static arm's saturated rows are
R by construction, and its runtime grows with the tokens).

Scale: the default 1/32 (median 32 tokens, p99 512, max 1024) lets a CPU run finish in a few
minutes. The rows-held ratio does not depend on it: the budget is a number of full-context rows
and the context (max_context = scaled cap + prompt) scales with the lengths, so the budget
scales too. What does not scale by itself is the block: a 16-token block is 1.6% of a
1k-token median row but half of a 32-token one, so the block size defaults to 16 x scale (a
power of two, at least 1) and the prompt length, at 16, to 512 x 1/32; pass --block-size 16 to
see the fragmentation of full-size blocks on scaled lengths.

The budget (`--budget-rows` R): the KV bytes of R rows as the static cache reserved them —
max_context + max_speculation_k + 2 slots each, over target and draft layers
(`drafter.token_bytes()`), rounded up to whole blocks, plus the pool's two reserved blocks. Both
arms get that budget (one pool of the same number of blocks) and run on the same engine code:
- static: max_batch_size = R, what a per-row reservation of that budget admitted (the pool then
  holds every admitted row at full context: it never preempts). The static cache is gone; this
  emulates its admission by capping rows on the paged engine, so this arm also pays the paged
  path's CPU gather of a row's blocks, where the static cache read views of its rows.
- paged: max_batch_size 256, the pool's free blocks deciding admission (and preemption).

Per arm: peak and mean running rows (`num_running()` after each step), the same over saturated
steps, peak blocks used and shared, preemptions, the tokens generated, wall and process-CPU
seconds and tokens per second of each (one rollout batch: its makespan), and prefill work per
prompt token (`VersionStats.prefill_tokens / prompt_tokens`: ~1/G when a group's samples are
admitted together and share the prefill, up to 1 when they trickle in one at a time). Preempted
rows resuming prefill their prompt and output again, which the stats count too, so the table also
gives those recomputed tokens and the ratio without them: the prompts' prefill, what sharing
saves. The table puts the arms and paged / static side by side; `--out` writes it as JSON.

The model: specrl bench engine's shape (hidden 512, 12 layers, 8/4 heads, vocab 4096, one MTP
layer; its context raised to max_context where that is longer) with random weights: the
lengths are fixed in advance, so the tokens' values change nothing measured here. `--k` > 0
speculates with the (random, so rarely accepted) MTP draft. `--quick`: a tiny model, scale 1/256
and 16 groups, a seconds-long smoke run (tests/tools/test_bench_kv.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sidecar.engine.rows import Sequence
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.kv_pages import RESERVED_BLOCKS, blocks_for
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.types import GenerationRequest, SamplingParams
from tools.bench.common import BENCH_CONFIG

MEDIAN, P99, CAP = 1024, 16384, 32768
"""The issue's length mix (tokens, before --scale)."""
SIGMA = math.log(P99 / MEDIAN) / statistics.NormalDist().inv_cdf(0.99)
PAGED_ROWS = 256
"""The paged arm's max_batch_size: large enough that the pool, not the row cap, decides."""
QUICK_CONFIG = ModelConfig.tiny(vocab_size=256, max_position_embeddings=256)


FIGURES = [
    ("max_batch_size", "{:d}"),
    ("peak_rows", "{:d}"),
    ("mean_rows", "{:.1f}"),
    ("saturated_steps", "{:d}"),
    ("peak_rows_saturated", "{:d}"),
    ("mean_rows_saturated", "{:.1f}"),
    ("steps", "{:d}"),
    ("peak_blocks_used", "{:d}"),
    ("blocks_total", "{:d}"),
    ("peak_blocks_shared", "{:d}"),
    ("preemptions", "{:d}"),
    ("generated_tokens", "{:d}"),
    ("wall_s", "{:.1f}"),
    ("tokens_per_s", "{:.1f}"),
    ("cpu_s", "{:.1f}"),
    ("tokens_per_cpu_s", "{:.1f}"),
    ("prefill_tokens", "{:d}"),
    ("prompt_tokens", "{:d}"),
    ("prefill_ratio", "{:.3f}"),
    ("resume_prefill_tokens", "{:d}"),
    ("prompt_prefill_ratio", "{:.3f}"),
]
"""What the table shows of each arm, and how."""
ARMS = ("static", "paged")


def ratio(paged: float, static: float) -> float | None:
    """paged / static, None where either figure is 0 (a count one arm never had)."""
    return paged / static if static and paged else None


def draw_lengths(n: int, scale: float, seed: int) -> list[int]:
    """n response lengths: log-normal (median MEDIAN, p99 P99) capped at CAP, times `scale`, at least 1."""
    rng = random.Random(seed)
    return [max(1, round(min(rng.lognormvariate(math.log(MEDIAN), SIGMA), CAP) * scale)) for _ in range(n)]


def scaled_block_size(scale: float) -> int:
    """16 x scale as a power of two (rounded down), in [1, 16]."""
    target = max(1.0, min(16.0, 16 * scale))
    return 1 << math.floor(math.log2(target))


def times(ratio: float | None) -> str:
    """A paged / static ratio as the table prints it ("-": none, see `ratio`)."""
    return "-" if ratio is None else f"{ratio:.2f}x"


def run_arm(
    name: str,
    model: Qwen3WithMTP,
    *,
    rows: int,
    budget: int,
    max_context: int,
    block_size: int,
    k: int,
    prompts: list[list[int]],
    lengths: list[int],
    group: int,
    seed: int,
) -> dict[str, Any]:
    """Generate every sample on a fresh engine of `rows` rows and `budget` KV bytes; what it measured."""
    engine = TorchEngine(
        model,
        max_batch_size=rows,
        max_context=max_context,
        kv_cache_gib=budget / 2**30,
        kv_block_size=block_size,
        speculation_k=k,
        max_speculation_k=k,
    )
    warm = SamplingParams(temperature=1.0, max_new_tokens=2, seed=seed, stop_at_eos=False)
    engine.generate(GenerationRequest(prompts=[[1, 2, 3]], sampling=warm, speculation_k=k, request_id=f"{name}-warm"))
    before = engine.stats()[-1]
    prompt0, prefill0, pre0 = before.prompt_tokens, before.prefill_tokens, engine.kv_usage().preemptions
    for g, prompt in enumerate(prompts):
        for s in range(group):
            i = g * group + s
            sp = SamplingParams(temperature=1.0, max_new_tokens=lengths[i], seed=seed + 1 + i, stop_at_eos=False)
            engine.submit(GenerationRequest(prompts=[prompt], sampling=sp, speculation_k=k, request_id=f"{name}-{i}"))
    resumed = [0]  # prefill tokens that recomputed preempted rows' prefixes (beyond the prompts prefilled with them)
    admissible = engine.scheduler.admissible

    def counting_admissible() -> list[Sequence]:  # each admission's sequences (k is pinned: all are prefilled)
        new = admissible()
        # the engine prefills each distinct prefix once (a resumed row one token in shares its prompt's)
        prefilled = sum(map(len, {tuple(s.prefix()) for s in new}))
        resumed[0] += prefilled - sum(map(len, {tuple(s.prompt) for s in new if not s.output}))
        return new

    engine.scheduler.admissible = counting_admissible  # type: ignore[method-assign]
    running: list[int] = []
    saturated: list[int] = []  # rows after the steps that left requests waiting: what the pool (or cap) held
    peak_used = peak_shared = 0
    generated = finished = 0
    wall, cpu = time.perf_counter(), time.process_time()
    while engine.has_work():
        for sample in engine.step():
            finished += 1
            generated += len(sample.token_ids)
        running.append(engine.num_running())
        if engine.num_queued():
            saturated.append(running[-1])
        usage = engine.kv_usage()
        peak_used, peak_shared = max(peak_used, usage.blocks_used), max(peak_shared, usage.blocks_shared)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after, usage = engine.stats()[-1], engine.kv_usage()
    prompt_tokens, prefill_tokens = after.prompt_tokens - prompt0, after.prefill_tokens - prefill0
    return {
        "max_batch_size": rows,
        "samples": len(lengths),
        "samples_finished": finished,
        "generated_tokens": generated,
        "expected_tokens": sum(lengths),
        "steps": len(running),
        "peak_rows": max(running, default=0),
        "mean_rows": statistics.fmean(running) if running else 0.0,
        "saturated_steps": len(saturated),
        "peak_rows_saturated": max(saturated, default=0),
        "mean_rows_saturated": statistics.fmean(saturated) if saturated else 0.0,
        "blocks_total": usage.blocks_total,
        "peak_blocks_used": peak_used,
        "peak_blocks_shared": peak_shared,
        "preemptions": usage.preemptions - pre0,
        "wall_s": wall,
        "cpu_s": cpu,
        "tokens_per_s": generated / wall,
        "tokens_per_cpu_s": generated / cpu,
        "prompt_tokens": prompt_tokens,
        "prefill_tokens": prefill_tokens,
        "prefill_ratio": prefill_tokens / prompt_tokens,
        "resume_prefill_tokens": resumed[0],
        "prompt_prefill_ratio": (prefill_tokens - resumed[0]) / prompt_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=None, help="lengths' scale (default 1/32; --quick 1/256)")
    ap.add_argument("--groups", type=int, default=None, help="prompts (default 24; --quick 16)")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    ap.add_argument("--prompt-length", type=int, default=None, help="tokens (default 512 x scale, at least 4)")
    ap.add_argument("--budget-rows", type=int, default=None, help="KV budget in static rows (default 4; --quick 2)")
    ap.add_argument("--block-size", type=int, default=None, help="KV block tokens (default 16 x scale, a power of 2)")
    ap.add_argument("--k", type=int, default=0, help="speculation k (0: plain decoding)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default="static,paged", help="which arms to run (paged alone: long saturating runs)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared 2-core box thrashes with 2)")
    ap.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    ap.add_argument("--quick", action="store_true", help="a tiny model and workload: a seconds-long smoke run")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    scale = args.scale if args.scale is not None else (1 / 256 if args.quick else 1 / 32)
    groups = args.groups if args.groups is not None else (16 if args.quick else 24)
    budget_rows = args.budget_rows if args.budget_rows is not None else (2 if args.quick else 4)
    prompt_length = args.prompt_length if args.prompt_length is not None else max(4, round(512 * scale))
    block_size = args.block_size if args.block_size is not None else scaled_block_size(scale)
    g, k = args.group, args.k
    names = [a for a in ARMS if a in args.arms.split(",")]
    if not names or set(args.arms.split(",")) - set(ARMS):
        ap.error(f"--arms: a comma-separated subset of {','.join(ARMS)}")
    if scale <= 0 or groups < 1 or g < 1 or budget_rows < 1 or prompt_length < 1 or k < 0:
        ap.error("--scale, --groups, --group, --budget-rows and --prompt-length must be positive, --k >= 0")
    max_context = max(1, round(CAP * scale)) + prompt_length
    base = QUICK_CONFIG if args.quick else BENCH_CONFIG
    config = dataclasses.replace(base, max_position_embeddings=max(base.max_position_embeddings, max_context))
    model = build_model(config, seed=args.seed)

    lengths = draw_lengths(groups * g, scale, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, config.vocab_size, (groups, prompt_length), generator=gen).tolist()
    probe = TorchEngine(
        model, max_batch_size=1, max_context=max_context, kv_block_size=block_size, speculation_k=k, max_speculation_k=k
    )
    token_bytes = probe.drafter.token_bytes()
    slots = probe.slots_per_row  # what the static cache reserved per row: max_context + max_speculation_k + 2
    del probe
    budget = (budget_rows * blocks_for(slots, block_size) + RESERVED_BLOCKS) * block_size * token_bytes
    print(
        f"{groups} groups x G = {g} samples, prompt {prompt_length} tokens, lengths log-normal median {MEDIAN} p99 {P99} "
        f"cap {CAP} x scale {scale:g}: median {statistics.median(lengths):g}, max {max(lengths)}, total {sum(lengths)}; "
        f"max_context {max_context}; KV budget {budget / 2**20:.1f} MiB = {budget_rows} static rows of {slots} slots "
        f"({token_bytes} B a token), blocks of {block_size}; k = {k}; model hidden {config.hidden_size}, "
        f"{config.num_hidden_layers} layers; {args.threads} torch thread(s)",
        flush=True,
    )
    arms: dict[str, dict[str, Any]] = {}
    for name in names:
        arms[name] = run_arm(
            name,
            model,
            rows=budget_rows if name == "static" else PAGED_ROWS,
            budget=budget,
            max_context=max_context,
            block_size=block_size,
            k=k,
            prompts=prompts,
            lengths=lengths,
            group=g,
            seed=args.seed,
        )
        a = arms[name]
        print(f"  {name}: {a['steps']} steps, {a['wall_s']:.1f} s wall, {a['cpu_s']:.1f} s CPU", flush=True)
    both = len(arms) == 2
    ratios = {f: ratio(arms["paged"][f], arms["static"][f]) for f, _ in FIGURES} if both else {}
    lines = ["| figure | " + " | ".join(arms) + (" | paged / static |" if both else " |")]
    lines.append("|---" * (len(arms) + 1 + both) + "|")
    for f, fmt in FIGURES:
        cells = [fmt.format(a[f]) for a in arms.values()] + ([times(ratios[f])] if both else [])
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    print("\n".join(["", *lines, ""]))
    for name, a in arms.items():
        waited = (
            f"rows while requests waited: peak {a['peak_rows_saturated']}, mean {a['mean_rows_saturated']:.1f} "
            f"over {a['saturated_steps']} steps"
            if a["saturated_steps"]
            else "no request waited after the first step: the pool admitted every sample at once"
        )
        print(
            f"{name}: rows peak {a['peak_rows']}, mean {a['mean_rows']:.1f} over {a['steps']} steps; {waited}; "
            f"{a['tokens_per_s']:.1f} tokens/s ({a['tokens_per_cpu_s']:.1f} per CPU s); prefill / prompt tokens "
            f"{a['prefill_ratio']:.3f}, {a['prompt_prefill_ratio']:.3f} without the {a['resume_prefill_tokens']} "
            f"tokens of {a['preemptions']} preempted rows' resumption (1/G = {1 / g:.3f})"
        )
    if both:
        print(
            f"paged / static: rows peak {times(ratios['peak_rows'])}, mean {times(ratios['mean_rows'])} "
            f"(#48: >= 4x); tokens/s {times(ratios['tokens_per_s'])} wall, {times(ratios['tokens_per_cpu_s'])} CPU "
            f"(#48: > 1); prompt prefill {times(ratios['prompt_prefill_ratio'])} (#48: ~1/G)"
        )
    for name, a in arms.items():
        if a["samples_finished"] != a["samples"] or a["generated_tokens"] != a["expected_tokens"]:
            print(f"WARNING: the {name} arm finished {a['samples_finished']}/{a['samples']} samples", file=sys.stderr)
    if args.out is not None:
        doc = {
            "config": {
                "scale": scale,
                "groups": groups,
                "group": g,
                "prompt_length": prompt_length,
                "budget_rows": budget_rows,
                "budget_bytes": budget,
                "block_size": block_size,
                "slots_per_static_row": slots,
                "token_bytes": token_bytes,
                "max_context": max_context,
                "k": k,
                "seed": args.seed,
                "threads": args.threads,
                "quick": args.quick,
                "model": {"hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers},
                "lengths": lengths,
            },
            "arms": arms,
            "ratios": ratios,
            "table": lines,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
