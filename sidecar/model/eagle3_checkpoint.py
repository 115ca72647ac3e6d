"""An EAGLE-3 draft's checkpoint directory, in the layout SGLang's and vLLM's EAGLE-3 loaders read.

Why this layout: one draft directory then serves the embedded engine (`specrl serve --draft DIR`)
and SGLang's (`--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR`) or vLLM's
(`speculative_config={"method": "eagle3", "model": DIR}`) EAGLE-3 drafting.

Files
-----
- ``config.json``: Llama keys of one decoder layer (``architectures:
  ["LlamaForCausalLMEagle3"]``, ``model_type: "llama"``, ``num_hidden_layers: 1``,
  ``hidden_size``, ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``,
  ``head_dim``, ``rms_norm_eps``, ``rope_theta``, ``rope_scaling``, ``max_position_embeddings``,
  ``tie_word_embeddings: false``, ``torch_dtype``), ``vocab_size`` (the target's) and
  ``draft_vocab_size``; when the taps are not the loaders' default (inputs of layers 2, L/2,
  L-3), both loaders' keys for them: ``eagle_aux_hidden_state_layer_ids`` (vLLM's, top level:
  target layer *inputs*) and ``eagle_config:
  {eagle_aux_hidden_state_layer_ids}`` (SGLang's, nested: layer *outputs*, one less; SGLang adds
  one back). Reading, the top-level key wins, else the nested one.
- ``model.safetensors`` with (no biases; the token embedding is the target's, not stored)::

    fc.weight                                   [hidden, 3*hidden]
    midlayer.input_layernorm.weight             [hidden]     norm of embed(x_{t+1})
    midlayer.hidden_norm.weight                 [hidden]     norm of the fused state
    midlayer.self_attn.q_proj.weight            [heads*head_dim, 2*hidden]
    midlayer.self_attn.k_proj.weight            [kv_heads*head_dim, 2*hidden]
    midlayer.self_attn.v_proj.weight            [kv_heads*head_dim, 2*hidden]
    midlayer.self_attn.o_proj.weight            [hidden, heads*head_dim]
    midlayer.post_attention_layernorm.weight    [hidden]
    midlayer.mlp.gate_proj.weight               [intermediate, hidden]
    midlayer.mlp.up_proj.weight                 [intermediate, hidden]
    midlayer.mlp.down_proj.weight               [hidden, intermediate]
    norm.weight                                 [hidden]
    lm_head.weight                              [draft_vocab, hidden]
    d2t                                         [draft_vocab] int64: target id = draft id + d2t
    t2d                                         [vocab] bool: the target ids in the draft vocabulary

SGLang's loader prefixes every name but ``lm_head`` with ``model.`` (and fuses q/k/v, gate/up);
vLLM's renames ``midlayer.`` to ``layers.0.`` and ``d2t`` to ``draft_id_to_target_id``, skips
``t2d``. Both read d2t as the offset above; an identity d2t (zeros) is a full vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from sidecar.errors import CheckpointError
from sidecar.model.checkpoint import CONFIG_FILE, WEIGHTS_FILE, read_config_json, read_tensors
from sidecar.model.eagle3 import Eagle3Config, Eagle3Draft
from sidecar.model.model import ModelConfig

_INDEX_TYPES = ("d2t", "t2d")


def eagle3_tensor_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the draft's tensors, in checkpoint order."""
    h, q, kv = (
        config.hidden_size,
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    m, inter = "midlayer.", config.intermediate_size
    return {
        "fc.weight": (h, 3 * h),
        m + "input_layernorm.weight": (h,),
        m + "hidden_norm.weight": (h,),
        m + "self_attn.q_proj.weight": (q, 2 * h),
        m + "self_attn.k_proj.weight": (kv, 2 * h),
        m + "self_attn.v_proj.weight": (kv, 2 * h),
        m + "self_attn.o_proj.weight": (h, q),
        m + "post_attention_layernorm.weight": (h,),
        m + "mlp.gate_proj.weight": (inter, h),
        m + "mlp.up_proj.weight": (inter, h),
        m + "mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (config.draft_vocab_size, h),
        "d2t": (config.draft_vocab_size,),
        "t2d": (config.vocab_size,),
    }


def save_eagle3_draft(path: str | Path, draft: Eagle3Draft) -> None:
    """Write config.json and model.safetensors (weights in config.torch_dtype, CPU, contiguous)."""
    draft.check_vocab()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = draft.state_dict()
    dtype = draft.config.dtype
    tensors = {
        n: state[n].detach().to("cpu", state[n].dtype if n in _INDEX_TYPES else dtype).contiguous()
        for n in eagle3_tensor_shapes(draft.config)
    }
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(draft.config.to_hf_dict(), indent=2, sort_keys=True) + "\n")


