#!/usr/bin/env python3
"""Measure: the fraction of served weights whose bit pattern changes per RL step (issue 20).

A sparse delta push pays only if few served-dtype elements change per step. Whether an optimizer
update survives rounding to the served dtype depends on its size against the weight's unit in the
last place, so this runs the demo's RL steps (the demo's policy, task, `demo_config`'s prompts x G samples,
GRPO loss, trunk + MTP draft update) for each optimizer (the Muon/AdamW hybrid the trainer uses,
and AdamW on every tensor) at two learning rates:

- "demo": the demo's rates (trunk 3e-4, draft 1e-3);
- "real": the same update-to-weight ratio as lr 1e-6 on a 7B-class model. Adam-type updates are
  ~lr per element (and Muon's, with match_adamw_rms, the same RMS), so the ratio is lr / weight
  RMS. 7B-class hidden matrices have RMS ~0.02 (the usual init std 0.02, which RL leaves nearly
  unchanged), so ratio = 1e-6 / 0.02 = 5e-5; the small model's lr is 5e-5 x the RMS of its own 2-D
  hidden weights (measured here and printed), for trunk and draft alike.

After every step it exports the weights the trainer would push, casts them to the served dtype
(bfloat16 and float32 both), and counts the elements whose bit pattern differs from the previous
step's, per tensor kind (attention, MLP, norms, embeddings, MTP draft). It also sizes the delta
payload (per tensor the smaller of an index list and a bitmask, see sidecar/weight_transport/delta.py)
against the dense push. Rollouts are sampled in-process from the trainer's own policy (the same
distribution the sidecars sample; sidecars are not needed to measure weight change).

    specrl bench weight-change --policy /tmp/i20/policy --steps 12

`--policy` is a demo policy checkpoint (`specrl demo` writes one under OUT/policy); without it the
tool runs the demo's warm-up and draft initialisation first (minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

KINDS = ("attention", "mlp", "norms", "embeddings", "mtp")


def kind_of(name: str) -> str:
    """Tensor kind of a contract (Hugging Face Qwen3) name."""
    if name.startswith("mtp."):
        return "mtp"
    if "embed_tokens" in name or "lm_head" in name:
        return "embeddings"
    if "norm" in name:
        return "norms"
    if "self_attn" in name:
        return "attention"
    if "mlp" in name:
        return "mlp"
    raise ValueError(f"no kind for tensor {name!r}")


def served_bits(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The served-dtype bit patterns (as integers) of every tensor."""
    as_int = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[dtype]
    return {n: t.detach().to(dtype).contiguous().view(as_int).reshape(-1).clone() for n, t in tensors.items()}


def generate(policy, prompt: list[int], g: int, max_new: int, eos: int, gen: torch.Generator) -> list[list[int]]:
    """G samples of one prompt at temperature 1 from the trainer's policy (no KV cache: small model)."""
    from trainer.policy import gpt

    tokens = torch.tensor([prompt] * g, dtype=torch.long)
    done = torch.zeros(g, dtype=torch.bool)
    out: list[list[int]] = [[] for _ in range(g)]
    policy.model.eval()
    with torch.no_grad():
        for _ in range(max_new):
            logits, _ = gpt.forward(policy.model, tokens)
            nxt = torch.multinomial(torch.softmax(logits[:, -1].float(), -1), 1, generator=gen)
            tokens = torch.cat([tokens, nxt], 1)
            for i in range(g):
                if not done[i]:
                    out[i].append(int(nxt[i]))
                    done[i] = int(nxt[i]) == eos
            if bool(done.all()):
                break
    return out


def hidden_rms(policy) -> float:
    """RMS over the trunk's 2-D hidden matrices (attention and MLP) of the exported weights."""
    sq, n = 0.0, 0
    for name, t in policy.export_named_tensors():
        if t.ndim == 2 and kind_of(name) in ("attention", "mlp"):
            sq += float(t.double().pow(2).sum())
            n += t.numel()
    return (sq / n) ** 0.5


