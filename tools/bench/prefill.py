#!/usr/bin/env python
"""Admission of a GRPO group: G samples of one prompt prefilled once, against G prefills.

    specrl bench prefill [--group 8] [--prompt-length 512] [--ks 0,3] [--repeats 5] [--threads 1]

The engine admits a group (one request, one prompt, `--group` samples) in one step: the target's
prefill of the prompt, its KV, the draft's prefill (k > 0), each sample's first token and its rows
added to the paged cache (sharing the prompt's full blocks). Shared: the engine as it is, which prefills the prompt once
(`TorchEngine._admit`). Separate: the same step over `--group` different prompts of the same
length, one sample each — the work the engine did for a group before it shared prompts (a forward's
cost does not depend on its tokens' values). Both run interleaved in one process, `--repeats`
times; the table gives median CPU milliseconds of the admitting step per group (this thread's CPU
time: the box is shared), their ratio, and the stats' prefill_tokens / prompt_tokens.

The model: specrl bench engine's (hidden 512, 12 layers, 8/4 heads, vocab 4096, one MTP
layer, context 1024) with random weights: admission's cost does not depend on their values.

    specrl bench prefill --multi-turn [--problems 4] [--group 8] [--turns 4] [--tool-tokens 30]
                           [--max-new-tokens 24] [--k 2] [--repeats 3] [--threads 1]

Multi-turn (the prefix cache, docs/engine.md): `trainer.rl.episodes.run_episodes` over two real
in-process sidecars, G conversations of each problem, each turn `--max-new-tokens` of the policy
then a tool's output of `--tool-tokens` tokens (a scripted tool: the episode never ends early), so
every turn sends the whole history. Three arms side by side in one run, interleaved, `--repeats`
times: the prefix cache with sessions pinned (specrl's default), no prefix cache, and the cache
with the sessions dropped (the fleet then splits each turn's prompts over the sidecars, round
robin). Per turn: prompt tokens sent, tokens the sidecars' prefills computed and took from the
cache (GetStats), the hit rate; per arm the generated tokens per second of wall time (median over
repeats). The model: the bench model with the character tokenizer's vocabulary (99).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sidecar.client.fleet import Fleet, FleetResult
from sidecar.engine.config import EngineConfig
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.model import build_model
from sidecar.server.grpc_server import ServerConfig
from sidecar.server.process import Sidecar, SidecarConfig
from sidecar.types import GenerationRequest, RequestLimits, SamplingParams
from tools.bench.engine import BENCH_CONFIG
from trainer.rl.environments import Feedback
from trainer.rl.episodes import EpisodeLimits, run_episodes
from trainer.rl.tasks import Problem
from trainer.tokenizer import CharTokenizer


def admit(engine: TorchEngine, request: GenerationRequest) -> float:
    """CPU seconds of the step that admits `request` (then drains it, untimed)."""
    engine.submit(request)
    start = time.thread_time()
    engine.step()
    seconds = time.thread_time() - start
    while engine.has_work():
        engine.step()
    return seconds


class ToolEpisode:
    """A scripted tool: answers every turn with `tokens` characters derived from the turn, never done."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def step(self, turn: str) -> Feedback:
        digest = hashlib.blake2b(turn.encode(), digest_size=32).hexdigest()
        return Feedback(observation=("\n<tool>" + digest * 4)[: self.tokens])


@dataclasses.dataclass
class ToolEnvironment:
    """The multi-turn workload's environment (`trainer.rl.environments.Environment`)."""

    tokens: int
    name: str = "bench-tool"
    stop: tuple[str, ...] = ("]",)

    def sample(self, rng: random.Random, split: str) -> Problem:
        return Problem(prompt=f"Problem {rng.randrange(10**6)}: plan, call tools, answer.\n", answer="")

    def reset(self, problem: Problem) -> ToolEpisode:
        return ToolEpisode(self.tokens)


