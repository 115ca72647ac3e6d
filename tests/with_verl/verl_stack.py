"""verl's own rollout machinery around a specrl sidecar, on CPU.

What is verl's, unchanged: the Hydra config (`ppo_trainer.yaml`), `LLMServerManager` (builds the
replicas through `RolloutReplicaRegistry`), its router and `LLMServerClient`, `AgentLoopManager`
and its `AgentLoopWorker` Ray actors (single-turn agent loop, chat template, padding, the
`rollout_log_probs` tensor), `RayWorkerGroup` and `CheckpointEngineManager.update_weights` with the
`naive` backend.

What stands in for verl's FSDP/Megatron `ActorRolloutRefWorker` (which needs CUDA: verl 0.9.1 has
no CPU platform): `TinyActor`, a verl `Worker` that trains a Hugging Face copy of the model with
a plain policy-gradient step and, like `ActorRolloutRefWorker.update_weights` on the naive path,
builds the rollout adapter with verl's `get_rollout_class` and hands it its full named tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray
import torch
import torch.nn.functional as F
import verl
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from transformers import AutoModelForCausalLM
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.rollout.base import get_rollout_class

CONFIG_DIR = Path(verl.__file__).parent / "trainer" / "config"


def compose_config(
    model: Path, sidecars: list[str], *, extra: tuple[str, ...] = (), n: int = 4, response_length: int = 12
) -> DictConfig:
    """verl's GRPO config with the lines a specrl user changes (README, "Use specrl from verl")."""
    overrides = [
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.rollout.name=specrl",
        f"+actor_rollout_ref.rollout.engine_kwargs.specrl.sidecars=[{','.join(sidecars)}]",
        "+actor_rollout_ref.rollout.agent.agent_loop_manager_class=sidecar.integrations.verl_metrics.SpecrlAgentLoopManager",
        # the test's scale: tiny prompts and responses, a handful of samples
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.prompt_length=16",
        f"actor_rollout_ref.rollout.response_length={response_length}",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"+actor_rollout_ref.model.custom_chat_template={CHAT}",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


CHAT = "'{% for m in messages %}{{ m[\"content\"] }}{% endfor %}'"


class TinyActor(Worker):
    """A CPU trainer in verl's worker shape (see module doc)."""

    def __init__(self, config: DictConfig, push: bool = True, lr: float = 0.5) -> None:
        super().__init__()
        self.config = config
        path = config.actor_rollout_ref.model.path
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.push = push
        rollout_config = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
        model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)
        self.rollout = get_rollout_class(rollout_config.name, rollout_config.mode)(
            config=rollout_config, model_config=model_config, device_mesh=None
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> None:
        """verl's naive sync: the engine's full named tensors into the rollout adapter."""
        if not self.push:  # the negative control: verl's sync runs, nothing reaches the sidecar
            return
        tensors = ((name, t.detach()) for name, t in self.model.state_dict().items())
        await self.rollout.update_weights(tensors, global_steps=global_steps)

    def _logprobs(self, sequences: list[list[int]], starts: list[int], temperature: float) -> list[torch.Tensor]:
        out = []
        for seq, start in zip(sequences, starts, strict=True):
            ids = torch.tensor([seq])
            logits = self.model(input_ids=ids).logits[0, :-1].float() / temperature
            lp = F.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append(lp[start - 1 :])
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def logprobs(self, sequences: list[list[int]], starts: list[int], temperature: float) -> list[list[float]]:
        """Reference log-probs of each sequence's tokens from index `starts[i]` on."""
        with torch.no_grad():
            return [lp.tolist() for lp in self._logprobs(sequences, starts, temperature)]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, sequences: list[list[int]], starts: list[int], advantages: list[float]) -> float:
        """One policy-gradient step: -mean(advantage x log-prob of the sampled response)."""
        self.optimizer.zero_grad(set_to_none=True)
        lps = self._logprobs(sequences, starts, 1.0)
        loss = -torch.stack([a * lp.sum() for a, lp in zip(advantages, lps, strict=True)]).mean()
        loss.backward()
        self.optimizer.step()
        return float(loss)


def actor_group(config: DictConfig, push: bool = True) -> RayWorkerGroup:
    pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1)
    cls = RayClassWithInitArgs(cls=ray.remote(TinyActor), config=config, push=push)
    return RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, device_name="cpu")


def rows(batch: Any) -> tuple[list[list[int]], list[int], list[list[float]]]:
    """From verl's rollout DataProto: each row's unpadded prompt + response, where its response
    starts, and the sidecar's log-probs of the response tokens (`rollout_log_probs`)."""
    prompts, responses = batch.batch["prompts"], batch.batch["responses"]
    mask = batch.batch["attention_mask"]
    width = prompts.shape[1]
    sequences, starts, logprobs = [], [], []
    for i in range(prompts.shape[0]):
        p = prompts[i][mask[i, :width].bool()].tolist()
        keep = mask[i, width:].bool()
        r = responses[i][keep].tolist()
        sequences.append(p + r)
        starts.append(len(p))
        logprobs.append(batch.batch["rollout_log_probs"][i][keep].tolist())
    return sequences, starts, logprobs


def to_yaml(config: DictConfig) -> str:
    return OmegaConf.to_yaml(config)