def build_policy(policy_dir: Path, optimizer: str, lr_mode: str, seed: int):
    """(policy, (trunk lr, draft lr), hidden RMS) for one configuration."""
    from muon import HybridOptimizerConfig
    from trainer.policy.policy import Policy
    from trainer.rl.config import demo_config

    demo = demo_config(policy_dir, Path("/dev/null"))
    route: dict[str, Any] = {"hybrid": {}, "adamw": {"adamw_name_patterns": ("",)}}[optimizer]  # "" matches every name

    def build(trunk_lr: float, draft_lr: float) -> Policy:
        return Policy.from_checkpoint(
            policy_dir,
            Policy.Config(
                seed=seed,
                temperature=demo.rollout.temperature,
                grpo=demo.algorithm,
                optimizer=HybridOptimizerConfig(lr=trunk_lr, **route),
                draft=dataclasses.replace(
                    demo.draft, train=True, optimizer=HybridOptimizerConfig(lr=draft_lr, **route)
                ),
            ),
        )

    policy = build(demo.optimizer.lr, demo.draft.optimizer.lr)
    rms = hidden_rms(policy)
    if lr_mode == "real":
        lr = 1e-6 / 0.02 * rms
        policy = build(lr, lr)
        lrs = (lr, lr)
    else:
        lrs = (demo.optimizer.lr, demo.draft.optimizer.lr)
    return policy, lrs, rms


