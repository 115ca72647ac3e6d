"""verl 0.9.1's rollout machinery drives a real `specrl serve` (rollout.name=specrl) on CPU.

verl builds the replica from its registry (the plugin's entry point), its agent loop samples
through the replica's server actor, and its `CheckpointEngineManager` (naive backend) syncs the
trainer's weights through the plugin's adapter after every training step (`verl_stack.py` says
which parts are verl's and which stand in for its CUDA-only actor worker).

The oracle is the trainer's own forward: after every push, the log-probs the trainer's current
weights give the sampled tokens equal the sidecar's `rollout_log_probs` within 1e-4 (float32).
The negative control runs the same loop with verl's sync but no push: the trainer moves away
from what the sidecar serves and the same difference grows.

verl loads the plugin `sidecar/integrations/verl.py`, which runs `sidecar/integrations/verl_server.py` (the replica) and `sidecar/integrations/verl_weights.py` (the push per step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("verl", reason="the verl target needs .venv-verl: run tools/test-verl")

from verl import DataProto
from verl.checkpoint_engine import CheckpointEngineManager
from verl.trainer.ppo.metric_utils import compute_timing_metrics
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.rollout.llm_server import LLMServerManager

from sidecar.client.client import SidecarClient
from sidecar.integrations.verl_config import SpecrlConfigError
from sidecar.integrations.verl_metrics import SpecrlAgentLoopManager
from tests.with_trl.serve import ServeProcess
from tests.with_verl.verl_stack import actor_group, compose_config, rows

STEPS = 5
REWARDED = 7  # token "w7"
STANDALONE = ("actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1")
"""verl's standalone replicas (no trainer worker group): enough to check what fails at start."""
pytestmark = pytest.mark.usefixtures("ray_cluster")


def prompt_batch(n: int) -> DataProto:
    texts = [" ".join(f"w{3 + (i * 7 + j * 5) % 60}" for j in range(3 + i % 3)) for i in range(4)]
    raw = np.empty(len(texts), dtype=object)
    for i, t in enumerate(texts):
        raw[i] = [{"role": "user", "content": t}]
    batch = DataProto.from_dict(non_tensors={"raw_prompt": raw, "uid": np.array([str(i) for i in range(len(texts))])})
    return batch.repeat(repeat_times=n, interleave=True)


def advantages(sequences: list[list[int]], starts: list[int], n: int) -> list[float]:
    rewards = np.array([s[p:].count(REWARDED) / max(len(s) - p, 1) for s, p in zip(sequences, starts, strict=True)])
    groups = rewards.reshape(-1, n)
    adv = (groups - groups.mean(1, keepdims=True)) / (groups.std(1, keepdims=True) + 1e-6)
    return [float(a) for a in adv.reshape(-1)]


def run_steps(checkpoint: Path, address: str, push: bool, n: int = 4, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """verl's loop order (ray_trainer.fit): initial sync, then generate -> sleep -> train -> sync."""
    config = compose_config(checkpoint, [address], n=n, extra=extra)
    actor_wg = actor_group(config, push=push)
    servers = LLMServerManager.create(config=config, worker_group=actor_wg)
    agent = SpecrlAgentLoopManager.create(config=config, llm_client=servers.get_client())
    sync = CheckpointEngineManager(
        config=omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine),
        actor_wg=actor_wg,
        replicas=servers.get_replicas(),
    )
    sync.update_weights(0)
    diffs, versions, metrics = [], [], []
    batch = prompt_batch(n)
    for step in range(1, STEPS + 1):
        out = agent.generate_sequences(batch)
        sync.sleep_replicas()
        sequences, starts, sidecar_lps = rows(out)
        trainer_lps = actor_wg.logprobs(sequences, starts, 1.0)[0]
        diffs.append(
            max(abs(a - b) for s, t in zip(sidecar_lps, trainer_lps, strict=True) for a, b in zip(s, t, strict=True))
        )
        metrics.append(compute_timing_metrics(out, dict(out.meta_info["timing"])))
        actor_wg.train_step(sequences, starts, advantages(sequences, starts, n))
        sync.update_weights(step)
        with SidecarClient(address) as direct:
            versions.append(direct.info().weight_version)
    return {"diffs": diffs, "versions": versions, "metrics": metrics}


