"""Planning: predict an RL step's generation and total time, with and without speculation, from
explicit, measurable inputs (`specrl plan`).

- `step_model`: acceptance per draft position, response lengths, one engine's generation
  (Monte Carlo over rows and rounds), the fleet's generation and the RL step (sync or async).
- `hardware`: bundled GPU profiles (published HBM bandwidth and dense bf16 peak).
- `shapes`: a model's parameter and KV-cache bytes and FLOPs per token, from a config.json.
- `roofline`: decode, verify and draft costs from a shape and a profile.
- `cost_table`: costs measured by the engine on a user's machine (`specrl bench gpu`,
  `specrl bench cost-table`), read and interpolated.
- `report`, `plot`, `cli`: the `specrl plan` command.
"""
