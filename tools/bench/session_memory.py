"""Trainer-side peak memory of one weight update through the incremental session, per model size.

For each model size: a real `specrl serve` on a random checkpoint of that size; then, in a fresh
trainer process holding the model, the peak RSS (VmHWM after resetting it through
/proc/self/clear_refs) above the RSS with the model loaded, for
  session: `WeightUpdateSession`, one `send(name, param)` per parameter (what the TRL adapter does);
  gather:  the control, a state-dict copy gathered first and then pushed (what an adapter must do
           when the protocol needs every tensor at once), which costs ~1x the model.
Both push the whole target to a sidecar that serves it, so the two rows are the same update.

    specrl bench session-memory [--hidden 256 512 1024 2048] [--layers 4] [--vocab 8192]

Linux only (VmHWM). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(checkpoint: str, address: str, mode: str, version: int) -> None:
    """One update from a fresh process; prints JSON {baseline, peak, model_bytes}."""
    import torch

    torch.set_num_threads(1)
    from sidecar.client.client import SidecarClient
    from sidecar.integrations.weight_session import WeightUpdateSession
    from sidecar.model.checkpoint import load_checkpoint
    from sidecar.model.model import build_model
    from sidecar.types import WeightSelector

    config, tensors = load_checkpoint(checkpoint)
    model = build_model(config)
    model.load_state_dict(tensors, strict=True)
    del tensors
    from sidecar.server.memory import release_freed_memory

    release_freed_memory()
    client = SidecarClient(address)
    specs, _ = client.describe_weights(WeightSelector.TARGET)
    names = {s.name for s in specs}
    params = [(n, p) for n, p in model.named_parameters() if n in names]
    model_bytes = sum(p.numel() * p.element_size() for _, p in params)
    baseline = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    if mode == "session":
        with WeightUpdateSession(client, version=version, selector=WeightSelector.TARGET, specs=specs) as session:
            for name, p in params:
                session.send(name, p.data)
    else:
        gathered = {n: p.detach().clone() for n, p in params}
        client.push_weights(gathered, version, WeightSelector.TARGET)
        del gathered
    peak = _status_kib("VmHWM")
    print(json.dumps({"baseline_kib": baseline, "peak_kib": peak, "model_bytes": model_bytes}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--child", nargs=4, metavar=("CKPT", "ADDR", "MODE", "VERSION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.child[2], int(args.child[3]))
        return

    import torch

    from sidecar.model.checkpoint import model_state_dict, save_checkpoint
    from sidecar.model.model import ModelConfig, build_model
    from tests.with_trl.serve import ServeProcess

    env = dict(os.environ, OMP_NUM_THREADS="1")
    print("| hidden | target MiB | mode | trainer peak above model-loaded RSS (MiB) | peak / model |")
    print("|---:|---:|---|---:|---:|")
    for hidden in args.hidden:
        heads = max(hidden // 64, 2)
        config = ModelConfig(
            vocab_size=args.vocab,
            hidden_size=hidden,
            intermediate_size=3 * hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=heads,
            num_key_value_heads=heads // 2 if heads % 2 == 0 else heads,
            head_dim=64 if hidden >= 128 else hidden // heads,
            max_position_embeddings=512,
            rope_theta=10_000.0,
        )
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = Path(tmp) / f"h{hidden}"
            model = build_model(config, seed=0)
            save_checkpoint(ckpt, config, model_state_dict(model))
            del model
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
            serve = ServeProcess(ckpt, speculation_k=0)
            try:
                for version, mode in enumerate(("session", "gather", "session", "gather"), start=1):  # A/B
                    out = subprocess.run(
                        [sys.executable, __file__, "--child", str(ckpt), serve.address, mode, str(version)],
                        env=env,
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    mib = r["model_bytes"] / 2**20
                    extra = (r["peak_kib"] - r["baseline_kib"]) / 1024
                    print(f"| {hidden} | {mib:.0f} | {mode} | {extra:.1f} | {extra / mib:.2f} |", flush=True)
            finally:
                serve.stop()


if __name__ == "__main__":
    main()
