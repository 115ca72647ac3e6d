"""specrl's checkpoint naming contract → the layout SGLang 0.5.23's model classes load.

Which SGLang architecture serves a dense Qwen3 trunk with a DeepSeek-V3-style MTP layer
(https://arxiv.org/abs/2412.19437 §2.2) through NEXTN? None exactly. What 0.5.23 has
(`sglang/srt/configs/model_config.py::_config_draft_model` maps a target architecture to its
draft class):

- ``MiMoForCausalLM`` → ``MiMoMTP``: Qwen2 layers (q/k/v biases, no q/k norm) and
  ``cat([hnorm(h), enorm(e)])`` — hidden state FIRST, the opposite of our contract; and it
  zeroes the embedding at position 0. Does not fit.
- ``DeepseekV3ForCausalLM`` → ``…NextN``: MLA attention and MoE. ``Glm4Moe…NextN``: GLM
  attention. ``Qwen3Next``/``Qwen3_5`` MTP: gated attention (doubled q_proj), Gemma-style
  norms (1 + w). None fits.
- ``Qwen3MoeForCausalLM`` → ``Qwen3MoeForCausalLMMTP`` (sglang/srt/models/qwen3_moe_mtp.py):
  ``fc(cat([pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)]))`` — embedding first, like ours —
  then ONE Qwen3-MoE decoder layer (q/k RMSNorm, same RoPE incl. YaRN), then ``model.norm``
  and the shared lm_head; the target's embedding and head are shared
  (``set_embed_and_head``). Only the MLP differs: it is always a sparse MoE block in 0.5.23
  (``Qwen3MoeDecoderLayer.stage_facts``: "all layers are sparse").

The honest closest path, used here: the target is served as SGLang's own dense
``Qwen3ForCausalLM`` (exactly our trunk, HF names, loaded from a target directory), and the
draft is a SEPARATE directory (``speculative_draft_model_path``) whose config.json says
``Qwen3MoeForCausalLM`` — a config shim with ``num_experts = n`` identical copies of our dense
SwiGLU MLP, ``num_experts_per_tok = n`` and a zero router, so every token is routed to all
copies with weight 1/n and the block computes exactly our MLP (up to rounding in the weighted
sum; n = tensor-parallel size because SGLang refuses tp_size > num_experts). A draft only
proposes tokens — verification by the target keeps sampling lossless — so the shim can cost
acceptance at worst, never correctness.

Known differences from the contract's MTP semantics (draft-only, so acceptance-only):
- chain drafting (k > 1): SGLang feeds back what the draft's logits processor saw, i.e. the MTP
  layer's output AFTER ``model.norm`` (= our ``shared_head.norm``); the contract feeds the
  output BEFORE that norm. Draft step 0 is identical.
- one MTP layer: SGLang sets ``num_nextn_predict_layers = 1`` for this class, so checkpoints
  with more MTP layers are refused here rather than silently truncated.

Tensor names. Target: the contract's trunk names unchanged (SGLang's ``Qwen3ForCausalLM``
loads HF Qwen3 names). Draft, for MTP layer 0 (``Qwen3MoeForCausalLM.load_weights(is_mtp=True)``
strips ``mtp.`` from the three fusion tensors and maps ``mtp.X`` → ``model.X`` otherwise)::

    mtp.layers.0.eh_proj.weight               → mtp.fc.weight
    mtp.layers.0.enorm.weight                 → mtp.pre_fc_norm_embedding.weight
    mtp.layers.0.hnorm.weight                 → mtp.pre_fc_norm_hidden.weight
    mtp.layers.0.shared_head.norm.weight      → mtp.norm.weight
    mtp.layers.0.mlp.{gate,up,down}_proj.weight → mtp.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight
                                                  for e in 0..n-1, plus mtp.layers.0.mlp.gate.weight = 0 [n, hidden]
    mtp.layers.0.<any other decoder-layer name> → unchanged
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from sidecar.model.checkpoint import CONFIG_FILE, MTP_PREFIX, WEIGHTS_FILE
from sidecar.model.model import ModelConfig

TARGET_ARCHITECTURE = "Qwen3ForCausalLM"
"""SGLang class serving the trunk: sglang/srt/models/qwen3.py."""
DRAFT_ARCHITECTURE = "Qwen3MoeForCausalLM"
"""What the draft directory's config.json declares; SGLang turns it into DRAFT_CLASS."""
DRAFT_CLASS = "Qwen3MoeForCausalLMMTP"
"""SGLang class serving the MTP layer: sglang/srt/models/qwen3_moe_mtp.py."""

