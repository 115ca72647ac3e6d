"""Other RL frameworks driving specrl sidecars.

`weight_session` is framework-independent: an incremental weight update over the existing
`PushWeights` stream (open, send tensors as the framework produces them, commit atomically).
`trl` is the drop-in for TRL's `GRPOTrainer` (the `trl` extra; tested by `tools/test-trl`).
"""
