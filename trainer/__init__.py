"""specrl trainer: Megatron-core policy, RL losses, draft training and the CLI.

- `trainer.platform`: process groups, seeding, and megatron-core's CPU accommodations.
- `trainer.gpt`: the Qwen3-equal megatron-core ``GPTModel``, its forward and log-probs.
- `trainer.bridge`: naming-contract (Hugging Face) <-> Megatron weights, TP-gathered export.
- `trainer.draft_objective`: the MTP draft head trained on detached trunk states.
- `trainer.losses`: GRPO with the DAPO options, k3 KL, training–inference mismatch.
- `trainer.policy`: `Policy` (log-probs, train_step, export, save/load) and `TrainBatch`.
- `trainer.checkpointing`: resumable checkpoints (weights, optimizers, RNG, step).
"""