_LAYER0 = f"{MTP_PREFIX}0."
_FUSION = {
    "eh_proj.weight": "mtp.fc.weight",
    "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "shared_head.norm.weight": "mtp.norm.weight",
}
_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
ROUTER_SUFFIX = "mlp.gate.weight"
"""The shim's router (zeros): an SGLang-side tensor with no contract counterpart."""


def check_servable(config: ModelConfig) -> None:
    """Raise ValueError unless SGLang can serve `config` through this mapping."""
    if config.family != "qwen3":
        raise ValueError(
            f"the SGLang adapter serves the qwen3 family only (its target is SGLang's {TARGET_ARCHITECTURE}), "
            f"not {config.architectures[0]} (family {config.family}); serve it with --engine torch"
        )
    if config.num_nextn_predict_layers > 1:
        raise ValueError(
            f"num_nextn_predict_layers is {config.num_nextn_predict_layers}, but SGLang 0.5.23's "
            f"{DRAFT_CLASS} serves exactly one MTP layer; export a checkpoint with one MTP layer "
            "(or serve it with --engine torch)"
        )


def draft_names(name: str, *, num_experts: int) -> list[str]:
    """The SGLang draft-checkpoint name(s) of one contract draft tensor (several for MLP experts)."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if not name.startswith(_LAYER0):
        raise KeyError(f"{name} is not a tensor of MTP layer 0 (SGLang serves one MTP layer, prefix {_LAYER0!r})")
    sub = name[len(_LAYER0) :]
    if sub in _FUSION:
        return [_FUSION[sub]]
    if sub in _MLP:
        proj = sub[len("mlp.") :]
        return [f"mtp.layers.0.mlp.experts.{e}.{proj}" for e in range(num_experts)]
    return ["mtp.layers.0." + sub]


def target_names(name: str) -> str:
    """The SGLang target-checkpoint name of one contract trunk tensor (the HF Qwen3 name itself)."""
    if name.startswith(MTP_PREFIX):
        raise KeyError(f"{name} is a draft tensor; SGLang's {TARGET_ARCHITECTURE} would crash loading it")
    return name


def to_sglang_draft(tensors: Mapping[str, Tensor], *, hidden_size: int, num_experts: int) -> dict[str, Tensor]:
    """Contract draft tensors → SGLang draft tensors (experts replicated, zero router added).

    Expert copies share storage with the input (no copy); the router is a fresh zero tensor
    of the draft's dtype.
    """
    out: dict[str, Tensor] = {}
    dtype = None
    for name, t in tensors.items():
        dtype = t.dtype
        for new in draft_names(name, num_experts=num_experts):
            out[new] = t
    if dtype is not None:
        out["mtp.layers.0." + ROUTER_SUFFIX] = torch.zeros(num_experts, hidden_size, dtype=dtype)
    return out


def to_sglang_target(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Contract target tensors → SGLang target tensors (same names; draft names refused)."""
    return {target_names(n): t for n, t in tensors.items()}


def target_hf_config(config: ModelConfig) -> dict[str, Any]:
    """config.json of the target directory: a plain dense Qwen3.

    The draft count is dropped (the target is not a NEXTN checkpoint here) and no EOS id is
    written: SGLang would otherwise stop at the model's EOS, but specrl stops only at the
    request's ``stop_token_ids`` (and ``ignore_eos`` would ignore those too).
    """
    d = config.to_hf_dict()
    d["architectures"] = [TARGET_ARCHITECTURE]
    d["model_type"] = "qwen3"
    d["dtype"] = config.torch_dtype  # transformers 5 spelling, next to torch_dtype
    d.pop("num_nextn_predict_layers", None)
    d.pop("eos_token_id", None)  # see above: stopping at EOS is the request's choice (stop_at_eos)
    return d


