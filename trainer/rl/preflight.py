"""Checks that run before anything expensive: a bad run config fails in a second, not after minutes.

Megatron takes seconds to build and local sidecars tens of seconds to start; a typo in a reward
function's name, a tokenizer that does not fit the model, or an unreachable sidecar would
otherwise surface only after that (as a traceback). `preflight(cfg)` builds everything cheap first — the
model's config.json, the tokenizer, the task with its reward function (imported *and called* on a
real problem), the parallel layout — and asks remote sidecars for their model, so that each
problem is one `PreflightError` naming the key to change.
"""

from __future__ import annotations

import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from sidecar.errors import SpecrlError
from sidecar.model.architectures import UnsupportedConfigError
from sidecar.model.model import ModelConfig
from trainer.rl.config import RLConfig
from trainer.rl.environments import Environment, Feedback, stop_token_ids
from trainer.rl.tasks import DatasetTask, Problem, ProblemSource, Task, prompt_ids, rows_message
from trainer.rl.trackers import check_trackers
from trainer.tokenizer import Tokenizer, TokenizerMismatchError, model_tokenizer


class PreflightError(SpecrlError):
    """The run config cannot work; the message names the key and the fix."""


@dataclass(kw_only=True, slots=True)
class Prepared:
    """What preflight built and checked (the loop uses these instead of building them again)."""

    model_config: ModelConfig
    tokenizer: Tokenizer
    task: Task | Environment


def preflight(cfg: RLConfig, *, probe_sidecars: bool = True) -> Prepared:
    """Check `cfg` against the model, tokenizer, task and (remote) sidecars; raise PreflightError."""
    model_config = read_model_config(cfg.model)
    tokenizer = _tokenizer(cfg, model_config)
    _speculation(cfg, model_config)
    task = _task(cfg, tokenizer, model_config)
    _experts(cfg, model_config)
    _parallel_layout(cfg, model_config)
    if cfg.algorithm.kl_coef > 0 and cfg.reference_model is not None:
        reference = read_model_config(cfg.reference_model)
        if reference != model_config:
            raise PreflightError(
                f"reference_model={cfg.reference_model} has a different model config than model={cfg.model}; "
                "the KL penalty compares the two token by token: give a checkpoint of the same model"
            )
    if cfg.draft.eagle3 is not None:
        from sidecar.errors import CheckpointError
        from sidecar.model.eagle3_checkpoint import load_eagle3_draft

        try:
            load_eagle3_draft(cfg.draft.eagle3, target=model_config)
        except (CheckpointError, ValueError) as e:
            raise PreflightError(f"draft.eagle3={cfg.draft.eagle3}: {e}") from None
    problems = check_trackers(cfg.trackers)
    if problems:
        raise PreflightError("; ".join(problems))
    if probe_sidecars and cfg.sidecars.addresses:
        check_sidecars(cfg, model_config)
    return Prepared(model_config=model_config, tokenizer=tokenizer, task=task)


def read_model_config(path: Path) -> ModelConfig:
    """The checkpoint's ModelConfig from config.json alone (the weights are read later, once)."""
    path = Path(path)
    if not path.is_dir():
        raise PreflightError(f"model: checkpoint directory {path} does not exist; set model=DIR (or --model)")
    config_path = path / "config.json"
    try:
        raw = json.loads(config_path.read_text())
        config = ModelConfig.from_hf_dict(raw)
    except FileNotFoundError:
        raise PreflightError(f"model: {config_path} is missing; a checkpoint needs config.json") from None
    except UnsupportedConfigError as e:
        raise PreflightError(f"model={path}: {e}") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise PreflightError(f"model: {config_path} is not a valid model config ({e!r})") from None
    if not any(path.glob("*.safetensors")):
        raise PreflightError(f"model: {path} holds no *.safetensors weights")
    return config


def _tokenizer(cfg: RLConfig, model: ModelConfig) -> Tokenizer:
    return checked_tokenizer(cfg.tokenizer, cfg.model, model, key="tokenizer")