def rl_steps(policy, steps: int, seed: int, rewards: list[float]) -> Iterator[int]:
    """The demo's RL steps on `policy` (rollouts sampled in-process); yields after each update."""
    from trainer.policy.losses import sample_advantages
    from trainer.policy.policy import TrainBatch
    from trainer.rl.config import demo_config
    from trainer.rl.tasks import ArithmeticTask
    from trainer.tokenizer import CharTokenizer

    demo = demo_config(Path("unused"), Path("/dev/null"))
    task, tok = ArithmeticTask(regime="zero", digits=2), CharTokenizer()
    ro = demo.rollout
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        rng = random.Random(seed * 1_000_003 + step)
        problems = [task.sample(rng, "train") for _ in range(ro.prompts_per_step)]
        prompts = [tok.encode(p.prompt) for p in problems]
        responses = [
            r for p in prompts for r in generate(policy, p, ro.samples_per_prompt, ro.max_new_tokens, tok.eos_id, gen)
        ]
        r = torch.tensor(
            [task.reward(problems[i // ro.samples_per_prompt], tok.decode(resp)) for i, resp in enumerate(responses)]
        ).view(ro.prompts_per_step, ro.samples_per_prompt)
        rewards.append(float(r.mean()))
        adv, keep = sample_advantages(r, demo.algorithm)
        batch = TrainBatch.from_sequences(
            [prompts[i // ro.samples_per_prompt] for i in range(len(responses))], responses, adv, pad_id=tok.pad_id
        )
        batch.mask = batch.mask * keep.float()[:, None]
        policy.train_step(batch)
        yield step


def run_one(policy_dir: Path, optimizer: str, lr_mode: str, steps: int, seed: int) -> dict:
    from sidecar.weight_transport.delta import encoded_delta_bytes

    policy, lrs, rms = build_policy(policy_dir, optimizer, lr_mode, seed)
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    prev = {d: served_bits(dict(policy.export_named_tensors()), dt) for d, dt in dtypes.items()}
    # per (dtype, kind): per-step changed fraction; per dtype: per-step (delta bytes, dense bytes)
    frac: dict[str, dict[str, list[float]]] = {d: defaultdict(list) for d in dtypes}
    wire: dict[str, list[tuple[int, int]]] = {d: [] for d in dtypes}
    rewards: list[float] = []
    for _ in rl_steps(policy, steps, seed, rewards):
        now = dict(policy.export_named_tensors())
        for d, dt in dtypes.items():
            cur = served_bits(now, dt)
            changed: dict[str, int] = defaultdict(int)
            total: dict[str, int] = defaultdict(int)
            delta_b = dense_b = 0
            for name, bits in cur.items():
                diff = int((bits != prev[d][name]).sum())
                changed[kind_of(name)] += diff
                total[kind_of(name)] += bits.numel()
                size = bits.element_size()
                dense_b += bits.numel() * size
                delta_b += min(bits.numel() * size, encoded_delta_bytes(bits.numel(), diff, size))
            for k in total:
                frac[d][k].append(changed[k] / total[k])
            frac[d]["all"].append(sum(changed.values()) / sum(total.values()))
            wire[d].append((delta_b, dense_b))
            prev[d] = cur
    return {
        "optimizer": optimizer,
        "lr_mode": lr_mode,
        "trunk_lr": lrs[0],
        "draft_lr": lrs[1],
        "hidden_rms": rms,
        "reward_mean": statistics.mean(rewards),
        "frac": {d: {k: statistics.median(v) for k, v in kinds.items()} for d, kinds in frac.items()},
        "frac_max": {d: {k: max(v) for k, v in kinds.items()} for d, kinds in frac.items()},
        "wire_ratio": {d: statistics.median(dense / delta for delta, dense in w) for d, w in wire.items()},
    }


def push_bench(policy_dir: Path, lr_mode: str, steps: int, seed: int, transport: str, work: Path) -> dict:
    """Dense against delta pushes of the same weights in one run: per served dtype, two sidecars
    (in this process, grpc or shm) start from the policy; after every RL step (Muon hybrid) one
    gets the dense push and the other the delta push, in alternating order; bytes received and
    push seconds (client side, the delta's encoding included) per step. At the end the delta
    sidecar's parameters must hash (sha256) to the trainer's served-dtype copy."""
    import dataclasses
    import hashlib
    import time

    from sidecar.client.client import ClientConfig, SidecarClient
    from sidecar.client.transport import TransportConfig
    from sidecar.engine.torch_engine import TorchEngine
    from sidecar.model.checkpoint import load_checkpoint, save_checkpoint
    from sidecar.server.grpc_server import ServerConfig
    from sidecar.server.process import Sidecar, SidecarConfig

    def digest(tensors: dict[str, torch.Tensor]) -> str:
        h = hashlib.sha256()
        for n in sorted(tensors):
            h.update(n.encode())
            h.update(tensors[n].detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    policy, lrs, _ = build_policy(policy_dir, "hybrid", lr_mode, seed)
    config, tensors = load_checkpoint(policy_dir)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    sidecars, clients = {}, {}
    for d in dtypes:
        ckpt = work / f"policy-{d}"
        save_checkpoint(ckpt, dataclasses.replace(config, torch_dtype=d), tensors)
        for mode in ("dense", "delta"):
            torch_engine = TorchEngine.from_checkpoint(ckpt, speculation_k=3)
            sc = Sidecar(torch_engine, SidecarConfig(server=ServerConfig(port=0), shutdown_grace_s=1.0)).start()
            sidecars[d, mode] = sc
            cfg = ClientConfig(transports=TransportConfig(shm=transport == "shm"), sparse_deltas=mode == "delta")
            clients[d, mode] = SidecarClient(sc.address, cfg)
    rows: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
    try:

        def push_all(version: int, order: tuple[str, str]) -> None:
            exported = dict(policy.export_named_tensors())
            for d, dt in dtypes.items():
                state = {n: t.detach().to(dt).contiguous() for n, t in exported.items()}
                for mode in order:
                    t0 = time.perf_counter()
                    r = clients[d, mode].push_weights(state, version)
                    if version > 1:
                        rows[d, mode].append((r.bytes_received, time.perf_counter() - t0))
            last_state.clear()
            last_state.update(exported)

        last_state: dict[str, torch.Tensor] = {}
        push_all(1, ("dense", "delta"))  # first contact: both full
        rewards: list[float] = []
        for step in rl_steps(policy, steps, seed, rewards):
            push_all(step + 2, ("dense", "delta") if step % 2 == 0 else ("delta", "dense"))
        exact = {}
        for d, dt in dtypes.items():
            want = digest({n: t.detach().to(dt) for n, t in last_state.items()})
            engine = sidecars[d, "delta"].scheduler._engine
            assert isinstance(engine, TorchEngine)
            exact[d] = digest({n: p.detach() for n, p in engine.model.named_parameters()}) == want
    finally:
        for c in clients.values():
            c.close()
        for sc in sidecars.values():
            sc.stop()
    out: dict = {"lr_mode": lr_mode, "trunk_lr": lrs[0], "draft_lr": lrs[1], "transport": transport, "exact": exact}
    for (d, mode), vals in rows.items():
        out[f"{d}/{mode}/bytes"] = statistics.median(b for b, _ in vals)
        out[f"{d}/{mode}/seconds"] = statistics.median(t for _, t in vals)
    return out


def render_push(results: list[dict], steps: int) -> str:
    lines = [
        f"median over {steps} RL steps (Muon hybrid) of one push to one sidecar, dense and delta side by side",
        "",
        "| lr (trunk / draft) | transport | served dtype | dense bytes | delta bytes | ratio | dense s | delta s | "
        "delta sidecar sha256 = trainer's |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for d in ("float32", "bfloat16"):
            db, xb = r[f"{d}/dense/bytes"], r[f"{d}/delta/bytes"]
            lines.append(
                f"| {r['lr_mode']} {r['trunk_lr']:.2g} / {r['draft_lr']:.2g} | {r['transport']} | {d} | {db:,.0f} | "
                f"{xb:,.0f} | {db / xb:.1f}x | {r[f'{d}/dense/seconds']:.3f} | {r[f'{d}/delta/seconds']:.3f} | "
                f"{'yes' if r['exact'][d] else 'NO'} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", type=Path, help="demo policy checkpoint (default: run the demo's warm-up first)")
    ap.add_argument("--steps", type=int, default=12, help="RL steps per configuration (the demo runs 12)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/measure-weight-change"))
    ap.add_argument("--push", action="store_true", help="benchmark dense against delta pushes instead")
    ap.add_argument("--transport", choices=("grpc", "shm"), default="grpc", help="transport of --push")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # OPTIMIZER:LRMODE, run in a child process
    args = ap.parse_args()
    if args.one:
        opt, mode = args.one.split(":")
        if args.push:
            args.out.mkdir(parents=True, exist_ok=True)
            print(json.dumps(push_bench(args.policy, mode, args.steps, args.seed, args.transport, args.out)))
        else:
            print(json.dumps(run_one(args.policy, opt, mode, args.steps, args.seed)))
        return
    if args.policy is None:
        from trainer.cli.demo import DemoConfig, demo_model_config
        from trainer.rl.tasks import ArithmeticTask
        from trainer.rl.warmup import draft_init, make_model, supervised_warmup
        from trainer.tokenizer import CharTokenizer

        cfg = DemoConfig()
        task, tok = ArithmeticTask(regime="zero", digits=2), CharTokenizer()
        make_model(args.out / "init", demo_model_config(cfg.layers), seed=0)
        supervised_warmup(args.out / "init", args.out / "warm", task, tok, cfg.warmup)
        draft_init(args.out / "warm", args.out / "policy", task, tok, cfg.draft_init)
        args.policy = args.out / "policy"
    results = []
    for opt in ("hybrid",) if args.push else ("hybrid", "adamw"):
        for mode in ("demo", "real"):
            # one process per configuration: megatron's parallel state is set up once per process
            cmd = [sys.executable, __file__, "--policy", str(args.policy), "--steps", str(args.steps)]
            cmd += ["--seed", str(args.seed), "--one", f"{opt}:{mode}", "--out", str(args.out)]
            cmd += ["--push", "--transport", args.transport] if args.push else []
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), file=sys.stderr)
    print(render_push(results, args.steps) if args.push else render(results, args.steps))


def render(results: list[dict], steps: int) -> str:
    names = {"hybrid": "Muon (hybrid)", "adamw": "AdamW"}
    lines = [
        f"median over {steps} RL steps of the fraction of elements whose served-dtype bits changed in one step",
        "",
        "| optimizer | lr (trunk / draft) | served dtype | attention | MLP | norms | embeddings | MTP | all | dense/delta bytes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for d in ("bfloat16", "float32"):
            f = r["frac"][d]
            cells = " | ".join(f"{100 * f.get(k, 0.0):.2f}%" for k in (*KINDS, "all"))
            lines.append(
                f"| {names[r['optimizer']]} | {r['lr_mode']} {r['trunk_lr']:.2g} / {r['draft_lr']:.2g} | {d} | "
                f"{cells} | {r['wire_ratio'][d]:.1f}x |"
            )
    lines.append("")
    lines.append(f"hidden-matrix weight RMS of the policy: {results[0]['hidden_rms']:.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