def draft_hf_config(config: ModelConfig, *, num_experts: int) -> dict[str, Any]:
    """config.json of the draft directory: the Qwen3-MoE shim SGLang turns into its MTP class."""
    d = target_hf_config(config)
    d.update(
        architectures=[DRAFT_ARCHITECTURE],
        model_type="qwen3_moe",
        num_hidden_layers=1,
        num_nextn_predict_layers=1,
        num_experts=num_experts,
        num_experts_per_tok=num_experts,
        moe_intermediate_size=config.intermediate_size,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
    )
    return d


@dataclass(frozen=True, kw_only=True, slots=True)
class SGLangCheckpoint:
    """The two directories SGLang loads: the target (``model_path``) and the draft."""

    target_dir: Path
    draft_dir: Path | None
    """None when the model has no MTP layer (served without speculation)."""


def split_contract(config: ModelConfig, tensors: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(target tensors, draft tensors) of a contract state dict."""
    target = {n: t for n, t in tensors.items() if not n.startswith(MTP_PREFIX)}
    draft = {n: t for n, t in tensors.items() if n.startswith(MTP_PREFIX)}
    return target, draft


def write_sglang_checkpoint(
    config: ModelConfig, tensors: Mapping[str, Tensor], out_dir: str | Path, *, num_experts: int = 1
) -> SGLangCheckpoint:
    """Write `tensors` (contract names) as SGLang's target and draft directories under `out_dir`.

    ``out_dir/target``: config.json + model.safetensors (trunk, HF Qwen3 names).
    ``out_dir/draft``: config.json (the Qwen3-MoE shim) + model.safetensors (``mtp.*`` names);
    absent when the model has no MTP layer.
    """
    check_servable(config)
    out = Path(out_dir)
    target, draft = split_contract(config, tensors)
    target_dir = out / "target"
    _write(target_dir, target_hf_config(config), to_sglang_target(target), config.dtype)
    if not draft:
        return SGLangCheckpoint(target_dir=target_dir, draft_dir=None)
    draft_dir = out / "draft"
    sglang_draft = to_sglang_draft(draft, hidden_size=config.hidden_size, num_experts=num_experts)
    _write(draft_dir, draft_hf_config(config, num_experts=num_experts), sglang_draft, config.dtype)
    return SGLangCheckpoint(target_dir=target_dir, draft_dir=draft_dir)


def _write(path: Path, hf_config: dict[str, Any], tensors: Mapping[str, Tensor], dtype: torch.dtype) -> None:
    path.mkdir(parents=True, exist_ok=True)
    # safetensors refuses shared storage, so the replicated experts are materialised here.
    data = {n: t.detach().to("cpu", dtype).contiguous().clone() for n, t in tensors.items()}
    save_file(data, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")


_STACKED = (
    ("q_proj", "qkv_proj"),
    ("k_proj", "qkv_proj"),
    ("v_proj", "qkv_proj"),
    ("gate_proj", "gate_up_proj"),
    ("up_proj", "gate_up_proj"),
)


def runtime_parameter(sglang_name: str, *, draft: bool) -> str:
    """The SGLang module parameter a checkpoint tensor loads into (fused names), as
    ``named_parameters()`` of the served model spells it — the keys of SGLang's weight
    checksums (``CheckWeightsReqInput(action="checksum")``), without the role prefix.

    Follows ``Qwen3ForCausalLM.load_weights`` (target) and
    ``Qwen3MoeForCausalLM.load_weights(is_mtp=True)`` with ``FusedMoE.make_expert_params_mapping``
    (draft): q/k/v → qkv_proj, gate/up → gate_up_proj, expert gate/up → ``experts.w13_weight``,
    expert down → ``experts.w2_weight``.
    """
    name = sglang_name
    if draft:
        if name in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"):
            return name[len("mtp.") :]
        if not name.startswith("mtp."):
            raise KeyError(f"{name} is not a draft checkpoint name (they start with 'mtp.')")
        name = "model." + name[len("mtp.") :]
        if ".mlp.experts." in name:
            head, rest = name.split(".mlp.experts.", 1)
            proj = rest.split(".", 1)[1]  # drop the expert index
            return f"{head}.mlp.experts.{'w2_weight' if proj.startswith('down_proj') else 'w13_weight'}"
    for part, fused in _STACKED:
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}.")
    return name
