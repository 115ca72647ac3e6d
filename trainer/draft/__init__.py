"""The draft: `objective.py` (the one draft-training objective on detached hidden states, the MTP
and EAGLE-3 heads), `fit.py` (self-distillation through the engine), `mtp_graft.py` (an MTP layer
grafted onto a model without one)."""
