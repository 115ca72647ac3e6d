#!/usr/bin/env python
"""How many engine steps the adaptive controller's acceptance estimate takes to settle after a push.

    specrl bench adaptive settle [--model DIR]

The benchmark model of specrl bench engine (built there), 8 rows at temperature 1, k = 3 every
step; after 60 steps a draft-only push scrambles the MTP layer (acceptance collapses), then 40 more
steps. For each `version_discount` (1.0 = no reset ... 0.0 = hard reset) prints position-1
acceptance before and after, and the engine steps until the estimate stays within 10% of the
change. Why it matters: an RL push barely moves acceptance (BENCHMARKS.md), but a stale or broken
draft must show within a few steps.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sidecar.engine.torch_engine import TorchEngine
from sidecar.speculation.config import SpeculationControllerConfig
from sidecar.speculation.controller import SpeculationController
from sidecar.types import GenerationRequest, SamplingParams, WeightSelector


class FixedK3(SpeculationController):
    """The controller's acceptance estimate, k = 3 every step."""

    def decide(self, batch, tokens_left=None, rows=None):
        d = super().decide(batch, tokens_left, rows)
        d.k = 3
        return d


def settle(model: Path, discount: float) -> str:
    """One run at `discount`: acceptance before and after the push, and the steps it takes to settle."""
    engine = TorchEngine.from_checkpoint(model, speculation_k=3, max_speculation_k=3, max_batch_size=8)
    pol = FixedK3(SpeculationControllerConfig(max_speculation_k=3, version_discount=discount))
    engine.set_speculation_controller(pol)
    gen = torch.Generator().manual_seed(5)
    sp = SamplingParams(temperature=1.0, max_new_tokens=400, seed=1)
    engine.submit(
        GenerationRequest(prompts=torch.randint(0, 4096, (8, 16), generator=gen).tolist(), sampling=sp, request_id="a")
    )
    for _ in range(60):
        engine.step()
    before = pol.acceptance.rates()[0]
    # push: the same target, a draft broken (MTP output projection scrambled)
    names = {t.name for t in engine.weight_specs(WeightSelector.DRAFT)}
    sd = {n: t.clone() for n, t in engine.model.state_dict().items() if n in names}
    g2 = torch.Generator().manual_seed(9)
    for n in sd:
        if sd[n].ndim == 2:
            sd[n] = sd[n][torch.randperm(sd[n].shape[0], generator=g2)]
    engine.update_weights(sd, WeightSelector.DRAFT, version=1)
    trace = []
    for _ in range(40):
        engine.step()
        trace.append(pol.acceptance.rates()[0])
    final = sum(trace[-10:]) / 10
    steps = next(
        i + 1
        for i in range(len(trace))
        if all(abs(t - final) < 0.1 * max(before - final, 1e-9) + 0.02 for t in trace[i:])
    )
    return (
        f"discount {discount}: alpha_1 before push {before:.2f}, after {final:.2f}; estimate within 10% of the change after {steps} engine steps; trace "
        + " ".join(f"{t:.2f}" for t in trace[:12])
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        type=Path,
        default=Path("/tmp/specrl-bench-engine-model"),
        help="built by `specrl bench engine` (the bench model)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for discount in (1.0, 0.05, 0.01, 0.0):
        print(settle(args.model, discount), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
