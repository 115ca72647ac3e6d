#!/usr/bin/env python3
"""Trainer time per update at data_parallel 1 and 2 on the same batch, side by side.

Each arm is a fresh gloo group of D spawned processes (one torch thread each) that builds the same
policy (`Policy.Config(data_parallel=D)`), takes one warm-up update, then times `--steps`
updates of the same batch (`Policy.backward`: forward, backward and the DDP gradient sum; then
`Policy.step`: clipping, Muon and AdamW); rank 0 reports medians, each phase ended by a barrier,
so it counts until the slowest replica is done. Arms alternate D = 1, 2, 1, 2, ... (`--repeats` each) so that load on a shared
machine falls on both alike. Also printed: each replica's share of the batch's tokens.

    OMP_NUM_THREADS=1 specrl bench data-parallel --repeats 2 --steps 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from trainer.policy import platform


def model_config():  # type: ignore[no-untyped-def]
    from sidecar.model.model import ModelConfig

    return ModelConfig.tiny(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )


def batch(rows: int, seq: int):  # type: ignore[no-untyped-def]
    """Prompts of 16 tokens, responses of very different lengths (as RL rollouts are)."""
    from trainer.policy.policy import TrainBatch

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1024, (rows, seq), generator=gen)
    mask = torch.zeros(rows, seq - 1)
    for i in range(rows):
        length = 8 + (37 * i) % (seq - 24)
        mask[i, 15 : 15 + length] = 1.0
    return TrainBatch(tokens=tokens, mask=mask, advantages=torch.randn(rows, generator=gen))


def worker(rank: int, port: int, world: int, steps: int, rows: int, seq: int, out: str) -> None:
    torch.set_num_threads(1)
    platform.init_distributed(rank=rank, world_size=world, port=port, timeout_s=600)
    import torch.distributed as dist

    from sidecar.model.checkpoint import model_state_dict
    from sidecar.model.model import build_model
    from trainer.policy.policy import Policy

    mc = model_config()
    policy = Policy(mc, Policy.Config(data_parallel=world), model_state_dict(build_model(mc, seed=1)))
    b = batch(rows, seq)
    policy.train_step(b)  # warm-up (DDP learns its bucket order on the first backward)
    times = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        policy.backward(b)  # forward, backward and the gradient sum (train_step = backward + step)
        dist.barrier()
        t1 = time.perf_counter()
        policy.step()  # clip, Muon and AdamW on the full gradient (the same on every replica)
        dist.barrier()
        times.append((time.perf_counter() - t, t1 - t))
    if rank == 0:
        torch.save(times, out)
    dist.barrier()
    platform.teardown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=160)
    args = ap.parse_args()
    from trainer.policy.data_parallel import balanced_rows, row_lengths

    b = batch(args.rows, args.seq)
    lengths = row_lengths(b.mask)
    shares = [sum(lengths[r] for r in rows) for rows in balanced_rows(lengths, 2)]
    print(f"batch: {args.rows} rows, {sum(lengths)} tokens up to the last response token; D=2 shares {shares}")
    results: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for d in (1, 2):
                out = str(Path(tmp) / f"d{d}r{r}.pt")
                spawn_args = (platform.free_port(), d, args.steps, args.rows, args.seq, out)
                mp.start_processes(worker, args=spawn_args, nprocs=d, start_method="spawn")
                results[d] += torch.load(out)
                print(f"repeat {r}: D={d} {[round(t * 1e3) for t, _ in torch.load(out)]} ms", flush=True)

    def med(d: int, i: int) -> float:
        return statistics.median(x[i] for x in results[d]) * 1e3

    print("| D | update (median) | forward + backward + gradient sum | clip + Muon + AdamW | updates timed |")
    print("|---|---|---|---|---|")
    for d in (1, 2):
        print(f"| {d} | {med(d, 0):.0f} ms | {med(d, 1):.0f} ms | {med(d, 0) - med(d, 1):.0f} ms | {len(results[d])} |")
    print(f"D=2 / D=1 update time: x{med(2, 0) / med(1, 0):.2f}")


if __name__ == "__main__":
    main()
