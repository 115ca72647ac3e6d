"""τ (acceptance length) per TRL GRPOTrainer step when TRL never updates the MTP draft.

Real TRL 1.16 GRPOTrainer (.venv-trl) trains the tiny Qwen3 + MTP checkpoint of
tests/with_trl/tiny_model.py through a real `specrl serve` (k = 2); every step pushes the policy
(selector TARGET), the draft stays as it was at step 0. Prints τ per step (from the sidecar's raw
counters of that step's rollouts), for each learning rate, side by side; with --align also with
`DraftAligner` (the draft refitted to the policy on the latest rollouts after every sync).

    .venv-trl/bin/python -m tools.bench trl-tau [--steps 30] [--lr 3e-3 1e-2] [--align]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, nargs="+", default=[3e-3, 1e-2])
    parser.add_argument("--align", action="store_true", help="also run each lr with DraftAligner")
    parser.add_argument("--align-steps", type=int, default=20, help="Adam steps per refit")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from sidecar.integrations.draft_alignment import DraftAlignConfig, DraftAligner
    from sidecar.integrations.trl import SidecarGenerationConfig, SpecrlVLLMClient
    from tests.with_trl.serve import ServeProcess
    from tests.with_trl.test_grpo import MISMATCH, per_step, train
    from tests.with_trl.tiny_model import build_tiny_checkpoint

    rows: dict[str, tuple[list[float], list[float]]] = {}
    runs = [(lr, align) for lr in args.lr for align in ((False, True) if args.align else (False,))]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_tiny_checkpoint(Path(tmp) / "ckpt")
        for lr, align in runs:
            serve = ServeProcess(ckpt, speculation_k=2)
            try:
                client = SpecrlVLLMClient(serve.address, SidecarGenerationConfig(seed=0))
                aligner = DraftAligner(ckpt, DraftAlignConfig(steps=args.align_steps)) if align else None
                out = Path(tmp) / f"out-{lr}-{align}"
                trainer = train(ckpt, client, out, lr=lr, steps=args.steps, draft_aligner=aligner)
                label = f"lr {lr:g}" + (", aligned" if align else "")
                rows[label] = ([c.acceptance_length for c in client.counters], per_step(trainer, MISMATCH))
            finally:
                serve.stop()
    print("| step | " + " | ".join(f"τ ({label}) | mismatch max ({label})" for label in rows) + " |")
    print("|---:|" + "---:|---:|" * len(rows))
    for step in range(args.steps):
        cells = []
        for taus, mism in rows.values():
            cells.append(f"{taus[step]:.3f}" if step < len(taus) else "")
            cells.append(f"{mism[step]:.2e}" if step < len(mism) else "")
        print(f"| {step} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
