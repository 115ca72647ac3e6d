"""What one Generate per prompt costs against one per sidecar.

`Fleet.generate` sends each prompt as its own Generate call (its seed derived from the prompt's
global index, so samples do not depend on how the fleet split the work). The trainer's fan-out
before it sent one call per sidecar holding all of that sidecar's prompts. Both are timed here
side by side (alternating, same sidecars, same prompts, fresh seeds per round) on local `specrl
serve` processes: "per sidecar" is that old split, driven through `SidecarClient` directly.

    specrl bench fleet-split [--prompts 4 16] [--samples 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from sidecar.client.fleet import Fleet
from sidecar.model.model import ModelConfig
from sidecar.types import GenerationRequest, SamplingParams
from trainer.rl.local_sidecars import LocalSidecars
from trainer.rl.tasks import ArithmeticTask
from trainer.rl.warmup import make_model
from trainer.tokenizer import CharTokenizer


def per_sidecar(fleet: Fleet, request: GenerationRequest) -> float:
    """The old split: prompts round-robin over the sidecars, one Generate per sidecar."""
    start = time.perf_counter()
    clients = fleet.live()
    shards = [list(range(len(request.prompts)))[i :: len(clients)] for i in range(len(clients))]
    with ThreadPoolExecutor(max_workers=len(clients)) as pool:
        calls = [
            pool.submit(c.generate, replace(request, prompts=[request.prompts[p] for p in shard]))
            for c, shard in zip(clients, shards, strict=True)
            if shard
        ]
        n = sum(len(f.result()) for f in calls)
    assert n == len(request.prompts) * request.samples_per_prompt
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sidecars", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    task, tok = ArithmeticTask(regime="zero", digits=2), CharTokenizer()
    config = ModelConfig.tiny(
        vocab_size=tok.vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=8,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", config, seed=0)
        with LocalSidecars(model, args.sidecars, Path(tmp) / "logs") as local, Fleet(local.start()) as fleet:
            print(f"{args.sidecars} local sidecars, model {config.num_hidden_layers}x{config.hidden_size}, k=3")
            print("| prompts x G | per sidecar median s | per prompt (Fleet) median s | ratio |")
            print("|---|---|---|---|")
            for n in args.prompts:
                prompts = [tok.encode(task.sample(rng, "train").prompt) for _ in range(n)]
                base = GenerationRequest(
                    prompts=prompts,
                    sampling=SamplingParams(temperature=1.0, max_new_tokens=40, seed=0),
                    samples_per_prompt=args.samples,
                    speculation_k=3,
                )
                fleet.generate(base)  # warm up
                old: list[float] = []
                new: list[float] = []
                for r in range(args.repeats):
                    request = replace(base, sampling=replace(base.sampling, seed=r + 1))
                    for mode in ("old", "new") if r % 2 == 0 else ("new", "old"):
                        if mode == "old":
                            old.append(per_sidecar(fleet, request))
                        else:
                            new.append(fleet.generate(request).seconds)
                o, w = statistics.median(old), statistics.median(new)
                print(f"| {n} x {args.samples} | {o:.3f} | {w:.3f} | {w / o:.2f} |")


if __name__ == "__main__":
    main()
