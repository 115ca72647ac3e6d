#!/usr/bin/env python
"""The speculation controller's own CPU time per decode step, by batch size and length caps.

    specrl bench adaptive controller [--batches 1,8,64,128,256] [--caps 2000-4000] [--calls 200]

`SpeculationController.decide` runs on the engine's thread before every automatic-mode decode step
and `may_draft` at every admission, so their time adds to each step (on a GPU, while the device
waits for the next launch). For each batch size the controller is taught a synthetic workload
(costs that grow with k and the batch, acceptance ~0.75 per position, a stop token at ~output
position 30), then timed on a batch whose rows are at output positions 0-100 with
(a) one length cap for every row (a fixed max_new_tokens) and (b) a cap per row drawn from
--caps (a client that sets max_new_tokens per prompt, e.g. context length minus prompt length).
Microseconds per call, median of 5 rounds of --calls calls. Compare revisions by running this
file with PYTHONPATH pointing at a `git worktree` of the other one.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from sidecar.speculation.config import RowState, SpeculationControllerConfig
from sidecar.speculation.controller import SpeculationController


def taught(batch: int, max_speculation_k: int, rng: random.Random) -> SpeculationController:
    """A controller after 400 steps of a synthetic workload at this batch size (every k measured)."""
    policy = SpeculationController(SpeculationControllerConfig(max_speculation_k=max_speculation_k))
    for step in range(400):
        k = step % (max_speculation_k + 1)
        accepted = []
        for _ in range(batch):
            a = 0
            while a < k and rng.random() < 0.75:
                a += 1
            accepted.append(a)
        start = step % 32
        policy.observe_acceptance([k] * batch, accepted)
        policy.observe_step(
            batch=batch,
            k=k,
            draft_seconds=0.001 * k,
            step_seconds=0.01 + 0.002 * k + 0.0001 * batch,
            tokens=batch + sum(accepted),
            chosen=True,
            catch_up=False,
            ended=batch if start == 30 else 0,
            rows=[(start, 1 + a, start == 30) for a in accepted],
        )
    return policy


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(rounds)


def time_batch(batch: int, max_speculation_k: int, low: int, high: int, calls: int) -> tuple[float, float, float]:
    """Microseconds of decide with one cap, decide with a cap per row, may_draft with a cap per row."""
    rng = random.Random(batch)
    policy = taught(batch, max_speculation_k, rng)
    positions = [rng.randint(0, 100) for _ in range(batch)]
    shared = [RowState(p, left=high - p) for p in positions]
    own = [RowState(p, left=rng.randint(low, high) - p) for p in positions]
    return (
        per_call_us(lambda: policy.decide(batch, high, shared), calls),
        per_call_us(lambda: policy.decide(batch, high, own), calls),
        per_call_us(lambda: policy.may_draft(batch, high, own, joining=max(batch // 2, 1), prompt_tokens=100), calls),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64,128,256")
    ap.add_argument("--caps", default="2000-4000", help="LOW-HIGH: the per-row caps' range (tokens)")
    ap.add_argument("--max-speculation-k", type=int, default=6)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    try:
        low, high = (int(x) for x in args.caps.split("-"))
    except ValueError:
        ap.error(f"--caps must be LOW-HIGH in tokens, e.g. 2000-4000, got {args.caps!r}")
    if not 101 <= low <= high:
        ap.error(f"--caps needs 101 <= LOW <= HIGH (rows sit at output positions 0-100), got {args.caps!r}")
    print("| batch | decide, one cap (us) | decide, a cap per row (us) | may_draft, a cap per row (us) |")
    print("|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        one, each, admit = time_batch(batch, args.max_speculation_k, low, high, args.calls)
        print(f"| {batch} | {one:.0f} | {each:.0f} | {admit:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