def test_verl_trains_through_sidecar_with_a_push_per_step(checkpoint: Path, serve: ServeProcess) -> None:
    result = run_steps(checkpoint, serve.address, push=True)
    diffs, versions, metrics = result["diffs"], result["versions"], result["metrics"]
    print(f"\n|sidecar - trainer| log-prob per step {diffs}\nversions {versions}")
    print("τ per step", [m["timing_s/specrl/tau"] for m in metrics])
    assert all(d <= 1e-4 for d in diffs), f"max |log-prob difference| per step: {diffs}"
    assert versions == [step + 1 for step in range(1, STEPS + 1)], f"one push a step after the initial sync: {versions}"
    for step, m in enumerate(metrics, start=1):
        assert m["timing_s/specrl/weight_version/min"] == m["timing_s/specrl/weight_version/max"] == step
        assert m["timing_s/specrl/tau"] > 1.0, m  # drafts were accepted (τ decays: the draft goes stale)
        assert 0 < m["timing_s/specrl/acceptance/position_1"] <= 1
        assert m["timing_s/specrl/generate_s/mean"] > 0


def test_draft_aligned_in_the_same_push_holds_tau(checkpoint: Path, serve: ServeProcess) -> None:
    """With draft_checkpoint the draft is refitted to each new policy and pushed with it: still one
    version a step, and τ stays where the stale draft's fell (1.08-1.10 by steps 4-5 above)."""
    extra = (f"+actor_rollout_ref.rollout.engine_kwargs.specrl.draft_checkpoint={checkpoint}",)
    result = run_steps(checkpoint, serve.address, push=True, extra=extra)
    taus = [m["timing_s/specrl/tau"] for m in result["metrics"]]
    print(f"\naligned τ per step {taus}\nversions {result['versions']}\ndiffs {result['diffs']}")
    assert result["versions"] == [step + 1 for step in range(1, STEPS + 1)]
    assert all(d <= 1e-4 for d in result["diffs"]), result["diffs"]
    assert min(taus[-2:]) > 1.3, taus


def test_negative_control_without_push_diverges(checkpoint: Path, serve: ServeProcess) -> None:
    diffs = run_steps(checkpoint, serve.address, push=False)["diffs"]
    print(f"\nno-push |sidecar - trainer| per step {diffs}")
    assert diffs[0] <= 1e-4, "before any training step the sidecar serves the trainer's weights"
    assert diffs[-1] > 1e-3, diffs
    with SidecarClient(serve.address) as direct:
        assert direct.info().weight_version == 0


def test_unreachable_sidecar_fails_at_start(checkpoint: Path) -> None:
    config = compose_config(checkpoint, ["127.0.0.1:9"], extra=STANDALONE)
    with pytest.raises(SpecrlConfigError, match=r"cannot reach the specrl sidecar at 127.0.0.1:9.*specrl serve"):
        LLMServerManager.create(config=config, worker_group=None)


def test_unknown_option_fails_at_start(checkpoint: Path, serve: ServeProcess) -> None:
    config = compose_config(
        checkpoint,
        [serve.address],
        extra=(*STANDALONE, "+actor_rollout_ref.rollout.engine_kwargs.specrl.speculaton_k=3"),  # a typo: not an option
    )
    with pytest.raises(SpecrlConfigError, match=r"unknown option\(s\) \[.speculaton_k.\]"):
        LLMServerManager.create(config=config, worker_group=None)


def test_a_tool_agent_loop_runs_its_turns_on_the_sidecars_prefix_cache(checkpoint: Path, serve: ServeProcess) -> None:
    """verl's tool agent loop (multi-turn: three policy turns, a tool's answer after each) against
    a real sidecar: every turn is prompted with the whole history under the conversation's request
    id (the plugin's session), and from the second turn on the sidecar's prefill takes the earlier
    turns' KV from its prefix cache."""
    tools = Path(__file__).with_name("echo_tools.py")
    extra = (
        *STANDALONE,
        "actor_rollout_ref.rollout.multi_turn.enable=True",
        "actor_rollout_ref.rollout.multi_turn.format=specrl_every_turn",
        f"actor_rollout_ref.rollout.multi_turn.function_tool_path={tools}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
    )
    config = compose_config(checkpoint, [serve.address], n=2, extra=extra, response_length=96)
    servers = LLMServerManager.create(config=config, worker_group=None)
    agent = SpecrlAgentLoopManager.create(config=config, llm_client=servers.get_client())
    with SidecarClient(serve.address) as direct:
        before = direct.stats()
    out = agent.generate_sequences(prompt_batch(2))
    with SidecarClient(serve.address) as direct:
        after = direct.stats()
    turns = [int(t) for t in out.non_tensor_batch["__num_turns__"]]
    hits = sum(v.prefix_cache_hit_tokens for v in after.versions) - sum(
        v.prefix_cache_hit_tokens for v in before.versions
    )
    prefilled = sum(v.prefill_tokens for v in after.versions) - sum(v.prefill_tokens for v in before.versions)
    print(f"\nturns per conversation {turns}; prefill: {prefilled} tokens computed, {hits} from the prefix cache")
    assert all(t >= 4 for t in turns), turns  # 1 + assistant and tool turns: several policy turns each
    assert hits > 0, (hits, prefilled)
