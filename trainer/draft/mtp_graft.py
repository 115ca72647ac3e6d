"""Grafting a DeepSeek-V3-style MTP layer onto a checkpoint that has none (`specrl draft-init`).

A plain model (a Qwen3 from `save_pretrained`, a warm-up's output) has no draft, so speculation
has nothing to propose with. `graft_mtp_layer` adds one MTP layer in the checkpoint naming
contract (`mtp.layers.0.*`, `sidecar.model.checkpoint`) and sets ``num_nextn_predict_layers: 1``;
`trainer.rl.warmup.draft_init` then fits it on the policy's own completions with the trunk frozen,
exactly as it fits an existing MTP layer, and writes the whole checkpoint `specrl serve` serves.

The layer (DeepSeek-V3, arXiv:2412.19437 §2.2) at position t reads
``eh_proj(cat([enorm(embed(x_{t+1})), hnorm(h_t)]))``, runs one decoder layer and predicts x_{t+2}
through ``shared_head.norm`` and the trunk's output head. It starts as:

- the decoder layer (attention, q/k norms, MLP, its two pre-norms): a copy of the trunk's last
  layer, so the draft begins as one more pass of the trunk's own top layer, at the scale and in the
  basis of its residual stream, rather than as a random map (the last layer is the one nearest the
  output head the draft shares);
- ``shared_head.norm``: the trunk's final norm, the norm the shared output head was trained behind;
- ``enorm`` / ``hnorm``: ones (both inputs at unit RMS);
- ``eh_proj`` (hidden, 2·hidden): the hidden-state half the identity and the embedding half zero.
  The layer then starts as a function of the trunk's state alone (which already encodes where the
  text is going), passed through the projection unchanged, and the next token's embedding enters
  from exactly zero, the way a new input branch is added without disturbing what works (LoRA's
  B = 0); its gradient is non-zero from the first step, since its input is not.

In MiMo's layout (`MiMoForCausalLM`, ``model.mtp_layers.0.*``) the same start under its names:
``token_layernorm`` / ``hidden_layernorm`` ones, ``input_proj`` the identity on its hidden half (the
first, there), ``final_layernorm`` the trunk's final norm.

That start is principled, not a measured win: after draft-init's fit, the copied-layer starts and a
random draft reach about the same τ at the demo's size, and on a 2-layer model the random one did
better (docs/checkpoints.md has the table).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import Tensor

from sidecar.model.checkpoint import check_state_dict, draft_prefix, draft_tensor_shapes, mtp_own_names
from sidecar.model.model import ModelConfig


def graft_mtp_layer(config: ModelConfig, tensors: Mapping[str, Tensor]) -> tuple[ModelConfig, dict[str, Tensor]]:
    """`config` with one MTP layer, and `tensors` (a checkpoint without one, contract names) with
    that layer's ``mtp.layers.0.*`` (MiMo: ``model.mtp_layers.0.*``) added, initialised as the module docstring says (same dtype
    and device as the trunk's tensors). ValueError if the checkpoint already has MTP layers."""
    if config.num_nextn_predict_layers:
        raise ValueError(
            f"the checkpoint already has {config.num_nextn_predict_layers} MTP layer(s): fit them, do not graft"
        )
    grafted = dataclasses.replace(config, num_nextn_predict_layers=1)
    last = f"model.layers.{config.num_hidden_layers - 1}."
    prefix = f"{draft_prefix(grafted)}0."
    like = tensors["model.norm.weight"]
    h = config.hidden_size
    proj = torch.zeros(h, 2 * h, dtype=like.dtype, device=like.device)
    hidden_half = slice(0, h) if grafted.mtp_layout == "mimo" else slice(h, 2 * h)  # MiMo: cat([hidden, embedding])
    proj[:, hidden_half] = torch.eye(h, dtype=like.dtype, device=like.device)  # the hidden state passes
    token_norm, hidden_norm, proj_name, head_norm = mtp_own_names(grafted)
    own = {  # the MTP layer's own tensors; every other sub-name is a decoder-layer tensor of the trunk's
        token_norm: torch.ones_like(like),
        hidden_norm: torch.ones_like(like),
        proj_name: proj,
        head_norm: like.clone(),
    }
    out = dict(tensors)
    for name in draft_tensor_shapes(grafted):
        sub = name[len(prefix) :]
        out[name] = own[sub] if sub in own else tensors[last + sub].clone()
    check_state_dict(grafted, out, source="the grafted checkpoint")
    return grafted, out