def load_eagle3_draft(
    path: str | Path, *, device: str | torch.device = "cpu", target: ModelConfig | None = None
) -> Eagle3Draft:
    """Read and validate an EAGLE-3 draft directory (optionally against its target's config).

    Raises CheckpointError naming the file and what is wrong: a missing directory or config.json,
    another architecture, unreadable safetensors, missing, unknown or misshapen tensors, token maps
    that disagree, or a draft that does not fit `target` (vocabulary, hidden size, taps)."""
    path = Path(path)
    raw = read_config_json(path, "EAGLE-3 draft")
    cfg_path = path / CONFIG_FILE
    arch = list(raw.get("architectures") or [])
    if not any("eagle3" in a.lower() for a in arch):
        raise CheckpointError(
            f"{cfg_path}: architectures {arch} is not an EAGLE-3 draft (expected ['LlamaForCausalLMEagle3']); "
            "a checkpoint with MTP layers is served as --model, not --draft"
        )
    if int(raw.get("num_hidden_layers", 1)) != 1 or raw.get("tie_word_embeddings"):
        raise CheckpointError(
            f"{cfg_path}: only one-layer EAGLE-3 drafts with their own lm_head are supported "
            f"(num_hidden_layers {raw.get('num_hidden_layers')}, tie_word_embeddings {raw.get('tie_word_embeddings')})"
        )
    try:
        config = Eagle3Config.from_hf_dict(raw)
    except KeyError as e:
        raise CheckpointError(f"{cfg_path}: required key {e} is missing") from e
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: invalid EAGLE-3 config: {e}") from e
    if target is not None:
        try:
            config.check_target(target)
        except ValueError as e:
            raise CheckpointError(f"{path}: the draft does not fit the target: {e}") from e
    tensors = read_tensors(path)
    tensors.pop("embed_tokens.weight", None)  # some drafts store a copy of the target's embedding
    _check_tensors(config, tensors, str(path))
    draft = Eagle3Draft(config).to(config.dtype)
    draft.load_state_dict(tensors, strict=True)
    try:
        draft.check_vocab()
    except ValueError as e:
        raise CheckpointError(f"{path}: inconsistent token maps: {e}") from e
    return draft.to(device).eval().requires_grad_(False)


def _check_tensors(config: Eagle3Config, tensors: dict[str, Tensor], source: str) -> None:
    expected = eagle3_tensor_shapes(config)
    if "t2d" not in tensors and "d2t" in tensors:  # vLLM ignores t2d; rebuild it from d2t
        ids = torch.arange(config.draft_vocab_size) + tensors["d2t"].to(torch.int64)
        tensors["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
        tensors["t2d"][ids.clamp(0, config.vocab_size - 1)] = True
    if "d2t" not in tensors and config.draft_vocab_size == config.vocab_size:  # full vocabulary, identity maps
        tensors["d2t"] = torch.zeros(config.vocab_size, dtype=torch.int64)
        tensors["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    missing = [n for n in expected if n not in tensors]
    unknown = [n for n in tensors if n not in expected]
    if missing or unknown:
        raise CheckpointError(
            f"{source}: tensors missing {missing[:3]}, not expected {unknown[:3]}; "
            "the names are SGLang's EAGLE-3 layout (see sidecar/model/eagle3_checkpoint.py)"
        )
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        if got != shape:
            raise CheckpointError(f"{source}: {name} has shape {list(got)}, config.json implies {list(shape)}")
    tensors["d2t"] = tensors["d2t"].to(torch.int64)
    tensors["t2d"] = tensors["t2d"].to(torch.bool)
