#!/usr/bin/env python3
"""Benchmark: the demo workload's generation through `specrl serve --engine sglang` vs `--engine torch`.

Two sidecars on the same draft-initialised demo policy (a `tools/demo` / `trainer.cli.demo` output's
``policy`` directory), both on this machine's CPU with one thread, both speculating with k = 3;
requests of the demo's rollout shape (4 arithmetic prompts × 4 samples, max 40 new tokens, stop at
EOS) go to them alternately (A/B, then B/A), `--repeats` times; medians of wall seconds per request,
tokens/s and τ from the samples' counters.

What it measures, honestly: GREEDY generation (temperature 0). The demo samples at temperature 1,
but SGLang 0.5.23 verifies drafts greedily on CPU, so the SGLang sidecar refuses temperature > 0
with speculation there (README, "The SGLang engine"). And on CPU SGLang's speculative attention
and tree ops are the plain-PyTorch reference ops of tests/sglang_cpu_support/ (Python loops per
sequence), not SGLang's real CPU kernels: this compares our embedded engine with SGLang's
scheduler running test scaffolding, not SGLang's production speed. Run it with .venv-sglang:

    SGLANG_USE_CPU_ENGINE=1 .venv-sglang/bin/python -m tools.bench sglang-serve --policy DIR --repeats 5
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sidecar.client.client import SidecarClient
from sidecar.types import GenerationRequest, SamplingParams
from tests.with_sglang.served import specrl_serve
from trainer.rl.tasks import ArithmeticTask
from trainer.tokenizer import CharTokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", type=Path, required=True, help="the demo's draft-initialised policy checkpoint")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    task, tok = ArithmeticTask(regime="zero", digits=2), CharTokenizer()
    rng = random.Random(7)
    sp = SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=[tok.eos_id])
    work = Path(tempfile.mkdtemp(prefix="bench-sglang-"))
    policy = work / "policy"
    shutil.copytree(args.policy, policy)  # SGLang's export is written next to the checkpoint
    times: dict[str, list[float]] = {"torch": [], "sglang": []}
    tokens: dict[str, list[int]] = {"torch": [], "sglang": []}
    taus: dict[str, list[float]] = {"torch": [], "sglang": []}
    with (
        specrl_serve(policy, speculation_k=3, engine="torch") as torch_addr,
        specrl_serve(policy, speculation_k=3, engine="sglang") as sglang_addr,
        SidecarClient(torch_addr) as t,
        SidecarClient(sglang_addr) as s,
    ):
        clients = {"torch": t, "sglang": s}
        for rep in range(args.repeats + 1):  # the first round warms both up and is not counted
            prompts = [tok.encode(task.sample(rng, "eval").prompt) for _ in range(4)]
            order = ["torch", "sglang"] if rep % 2 == 0 else ["sglang", "torch"]
            outs = {}
            for name in order:
                req = GenerationRequest(prompts=prompts, sampling=sp, samples_per_prompt=4)
                start = time.perf_counter()
                outs[name] = clients[name].generate(req, timeout_s=600)
                if rep:
                    times[name].append(time.perf_counter() - start)
            assert [x.token_ids for x in outs["torch"]] == [x.token_ids for x in outs["sglang"]], (
                "greedy outputs differ"
            )
            if rep:
                for name, samples in outs.items():
                    tokens[name].append(sum(len(x.token_ids) for x in samples))
                    taus[name].append(statistics.mean(x.counters.acceptance_length for x in samples))
    for name in ("torch", "sglang"):
        med = statistics.median(times[name])
        print(
            f"{name:6s}: median {med:.3f} s/request, {statistics.median(tokens[name]) / med:.1f} tokens/s, "
            f"tau {statistics.median(taus[name]):.2f} (n={len(times[name])})"
        )
    ratio = statistics.median(b / a for a, b in zip(times["torch"], times["sglang"], strict=True))
    print(f"sglang/torch wall-time ratio per request (median of paired runs): {ratio:.2f}")


if __name__ == "__main__":
    main()