class MeteredFleet:
    """A `Fleet` whose every call records, per turn, what the sidecars' prefills computed and took
    from the prefix cache (their GetStats before and after); `pinned` False drops the sessions."""

    def __init__(self, fleet: Fleet, pinned: bool) -> None:
        self.fleet, self.pinned = fleet, pinned
        self.turns: list[tuple[int, int, int, int, float]] = []  # prompt, prefill, hit, generated tokens, seconds

    def _served(self) -> tuple[int, int]:
        prefill = hits = 0
        for c in self.fleet.live():
            for v in c.stats().versions:
                prefill, hits = prefill + v.prefill_tokens, hits + v.prefix_cache_hit_tokens
        return prefill, hits

    def generate(self, request: GenerationRequest, *, rejoin: bool = True) -> FleetResult:
        if not self.pinned:
            request = dataclasses.replace(request, session_ids=[])
        before = self._served()
        result = self.fleet.generate(request, rejoin=rejoin)
        after = self._served()
        prompt = sum(len(p) for p in request.prompts) * request.samples_per_prompt
        generated = sum(len(s.token_ids) for s in result.samples)
        self.turns.append((prompt, after[0] - before[0], after[1] - before[1], generated, result.seconds))
        return result

    def end_sessions(self, session_ids: list[str]) -> None:
        self.fleet.end_sessions(session_ids)


ARMS = {"cache, pinned": (True, True), "no cache": (False, True), "cache, round robin": (True, False)}


