"""The held-out evaluation: mean reward of greedy completions on a fixed set of problems, with
its standard error."""

from __future__ import annotations

import math
import random

from sidecar.types import GenerationRequest, SamplingParams
from trainer.rl.environments import Environment
from trainer.rl.episodes import EpisodeLimits, run_episodes
from trainer.rl.run import Run, phase
from trainer.rl.tasks import distinct_problems, prompt_ids, score_completions


def evaluate(run: Run, size: int) -> tuple[float, float]:
    """Mean reward of greedy completions (a multi-turn environment: greedy episodes' returns) on a fixed held-out set (same problems every time, no
    problem twice), and its standard error (sample std / sqrt(n)): a change smaller than ~2
    standard errors is noise."""
    problems = distinct_problems(run.task, random.Random(1_000_003 + run.cfg.seed), "eval", size)
    sampling = SamplingParams(
        temperature=0.0, max_new_tokens=run.cfg.rollout.max_new_tokens, stop_token_ids=(run.tokenizer.eos_id,)
    )
    prompts = [prompt_ids(run.task, run.tokenizer, p) for p in problems]
    if isinstance(run.task, Environment):  # greedy episodes: the mean return
        limits = EpisodeLimits(max_turns=run.cfg.task.max_turns, max_tokens=run.cfg.task.max_episode_tokens)
        with run.generating:
            episodes = run_episodes(
                run.fleet,
                run.task,
                run.tokenizer,
                problems,
                prompts,
                samples_per_prompt=1,
                sampling=sampling,
                limits=limits,
                speculation_k=run.cfg.rollout.request_k,
            )
        return mean_and_stderr(episodes.returns)
    request = GenerationRequest(prompts=prompts, sampling=sampling, speculation_k=run.cfg.rollout.request_k)
    with run.generating:
        samples = run.fleet.generate(request).samples
    rewards, _ = score_completions(
        run.task, [problems[s.prompt_index] for s in samples], [run.tokenizer.decode(s.token_ids) for s in samples]
    )
    return mean_and_stderr(rewards)


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    """Sample mean and its standard error (Bessel-corrected std / sqrt(n); 0 for n < 2)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def evaluate_logged(run: Run, progress: bool = False) -> dict[str, float]:
    """`evaluate` as metrics (reward/eval_mean, reward/eval_stderr), announced as a phase."""
    with phase(f"evaluating on {run.cfg.eval_size} held-out problems", progress):
        mean, stderr = evaluate(run, run.cfg.eval_size)
    return {"reward/eval_mean": mean, "reward/eval_stderr": stderr}
