"""specrl trainer: the Megatron-core policy, the RL algorithm, the draft, planning and the CLI.

Grouped by role, imports running one way (`tests/test_layout.py` walks them):

- `trainer.cli`: the `specrl` command (`train`, `warmup`, `draft-init`, `export`, `demo`).
- `trainer.rl`: the RL algorithm and its run: the loop (`rl_step`), the run config and checks,
  rollouts (DAPO refill, stale groups, packing), tasks, rewards, environments and episodes,
  evaluation, ranks' roles, export to Hugging Face, trackers and the run directory.
- `trainer.policy`: the policy and Megatron: `Policy` (log-probs, train step, export, save/load),
  the megatron-core model, the naming bridge, MoE routing, GRPO/DAPO losses and KL, data parallel,
  checkpoints, the reference model.
- `trainer.draft`: the draft: its objective on detached hidden states, self-distillation, MTP grafting.
- `trainer.planning`: `specrl plan`.
- `trainer.schedules`, `trainer.tokenizer`: shared by every group (lr schedules, the tokenizer).

The CLI imports everything; the RL algorithm imports the policy and the draft; the policy imports
the draft's objective; the draft and planning import no other group.
"""