def multi_turn(args: argparse.Namespace) -> int:
    """The multi-turn workload's three arms (module docstring)."""
    tok = CharTokenizer()
    config = dataclasses.replace(BENCH_CONFIG, vocab_size=tok.vocab_size)
    model = build_model(config, seed=0)
    env = ToolEnvironment(args.tool_tokens)
    rng = random.Random(0)
    problems = [env.sample(rng, "train") for _ in range(args.problems)]
    prompts = [tok.encode(p.prompt) for p in problems]
    limits = EpisodeLimits(max_turns=args.turns, max_tokens=config.max_position_embeddings - 8)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=3, stop_at_eos=False)
    rows = args.problems * args.group
    per_turn: dict[str, list[list[tuple[int, int, int, int, float]]]] = {arm: [] for arm in ARMS}
    for r in range(args.repeats + 1):  # the first round warms up
        order = list(ARMS) if r % 2 else list(reversed(ARMS))
        for arm in order:
            cache, pinned = ARMS[arm]
            sidecars = [
                Sidecar(
                    TorchEngine(model, speculation_k=args.k, max_batch_size=rows, prefix_cache=cache),
                    SidecarConfig(
                        server=ServerConfig(port=0),
                        limits=RequestLimits(max_prompts=rows, max_samples=rows, max_prompt_tokens=1024),
                    ),
                ).start()
                for _ in range(2)
            ]
            try:
                with Fleet([s.address for s in sidecars]) as fleet:
                    metered = MeteredFleet(fleet, pinned)
                    run_episodes(
                        metered,  # type: ignore[arg-type]
                        env,
                        tok,
                        problems,
                        prompts,
                        samples_per_prompt=args.group,
                        sampling=sampling,
                        limits=limits,
                        speculation_k=args.k,
                    )
            finally:
                for s in sidecars:
                    s.stop(0)
            if r:
                per_turn[arm].append(metered.turns)
    print(
        f"{args.problems} problems x G = {args.group}, {args.turns} turns of {args.max_new_tokens} tokens, tool "
        f"outputs of {args.tool_tokens} tokens, k = {args.k}, 2 sidecars, {args.threads} torch thread(s), "
        f"{args.repeats} repeats"
    )
    print("| arm | turn | prompt tokens | prefilled | from cache | hit rate |")
    print("|---|---|---|---|---|---|")
    for arm, runs in per_turn.items():
        for t, turn in enumerate(runs[0]):
            prompt, prefill, hit = turn[0], turn[1], turn[2]
            rate = hit / (hit + prefill) if hit + prefill else 0.0
            print(f"| {arm} | {t + 1} | {prompt} | {prefill} | {hit} | {rate:.2f} |")
    print("\n| arm | prefilled tokens, all turns | hit rate, turns 2+ | generated tokens/s (median) |")
    print("|---|---|---|---|")
    for arm, runs in per_turn.items():
        prefill = sum(t[1] for t in runs[0])
        later = [t for t in runs[0][1:]]
        hits, computed = sum(t[2] for t in later), sum(t[1] for t in later)
        speed = statistics.median(sum(t[3] for t in run) / sum(t[4] for t in run) for run in runs)
        print(f"| {arm} | {prefill} | {hits / max(hits + computed, 1):.2f} | {speed:.0f} |", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--multi-turn", action="store_true", help="the multi-turn workload (the prefix cache)")
    ap.add_argument("--problems", type=int, default=4, help="multi-turn: problems (one session each)")
    ap.add_argument("--turns", type=int, default=4, help="multi-turn: policy turns per conversation")
    ap.add_argument("--tool-tokens", type=int, default=30, help="multi-turn: tokens of each tool output")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="multi-turn: tokens of each policy turn")
    ap.add_argument("--k", type=int, default=2, help="multi-turn: draft length")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    ap.add_argument("--prompt-length", type=int, default=512)
    ap.add_argument("--ks", default="0,3", help="draft lengths (k > 0: the MTP draft's prefill is part of admission)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared 2-core box thrashes with 2)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.multi_turn:
        return multi_turn(args)
    ks = [int(k) for k in args.ks.split(",")]
    g, n = args.group, args.prompt_length
    if n + 2 > BENCH_CONFIG.max_position_embeddings:
        ap.error(f"--prompt-length must be <= {BENCH_CONFIG.max_position_embeddings - 2}")
    engine = TorchEngine(
        build_model(BENCH_CONFIG, seed=0),
        speculation_k=min(EngineConfig().speculation_k, max(ks)),  # the default k, within the largest asked for
        max_speculation_k=max(ks),
        max_batch_size=g,
    )
    gen = torch.Generator().manual_seed(0)
    vocab = BENCH_CONFIG.vocab_size
    sp = SamplingParams(temperature=1.0, max_new_tokens=2, seed=1, stop_at_eos=False)
    print(f"G = {g}, prompt {n} tokens, bench_engine's model, {args.threads} torch thread(s), {args.repeats} repeats")
    print("| k | separate (G prefills), ms | shared (1 prefill), ms | separate / shared | prefill / prompt tokens |")
    print("|---|---|---|---|---|")
    for k in ks:
        times: dict[str, list[float]] = {"separate": [], "shared": []}
        shared_tokens = (0, 0)
        for r in range(args.repeats + 1):  # the first round warms up
            prompt = torch.randint(0, vocab, (n,), generator=gen).tolist()
            requests = {
                "shared": GenerationRequest(
                    prompts=[prompt], sampling=sp, samples_per_prompt=g, speculation_k=k, request_id=f"shared-{k}-{r}"
                ),
                "separate": GenerationRequest(
                    prompts=torch.randint(0, vocab, (g, n), generator=gen).tolist(),
                    sampling=sp,
                    speculation_k=k,
                    request_id=f"separate-{k}-{r}",
                ),
            }
            for mode in ("shared", "separate") if r % 2 else ("separate", "shared"):
                before = engine.stats()[-1]
                prompt_before, prefill_before = before.prompt_tokens, before.prefill_tokens
                seconds = admit(engine, requests[mode])
                if r:
                    times[mode].append(seconds)
                after = engine.stats()[-1]
                if mode == "shared":
                    shared_tokens = (after.prefill_tokens - prefill_before, after.prompt_tokens - prompt_before)
        sep, sh = statistics.median(times["separate"]), statistics.median(times["shared"])
        print(
            f"| {k} | {1e3 * sep:.0f} | {1e3 * sh:.0f} | {sep / sh:.2f}x | {shared_tokens[0]} / {shared_tokens[1]} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
