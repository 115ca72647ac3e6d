#!/usr/bin/env python
"""How the start of a grafted MTP layer matters once draft-init has fitted it (#61).

    specrl bench graft-starts [--model tiny|demo] [--starts hidden,embedding,half,both,random] [--prompts 32]
                          [--threads 1] [--out DIR]

`specrl draft-init` on a checkpoint without MTP layers grafts one (`trainer.draft.mtp_graft`: decoder
layer copied from the trunk's last, eh_proj passing the hidden state, "hidden" below) and fits it.
This warms a model up on the arithmetic task (no MTP layer), then for each start grafts, fits with
draft-init's budget and measures τ at k = 3 on held-out prompts, at temperature 1 (the demo's) and
greedily. The figures are docs/checkpoints.md's table ("Grafting an MTP layer").

Starts (the decoder layer is the trunk's last in all but "random"): eh_proj = [embedding | hidden]
blocks "hidden" [0 | I], "embedding" [I | 0], "half" [I/2 | I/2], "both" [I | I]; "random": every
draft tensor normal(0, 0.02), norms one (what a fresh MTP head gets).

Models: "tiny" is the RL-loop tests' (2 layers, width 64), warmed up 150 steps, fitted with
draft-init's defaults (256 prompts, 200 steps); "demo" the demo's (24 layers, width 128), warmed
up 100 steps, fitted with the demo's draft-init (512 prompts, 120 steps, chain depth 4) — a few
minutes per start on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sidecar.model.model import ModelConfig
from trainer.cli.demo import demo_model_config
from trainer.draft.mtp_graft import graft_mtp_layer
from trainer.rl import warmup
from trainer.rl.tasks import ArithmeticTask
from trainer.tokenizer import CharTokenizer

TASK, TOK = ArithmeticTask(regime="zero", digits=2), CharTokenizer()
SETUPS = {  # model, warm-up steps, draft-init config, max new tokens when measuring
    "tiny": (
        ModelConfig.tiny(
            vocab_size=TOK.vocab_size,
            hidden_size=64,
            intermediate_size=192,
            max_position_embeddings=128,
            tie_word_embeddings=True,
            num_nextn_predict_layers=0,
        ),
        150,
        warmup.DraftInitConfig(prompts=256),
        24,
    ),
    "demo": (
        dataclasses.replace(demo_model_config(24), num_nextn_predict_layers=0),
        100,
        warmup.DraftInitConfig(prompts=512, steps=120, lr=3e-3, chain_depth=4),
        40,
    ),
}


Graft = Callable[[ModelConfig, dict[str, Tensor]], tuple[ModelConfig, dict[str, Tensor]]]


def start(name: str) -> Graft:
    """A graft function that starts the layer as `name` says (module docstring)."""

    def graft(config: ModelConfig, tensors: dict[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
        grafted, out = graft_mtp_layer(config, tensors)
        h, eh = config.hidden_size, out["mtp.layers.0.eh_proj.weight"]
        eye = torch.eye(h, dtype=eh.dtype)
        blocks = {"hidden": (0.0, 1.0), "embedding": (1.0, 0.0), "half": (0.5, 0.5), "both": (1.0, 1.0)}
        if name in blocks:
            e, s = blocks[name]
            out["mtp.layers.0.eh_proj.weight"] = torch.cat([e * eye, s * eye], dim=1)
        elif name == "random":
            gen = torch.Generator().manual_seed(0)
            for n, t in out.items():
                if n.startswith("mtp."):
                    out[n] = torch.ones_like(t) if t.ndim == 1 else torch.randn(t.shape, generator=gen) * 0.02
        else:
            raise SystemExit(f"unknown start {name!r}: use hidden, embedding, half, both or random")
        return grafted, out

    return graft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SETUPS), default="tiny")
    parser.add_argument("--starts", default="hidden,embedding,half,both,random")
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts τ is measured on")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="keep the checkpoints here (default: temp)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config, warm_steps, fit, max_new = SETUPS[args.model]
    root = args.out or Path(tempfile.mkdtemp(prefix="graft-starts-"))
    warmup.make_model(root / "init", config, seed=0)
    cfg = warmup.WarmupConfig(steps=warm_steps, batch_size=32, lr=3e-3)
    warmup.supervised_warmup(root / "init", root / "warm", TASK, TOK, cfg)
    rng = random.Random(5)
    prompts = [TOK.encode(TASK.sample(rng, "eval").prompt) for _ in range(args.prompts)]
    print(f"model {args.model}; τ at k = 3 on {args.prompts} held-out prompts")
    print("start       loss first -> last   τ (T = 1)   τ (greedy)")
    real = warmup.graft_mtp_layer
    try:
        for name in args.starts.split(","):
            warmup.graft_mtp_layer = start(name)  # type: ignore[assignment]  # draft_init's graft, started otherwise
            losses = warmup.draft_init(root / "warm", root / name, TASK, TOK, fit)
            tau = [
                warmup.acceptance_length(
                    root / name, prompts, k=3, temperature=t, max_new_tokens=max_new, stop=TOK.eos_id
                )
                for t in (1.0, 0.0)
            ]
            print(f"{name:<10}  {losses[0]:.3f} -> {losses[-1]:.3f}     {tau[0]:.2f}        {tau[1]:.2f}", flush=True)
    finally:
        warmup.graft_mtp_layer = real


if __name__ == "__main__":
    main()