def checked_tokenizer(spec: str | None, model_dir: Path, model: ModelConfig, *, key: str) -> Tokenizer:
    """`model_tokenizer` (the model's own by default), checked against the model's vocabulary;
    PreflightError naming `key` (the config key or CLI option that chose it) and the fix."""
    shown = "(the model's own)" if spec is None else repr(spec)
    try:
        tokenizer = model_tokenizer(spec, model_dir, model.eos_token_id)
    except TokenizerMismatchError as e:
        raise PreflightError(f"{key}={shown}: {e}") from None
    except (OSError, ValueError, KeyError) as e:
        raise PreflightError(f"{key}={shown} cannot be loaded: {e}") from None
    if tokenizer.vocab_size > model.vocab_size:
        raise PreflightError(
            f"{key}={shown} has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{model.vocab_size}: use the model's own tokenizer"
        )
    return tokenizer


def _speculation(cfg: RLConfig, model: ModelConfig) -> None:
    """A run that speculates needs a draft: the checkpoint's MTP layers or an EAGLE-3 draft."""
    k = cfg.rollout.speculation_k
    if k > 0 and model.num_nextn_predict_layers == 0 and cfg.draft.eagle3 is None:
        raise PreflightError(
            f"rollout.speculation_k={k} but model={cfg.model} has no draft (num_nextn_predict_layers is 0 in its "
            "config.json and draft.eagle3 is unset): set rollout.speculation_k=0 to decode plainly, or give it a "
            "draft: `specrl draft-init --model MODEL --out DRAFT --draft-kind eagle3`, then draft.eagle3=DRAFT"
        )


def _task(cfg: RLConfig, tokenizer: Tokenizer, model: ModelConfig) -> Task | Environment:
    try:
        task = cfg.task.build()
    except (OSError, ValueError, TypeError) as e:
        raise PreflightError(f"task: {e}") from None
    if isinstance(task, Environment):
        _environment(cfg, task, tokenizer, model)
        return task
    check_problems(task, tokenizer, model, cfg.rollout.max_new_tokens, seed=cfg.seed, reward_key=_reward_key(cfg))
    return task


def _environment(cfg: RLConfig, env: Environment, tokenizer: Tokenizer, model: ModelConfig) -> None:
    """A multi-turn environment's stop strings are one token each, its conversations fit the model's
    context, and its episodes answer a turn with a `Feedback` (dry-played on 16 problems)."""
    try:
        stop_token_ids(env, tokenizer)
    except ValueError as e:
        raise PreflightError(f"task: {e}") from None
    limit = cfg.task.max_episode_tokens
    if limit > model.max_position_embeddings:
        raise PreflightError(
            f"task.max_episode_tokens={limit} exceeds the model's max_position_embeddings="
            f"{model.max_position_embeddings}; lower task.max_episode_tokens"
        )
    for where, problem in _problems(env, cfg.seed):
        try:
            ids = prompt_ids(env, tokenizer, problem)
        except ValueError as e:
            raise PreflightError(f"task: {where}: the prompt cannot be tokenized ({e})") from None
        if len(ids) >= limit:
            raise PreflightError(
                f"task: {where}'s prompt has {len(ids)} tokens, task.max_episode_tokens={limit} leaves no turn; "
                "raise task.max_episode_tokens"
            )
        try:
            feedback = env.reset(problem).step(problem.answer)
        except Exception as e:  # user code: whatever it raises is reported
            raise PreflightError(
                f"task.environment={cfg.task.environment or env.name} failed on a dry turn ({where}: prompt "
                f"{problem.prompt[:40]!r}): {type(e).__name__}: {e}"
            ) from None
        if not isinstance(feedback, Feedback) or not math.isfinite(feedback.reward):
            raise PreflightError(
                f"task.environment={cfg.task.environment or env.name}: a turn's step returned {feedback!r} ({where}); "
                "return trainer.rl.environments.Feedback(observation=..., reward=<finite float>, done=...)"
            )


def _reward_key(cfg: RLConfig) -> str:
    return f"task.rewards={list(cfg.task.rewards)}" if cfg.task.rewards else "the task's reward"


def _problems(task: ProblemSource, seed: int) -> list[tuple[str, Problem]]:
    """What to check: every row of a dataset (named by where it is written), or 8 problems of each
    split of a generated task."""
    if isinstance(task, DatasetTask):
        return task.located()
    rng, out = random.Random(seed), []
    for split in ("train", "eval"):
        for i in range(8):
            try:
                out.append((f"{split} problem {i}", task.sample(rng, split)))
            except (RuntimeError, ValueError) as e:
                raise PreflightError(f"task: cannot draw a {split} problem ({e}); check task.eval_fraction") from None
    return out


DRY_CALLS = 16
"""Problems the reward is dry-called on (spread over the dataset): the reward is one function for
every row, and what differs between rows, the answers, is checked on every row when it is read."""


