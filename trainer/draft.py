"""The trainer's MTP draft head and its loss: `sidecar.engine.draft_objective`, re-exported.

The objective lives in the sidecar package (pure PyTorch, no megatron) so that the engine-side
self-distillation (`sidecar.engine.draft_fit`) trains with exactly the trainer's objective.
"""

from sidecar.engine.draft_objective import DraftConfig, MTPDraft, draft_loss, draft_step_tokens

__all__ = ["DraftConfig", "MTPDraft", "draft_loss", "draft_step_tokens"]
