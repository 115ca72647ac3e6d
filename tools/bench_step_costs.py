#!/usr/bin/env python
"""Per-step costs of static k at one batch size, and where an end-to-end run spends them.

    tools/bench_step_costs.py [--model DIR] [--batch 4] [--temperature 1] [--new-tokens 48] [--repeats 4]

Why: the adaptive controller predicts a step's cost as draft + verify at the current batch size;
this shows the measured parts (thread CPU ms, medians): the draft phase, the verify forward and
the whole decode step for k = 0..3, per batch size the run passed through (rows finish at
different steps under speculation, so a batch of B ends with steps at fewer rows), and the
end-to-end CPU seconds of each k (k interleaved, order alternating per repeat). The timing hooks
wrap `torch_engine.draft` / `verify` / `TorchEngine._decode` of this process only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_adaptive import run
from bench_engine import BENCH_CONFIG, ensure_bench_checkpoint

from sidecar.engine import torch_engine
from sidecar.types import SamplingParams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("/tmp/specrl-bench-engine-model"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ensure_bench_checkpoint(args.model)
    clock = time.thread_time
    phases: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)  # (rows, k) -> (draft, verify)
    steps: dict[tuple[int, int], list[float]] = defaultdict(list)  # (rows, k) -> whole decode step
    draft_s: list[float] = []
    real_draft, real_verify, real_decode = torch_engine.draft, torch_engine.verify, torch_engine.TorchEngine._decode

    def draft(*a, **kw):
        t = clock()
        out = real_draft(*a, **kw)
        draft_s.append(clock() - t)
        return out

    def verify(model, cache, inp, rows):
        t = clock()
        out = real_verify(model, cache, inp, rows)
        b, width = inp.tokens.shape
        phases[(b, width - 1)].append((draft_s.pop() if draft_s else 0.0, clock() - t))
        return out

    def decode(self):
        key = (len(self._running), max(s.k for s in self._running))
        t = clock()
        out = real_decode(self)
        steps[key].append(clock() - t)
        return out

    torch_engine.draft, torch_engine.verify = draft, verify
    torch_engine.TorchEngine._decode = decode  # type: ignore[method-assign]
    engine = torch_engine.TorchEngine.from_checkpoint(args.model, speculation_k=0, max_speculation_k=3)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, BENCH_CONFIG.vocab_size, (args.batch, 16), generator=gen).tolist()]
    sp = SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens, seed=3)
    run(engine, prompts, sp, 1)  # warm up
    phases.clear()
    steps.clear()
    total: dict[int, list[float]] = defaultdict(list)
    for r in range(args.repeats):
        for k in [0, 1, 2, 3] if r % 2 == 0 else [3, 2, 1, 0]:
            total[k].append(run(engine, prompts, sp, k)[0])
    print("| rows | k | steps | draft ms | verify ms | whole step ms |")
    print("|---|---|---|---|---|---|")
    for (b, k), v in sorted(steps.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        ph = phases[(b, k)]  # empty where every step at this width ended in its prefill (very short runs)
        draft = f"{1e3 * statistics.median(d for d, _ in ph):.2f}" if ph else "-"
        verify = f"{1e3 * statistics.median(x for _, x in ph):.2f}" if ph else "-"
        print(f"| {b} | {k} | {len(v)} | {draft} | {verify} | {1e3 * statistics.median(v):.2f} |")
    plain = statistics.median(total[0])
    print(
        "\nend to end (CPU s, median): "
        + ", ".join(
            f"k={k} {statistics.median(v):.3f} s ({plain / statistics.median(v):.2f}x)"
            for k, v in sorted(total.items())
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