def check_problems(
    task: Task, tokenizer: Tokenizer, model: ModelConfig, max_new_tokens: int, *, seed: int, reward_key: str
) -> None:
    """Every problem checked (see `_problems`) renders to tokens (through the chat template where
    the task uses one) and fits the context with `max_new_tokens`; the reward gives a finite value on
    three completions of `DRY_CALLS` of them (unless `reward_key` is "": no reward is computed).
    PreflightError naming the rows; a dataset task that filters rows drops the over-long ones
    instead (counted in its `dropped`)."""
    bad: list[str] = []
    long: list[tuple[str, int]] = []
    problems = _problems(task, seed)
    for where, problem in problems:
        try:
            ids = prompt_ids(task, tokenizer, problem)
        except ValueError as e:
            bad.append(f"{where}: the prompt cannot be tokenized ({e})")
            continue
        if not ids:
            bad.append(f"{where}: the prompt {problem.prompt[:40]!r} has no tokens")
        if len(ids) + max_new_tokens > model.max_position_embeddings:
            long.append((where, len(ids)))
    if bad:
        raise PreflightError("task: " + rows_message(bad, "fix or remove them"))
    if long and isinstance(task, DatasetTask) and task.filter_rows:
        task.dropped["over-long prompt"] = len(long)
        try:
            task.drop({where for where, _ in long})
        except ValueError as e:
            raise PreflightError(f"task: {e} (over-long for rollout.max_new_tokens={max_new_tokens})") from None
        problems = _problems(task, seed)
    elif long:
        where, n = max(long, key=lambda x: x[1])
        raise PreflightError(
            f"rollout.max_new_tokens={max_new_tokens} plus prompts of up to {n} tokens ({where}; {len(long)} "
            f"prompt(s) too long) exceeds the model's max_position_embeddings={model.max_position_embeddings}; "
            "lower rollout.max_new_tokens, shorten those prompts, or set task.filter_rows=true to drop them"
        )
    for where, problem in problems[:: max(1, len(problems) // DRY_CALLS)][: DRY_CALLS if reward_key else 0]:
        for completion in ("", problem.answer, f"#### {problem.answer}"):
            try:
                value = task.reward(problem, completion)
            except Exception as e:  # user code: whatever it raises is reported
                raise PreflightError(
                    f"{reward_key} failed on a dry call ({where}: prompt {problem.prompt[:40]!r}, completion "
                    f"{completion[:40]!r}): {type(e).__name__}: {e}"
                ) from None
            if not math.isfinite(value):
                raise PreflightError(f"{reward_key} returned {value} on a dry call ({where}); return a finite float")


def rendered_prompt(task: ProblemSource, tokenizer: Tokenizer) -> str:
    """The first training prompt as the model sees it (decoded from its tokens, special tokens kept
    where the tokenizer can show them): printed at start so a user checks the template."""
    problem = task.sample(random.Random(0), "train")
    ids = prompt_ids(task, tokenizer, problem)
    show = getattr(tokenizer, "decode_all", tokenizer.decode)
    return str(show(ids))


def _parallel_layout(cfg: RLConfig, model: ModelConfig) -> None:
    tp = cfg.train.tensor_parallel
    sizes = {
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_key_value_heads,
        "intermediate_size": model.intermediate_size,
        "vocab_size": model.vocab_size,
    }
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        raise PreflightError(f"train.tensor_parallel={tp} must divide the model's {bad}; choose a divisor")
    import os

    import torch.distributed as dist

    dp = cfg.train.data_parallel
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world != dp * tp:
        hint = (
            f"set train.data_parallel={world // tp} (train.data_parallel x train.tensor_parallel = processes)"
            if world % tp == 0
            else f"{world} is not a multiple of train.tensor_parallel={tp}: launch a multiple of it"
        )
        raise PreflightError(
            f"{world} processes but train.data_parallel={dp} x train.tensor_parallel={tp} = {dp * tp}: {hint}, "
            f"or launch {dp * tp} processes (torchrun --nnodes N --nproc-per-node {dp * tp} / N)"
        )


def _experts(cfg: RLConfig, model: ModelConfig) -> None:
    """What a mixture-of-experts run needs: an expert-parallel size that divides the experts and the
    processes, routing replay only on an MoE policy whose rollouts carry routes."""
    from trainer.policy.moe import check

    ep, replay = cfg.train.expert_parallel, cfg.algorithm.routing_replay
    if model.moe is None:
        if ep > 1:
            raise PreflightError(f"train.expert_parallel={ep} but model={cfg.model} is dense (no experts): set it to 1")
        if replay != "off":
            raise PreflightError(
                f"algorithm.routing_replay={replay!r} but model={cfg.model} is dense: there are no routes to replay; "
                "set algorithm.routing_replay=off"
            )
        return
    try:
        check(model.moe, tensor_parallel=cfg.train.tensor_parallel, expert_parallel=ep)
    except ValueError as e:
        raise PreflightError(f"model={cfg.model} (train.tensor_parallel / train.expert_parallel): {e}") from None
    if cfg.train.tensor_parallel > 1:
        from trainer.policy.policy import MOE_TENSOR_PARALLEL

        raise PreflightError(f"train.tensor_parallel={cfg.train.tensor_parallel}: {MOE_TENSOR_PARALLEL}")
    world = cfg.train.data_parallel * cfg.train.tensor_parallel
    if world % ep:
        raise PreflightError(
            f"train.expert_parallel={ep} must divide the {world} processes (train.data_parallel x "
            "train.tensor_parallel): raise train.data_parallel or choose a divisor"
        )
    if replay == "rollout" and cfg.task.kind == "environment":
        raise PreflightError(
            "algorithm.routing_replay='rollout' with task.kind='environment': a multi-turn episode's observation "
            "tokens were never routed by the sampler; set algorithm.routing_replay=off for environments"
        )
    if replay == "rollout" and cfg.sidecars.serve.engine.kind != "torch" and not cfg.sidecars.addresses:
        raise PreflightError(
            f"algorithm.routing_replay='rollout' needs sidecars that return routes; the {cfg.sidecars.serve.engine.kind} "
            "engine does not: serve with the embedded engine (sidecars.serve.engine.kind=torch) or set "
            "algorithm.routing_replay=off"
        )


def check_sidecars(cfg: RLConfig, model: ModelConfig) -> None:
    """Each remote sidecar answers GetInfo within sidecars.call_timeout_s and serves this model's shape."""
    from dataclasses import replace

    from sidecar.client.client import SidecarCallError, SidecarClient

    try:  # the run's own credentials (token, TLS), so a secured sidecar answers the probe
        client_config = replace(cfg.sidecars.client_config(), retries=0)
    except ValueError as e:
        raise PreflightError(str(e)) from None
    for address in cfg.sidecars.addresses:
        client = SidecarClient(address, client_config)
        try:
            info = client.info()
        except SidecarCallError as e:
            raise PreflightError(
                f"sidecar {address} (sidecars.addresses) is not reachable: {e}; start it with `specrl serve` "
                "or fix the address"
            ) from None
        finally:
            client.close()
        served = info.engine.model
        ours = {
            "vocab_size": model.vocab_size,
            "hidden_size": model.hidden_size,
            "num_layers": model.num_hidden_layers,
            "num_mtp_layers": model.num_nextn_predict_layers,
            "num_experts": 0 if model.moe is None else model.moe.num_experts,
        }
        theirs = {k: getattr(served, k) for k in ours}
        if theirs != ours:
            raise PreflightError(
                f"sidecar {address} serves a different model shape {theirs} than model={cfg.model} {ours}; "
                "serve the run's checkpoint there"
            )
        method = info.engine.speculation_method
        if (cfg.draft.eagle3 is not None) != (method == "eagle3"):
            raise PreflightError(
                f"sidecar {address} drafts with {method or 'no draft'!r} but draft.eagle3={cfg.draft.eagle3}: "
                "serve the run's EAGLE-3 draft there (`specrl serve --draft DIR`) or unset draft.eagle3"
                if cfg.draft.eagle3 is not None
                else f"sidecar {address} serves an EAGLE-3 draft, which this run would not train or push: "
                "set draft.eagle3 to its directory, or serve the model without --draft"
            )


def announce_task(task: ProblemSource, tokenizer: Tokenizer) -> None:
    """Show what the model sees (the first training prompt, rendered) and the rows a dataset dropped."""
    dropped = getattr(task, "dropped", None)
    if dropped:
        tqdm.write(f"task: dropped {sum(dropped.values())} row(s): {dropped}", file=sys.stderr)
    tqdm.write(f"first training prompt as the model sees it:\n{rendered_prompt(task, tokenizer)}", file=sys.stderr)
