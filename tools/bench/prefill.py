#!/usr/bin/env python
"""Admission of a GRPO group: G samples of one prompt prefilled once, against G prefills.

    specrl bench prefill [--group 8] [--prompt-length 512] [--ks 0,3] [--repeats 5] [--threads 1]

The engine admits a group (one request, one prompt, `--group` samples) in one step: the target's
prefill of the prompt, its KV, the draft's prefill (k > 0), each sample's first token and its rows
added to the paged cache (sharing the prompt's full blocks). Shared: the engine as it is, which prefills the prompt once
(`TorchEngine._admit`). Separate: the same step over `--group` different prompts of the same
length, one sample each — the work the engine did for a group before it shared prompts (a forward's
cost does not depend on its tokens' values). Both run interleaved in one process, `--repeats`
times; the table gives median CPU milliseconds of the admitting step per group (this thread's CPU
time: the box is shared), their ratio, and the stats' prefill_tokens / prompt_tokens.

The model: specrl bench engine's (hidden 512, 12 layers, 8/4 heads, vocab 4096, one MTP
layer, context 1024) with random weights: admission's cost does not depend on their values.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sidecar.engine.config import EngineConfig
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.model import build_model
from sidecar.types import GenerationRequest, SamplingParams
from tools.bench.engine import BENCH_CONFIG


def admit(engine: TorchEngine, request: GenerationRequest) -> float:
    """CPU seconds of the step that admits `request` (then drains it, untimed)."""
    engine.submit(request)
    start = time.thread_time()
    engine.step()
    seconds = time.thread_time() - start
    while engine.has_work():
        engine.step()
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    ap.add_argument("--prompt-length", type=int, default=512)
    ap.add_argument("--ks", default="0,3", help="draft lengths (k > 0: the MTP draft's prefill is part of admission)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared 2-core box thrashes with 2)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    g, n = args.group, args.prompt_length
    if n + 2 > BENCH_CONFIG.max_position_embeddings:
        ap.error(f"--prompt-length must be <= {BENCH_CONFIG.max_position_embeddings - 2}")
    engine = TorchEngine(
        build_model(BENCH_CONFIG, seed=0),
        speculation_k=min(EngineConfig().speculation_k, max(ks)),  # the default k, within the largest asked for
        max_speculation_k=max(ks),
        max_batch_size=g,
    )
    gen = torch.Generator().manual_seed(0)
    vocab = BENCH_CONFIG.vocab_size
    sp = SamplingParams(temperature=1.0, max_new_tokens=2, seed=1, stop_at_eos=False)
    print(f"G = {g}, prompt {n} tokens, bench_engine's model, {args.threads} torch thread(s), {args.repeats} repeats")
    print("| k | separate (G prefills), ms | shared (1 prefill), ms | separate / shared | prefill / prompt tokens |")
    print("|---|---|---|---|---|")
    for k in ks:
        times: dict[str, list[float]] = {"separate": [], "shared": []}
        shared_tokens = (0, 0)
        for r in range(args.repeats + 1):  # the first round warms up
            prompt = torch.randint(0, vocab, (n,), generator=gen).tolist()
            requests = {
                "shared": GenerationRequest(
                    prompts=[prompt], sampling=sp, samples_per_prompt=g, speculation_k=k, request_id=f"shared-{k}-{r}"
                ),
                "separate": GenerationRequest(
                    prompts=torch.randint(0, vocab, (g, n), generator=gen).tolist(),
                    sampling=sp,
                    speculation_k=k,
                    request_id=f"separate-{k}-{r}",
                ),
            }
            for mode in ("shared", "separate") if r % 2 else ("separate", "shared"):
                before = engine.stats()[-1]
                prompt_before, prefill_before = before.prompt_tokens, before.prefill_tokens
                seconds = admit(engine, requests[mode])
                if r:
                    times[mode].append(seconds)
                after = engine.stats()[-1]
                if mode == "shared":
                    shared_tokens = (after.prefill_tokens - prefill_before, after.prompt_tokens - prompt_before)
        sep, sh = statistics.median(times["separate"]), statistics.median(times["shared"])
        print(
            f"| {k} | {1e3 * sep:.0f} | {1e3 * sh:.0f} | {sep / sh:.2f}x | {shared_tokens[0]} / {shared_tokens[1]} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
