#!/usr/bin/env python
"""Speculation on a mixture of experts against a dense model of equal active parameters, on CPU.

    specrl bench moe [--batches 1,16,64] [--k 3] [--new-tokens 32] [--repeats 3] [--routes]

Two models of one shape, scaled down from Qwen3-30B-A3B for a CPU (hidden 128, 4 layers, 8/2
heads): an MoE of 32 experts, top 4, expert width 128, and a dense model whose MLP is as wide as
the 4 active experts together (512), so a token multiplies the same number of parameters in both.
Both get one MTP layer that follows its target by construction (the trunk's residual branches
scaled towards a bigram model, as `specrl bench engine step`), so the two accept alike. At each batch B
the engine generates plain and with k drafts, one torch thread, alternating MoE / dense and plain /
k `--repeats` times (medians of CPU seconds per generated token); printed: each model's k / plain
throughput ratio, τ, and for the MoE the experts a round reads — measured from the router's choices
in the verify forwards (distinct experts per sparse layer, averaged) beside the uniform-routing
prediction E·(1 − (1 − top/E)^T) for T = B·(k + 1) tokens (`sidecar.speculation.expert_union`).
The CPU reference path runs one SwiGLU per active expert, so a round's MoE cost grows with the
union as a GPU's weight reads do (the mechanism is not the same: on a CPU the per-expert operator
calls, on a GPU the bytes).

`--routes`: instead, the cost of returning routes (`GenerationRequest.routes`): the MoE alone at each
B, plain and with k drafts, routes "off" against "sequence" (every prompt and generated position's
experts recorded in the prefill and the verify passes, copied to the host, kept per row), alternating
`--repeats` times: medians of CPU seconds per generated token side by side, and the median of the
per-repeat ratios (each repeat runs both arms back to back).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from sidecar.engine.torch_engine import TorchEngine  # noqa: E402
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model  # noqa: E402
from sidecar.model.moe import MoEConfig, Router  # noqa: E402
from sidecar.speculation.expert_union import uniform_union  # noqa: E402
from sidecar.types import GenerationRequest, SamplingParams  # noqa: E402

EXPERTS, TOP, WIDTH = 32, 4, 128
SHAPE = dict(
    vocab_size=256,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    num_nextn_predict_layers=1,
)


def models() -> dict[str, Qwen3WithMTP]:
    moe = MoEConfig(num_experts=EXPERTS, num_experts_per_tok=TOP, moe_intermediate_size=WIDTH, norm_topk_prob=True)
    return {
        "moe": aligned(
            build_model(
                ModelConfig.tiny(
                    **SHAPE, intermediate_size=TOP * WIDTH, architectures=["Qwen3MoeForCausalLM"], moe=moe
                ),
                seed=0,
            )
        ),
        "dense": aligned(build_model(ModelConfig.tiny(**SHAPE, intermediate_size=TOP * WIDTH), seed=0)),
    }


def aligned(model: Qwen3WithMTP, eps: float = 0.002) -> Qwen3WithMTP:
    """The trunk nearly a bigram model, its MTP layer the same bigram (high acceptance, not 1);
    routers scaled up so routing is decisive."""
    h = model.config.hidden_size
    with torch.no_grad():
        for layer in [*model.model.layers, *model.mtp.layers]:
            layer.self_attn.o_proj.weight.mul_(eps)
            for name, p in layer.mlp.named_parameters():
                if name.endswith("down_proj.weight"):
                    p.mul_(eps if layer in model.model.layers else 0.0)
                if name == "gate.weight":
                    p.mul_(4.0)
        for mtp in model.mtp.layers:
            mtp.eh_proj.weight.zero_()
            mtp.eh_proj.weight[:, :h] = torch.eye(h)
            mtp.self_attn.o_proj.weight.zero_()
    return model


class UnionProbe:
    """Distinct experts per router call, grouped by the call's token count (forward hooks)."""

    def __init__(self, model: Qwen3WithMTP) -> None:
        self.seen: dict[int, list[int]] = {}
        self.handles = [
            m.register_forward_hook(self._hook)
            for layer in model.model.layers
            for m in layer.modules()
            if isinstance(m, Router)
        ]

    def _hook(
        self, module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        ids = out[1]
        self.seen.setdefault(ids.shape[0], []).append(int(ids.unique().numel()))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def generate(engine: TorchEngine, b: int, k: int, new: int, routes: str = "off") -> tuple[float, float]:
    """(CPU seconds per generated token, τ) of one generation of `b` prompts."""
    prompts = torch.randint(0, SHAPE["vocab_size"], (b, 16), generator=torch.Generator().manual_seed(b)).tolist()
    sp = SamplingParams(temperature=0.0, max_new_tokens=new, stop_at_eos=False)
    start = time.process_time()
    samples = engine.generate(GenerationRequest(prompts=prompts, sampling=sp, speculation_k=k, routes=routes))
    seconds = time.process_time() - start
    tokens = sum(len(s.token_ids) for s in samples)
    steps = sum(s.counters.verify_steps for s in samples)
    return seconds / tokens, tokens / max(steps, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--routes", action="store_true", help="the cost of returning routes, off against sequence")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    built = models()
    if args.routes:
        return routes_cost(TorchEngine(built["moe"], speculation_k=args.k, max_batch_size=max(args.batches)), args)
    engines = {
        name: TorchEngine(m, speculation_k=args.k, max_batch_size=max(args.batches)) for name, m in built.items()
    }
    print(
        "| B | model | plain ms/token | k ms/token | k / plain throughput | tau | experts read, measured | predicted |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for b in args.batches:
        for e in engines.values():  # warm-up
            generate(e, b, 0, 4)
            generate(e, b, args.k, 4)
        times: dict[tuple[str, int], list[float]] = {}
        taus: dict[str, float] = {}
        for r in range(args.repeats):
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for name in order:
                for k in (0, args.k) if r % 2 == 0 else (args.k, 0):
                    t, tau = generate(engines[name], b, k, args.new_tokens)
                    times.setdefault((name, k), []).append(t)
                    if k:
                        taus[name] = tau
        probe = UnionProbe(built["moe"])
        generate(engines["moe"], b, args.k, args.new_tokens)  # untimed: the routes of its rounds
        probe.close()
        width = b * (args.k + 1)
        verify = [n for t, ns in probe.seen.items() if t == width for n in ns]
        for name in engines:
            plain, spec = (statistics.median(times[(name, k)]) for k in (0, args.k))
            union = (
                f"{statistics.mean(verify):.1f} of {EXPERTS} ({len(verify)} forwards)"
                if name == "moe" and verify
                else "-"
            )
            predicted = f"{uniform_union(EXPERTS, TOP, width):.1f}" if name == "moe" else "-"
            print(
                f"| {b} | {name} | {plain * 1e3:.3f} | {spec * 1e3:.3f} | {plain / spec:.2f}x | {taus[name]:.2f} "
                f"| {union} | {predicted} |",
                flush=True,
            )
    return 0


def routes_cost(engine: TorchEngine, args: argparse.Namespace) -> int:
    """The MoE's ms/token with routes off and "sequence", side by side (the module docstring)."""
    print("| B | k | routes off ms/token | routes sequence ms/token | sequence / off, median of per-repeat ratios |")
    print("|---|---|---|---|---|")
    for b in args.batches:
        for k in (0, args.k):
            generate(engine, b, k, 4, "sequence")  # warm-up
            times: dict[str, list[float]] = {"off": [], "sequence": []}
            for r in range(args.repeats):
                for mode in ("off", "sequence") if r % 2 == 0 else ("sequence", "off"):
                    times[mode].append(generate(engine, b, k, args.new_tokens, mode)[0])
            off, on = (statistics.median(times[m]) for m in ("off", "sequence"))
            ratio = statistics.median(s / o for s, o in zip(times["sequence"], times["off"], strict=True))
            print(f"| {b} | {k} | {off * 1e3:.3f} | {on * 1e3:.3f} | {ratio:.3f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
