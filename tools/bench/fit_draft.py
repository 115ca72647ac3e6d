#!/usr/bin/env python
"""Fit a checkpoint's MTP draft layer to the target's own outputs and save the result.

    specrl bench fit-draft IN_CHECKPOINT OUT_CHECKPOINT [--steps 60] [--sequences 48] [--new-tokens 64]
                       [--temperature 0] [--init-bigram]

Samples continuations of random prompts from the target (plain decoding), then trains MTP
layer 0 with cross-entropy on x_{t+2} from detached trunk hidden states (the trunk, the
embedding and the output head are frozen). --init-bigram first resets the layer to the
"bigram" draft (logits = lm_head(norm(embed(x_{t+1})))), a good start for a fresh head.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sidecar.model.checkpoint import load_checkpoint, model_state_dict, save_checkpoint
from sidecar.model.model import build_model
from trainer.draft.fit import DraftFitConfig, fit_draft, init_draft_from_embedding


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--sequences", type=int, default=48)
    ap.add_argument("--prompt-length", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-bigram", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    config, tensors = load_checkpoint(args.src)
    model = build_model(config)
    model.load_state_dict(tensors, strict=True)
    if args.init_bigram:
        init_draft_from_embedding(model)
    cfg = DraftFitConfig(
        num_sequences=args.sequences,
        prompt_length=args.prompt_length,
        new_tokens=args.new_tokens,
        temperature=args.temperature,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
    )
    start = time.perf_counter()

    def progress(step: int, loss: float) -> None:
        if step == 1 or step % 10 == 0 or step == cfg.steps:
            print(
                f"fit_draft: step {step}/{cfg.steps} loss {loss:.4f} ({time.perf_counter() - start:.0f}s)", flush=True
            )

    print(f"fit_draft: sampling {cfg.num_sequences} x {cfg.new_tokens} target tokens", flush=True)
    losses = fit_draft(model, cfg, progress)
    print(
        f"fit_draft: {cfg.steps} steps in {time.perf_counter() - start:.1f}s, loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    )
    save_checkpoint(args.dst, config, model_state_dict(model))
    print(f"fit_draft: wrote {args.dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
