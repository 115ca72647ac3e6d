"""specrl trainer: Megatron-core policy, RL losses, draft training and the CLI."""
