"""Trainer step costs, measured side by side in one run (medians of repeats).

Ratios reported:
- draft-training overhead: Policy.train_step with the MTP draft loss over the same step without it;
- Megatron log-prob recomputation over the engine's plain reference forward (same weights, batch);
- weight export (naming contract, one tensor at a time) per step.

    specrl bench trainer --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch


def _time_s(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    from sidecar.model.checkpoint import model_state_dict
    from sidecar.model.model import ModelConfig, build_model
    from trainer.draft.objective import DraftConfig
    from trainer.policy.policy import Policy, TrainBatch

    mc = ModelConfig.tiny(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
        max_position_embeddings=max(4096, args.seq),
    )
    engine = build_model(mc, seed=0)
    state = model_state_dict(engine)
    tokens = torch.randint(0, mc.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(args.batch, args.seq - 1)
    mask[:, args.seq // 4 :] = 1.0
    batch = TrainBatch(tokens=tokens, mask=mask, advantages=torch.randn(args.batch))

    with_draft = Policy(mc, Policy.Config(draft=DraftConfig(train=True)), dict(state))
    without = Policy(mc, Policy.Config(draft=DraftConfig(train=False)), dict(state))
    print(
        f"model: hidden {mc.hidden_size}, {mc.num_hidden_layers} layers, vocab {mc.vocab_size}, 1 MTP layer; "
        f"batch {args.batch} x {args.seq} tokens; {torch.get_num_threads()} threads; median of {args.repeats}"
    )
    sides: list[Callable[[], object]] = [
        lambda: with_draft.train_step(batch),
        lambda: without.train_step(batch),
        lambda: without.logprobs(tokens),
        lambda: engine(tokens),
        lambda: sum(t.numel() for _, t in with_draft.export_named_tensors()),
    ]
    with torch.no_grad():
        for fn in sides[2:]:
            fn()  # warm-up (the train steps warm up in the first repeat, which the median discounts)
    # Interleave the sides repeat by repeat so machine noise hits all of them alike.
    t_with, t_without, t_lp, t_engine, t_export = [], [], [], [], []
    for _ in range(args.repeats):
        t_with.append(_time_s(sides[0]))
        t_without.append(_time_s(sides[1]))
        t_lp.append(_time_s(sides[2]))
        with torch.no_grad():
            t_engine.append(_time_s(sides[3]))
        t_export.append(_time_s(sides[4]))
    med = statistics.median
    print(f"train_step with draft    {med(t_with) * 1e3:8.1f} ms")
    print(
        f"train_step without draft {med(t_without) * 1e3:8.1f} ms   draft overhead x{med(t_with) / med(t_without):.3f}"
    )
    print(f"megatron logprobs        {med(t_lp) * 1e3:8.1f} ms")
    print(f"engine plain forward     {med(t_engine) * 1e3:8.1f} ms   megatron/engine x{med(t_lp) / med(t_engine):.3f}")
    print(f"export_named_tensors     {med(t_export) * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
