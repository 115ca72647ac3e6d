"""The policy and Megatron: `policy.py` (`Policy`, `TrainBatch`) over megatron-core (`gpt.py`,
`platform.py`, `data_parallel.py`), the naming bridge, MoE routing, the loss, checkpoints and
the reference model."""
