"""Checkpoints in Hugging Face layout, and THE checkpoint naming contract of specrl.

The trainer's weight export, the sidecar's weight streaming and this loader all use these
names; a real local Qwen3, Qwen2 or Llama checkpoint loads as is (it simply has no draft layers).

Files
-----
- ``config.json``: the family's keys (``architectures``: one of `architectures.FAMILIES`, ``vocab_size``,
  ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``rope_theta``, ``rope_scaling``
  (null or a Hugging Face yarn or llama3 dict; transformers 5's ``rope_parameters`` is read too),
  ``max_position_embeddings``, ``tie_word_embeddings``, ``torch_dtype``) plus
  ``num_nextn_predict_layers`` (absent or 0: no draft, speculation unavailable).
- ``model.safetensors``, or shards listed by ``model.safetensors.index.json``
  (``{"weight_map": {name: file}}``), as Hugging Face writes them.

Tensor names
------------
Target (trunk + output head), Hugging Face names (Qwen3's; Qwen2 and Llama use the same), for i in
0..num_hidden_layers-1::

    model.embed_tokens.weight                          [vocab, hidden]
    model.layers.{i}.input_layernorm.weight            [hidden]
    model.layers.{i}.self_attn.q_proj.weight           [heads*head_dim, hidden]
    model.layers.{i}.self_attn.k_proj.weight           [kv_heads*head_dim, hidden]
    model.layers.{i}.self_attn.v_proj.weight           [kv_heads*head_dim, hidden]
    model.layers.{i}.self_attn.q_proj.bias             [heads*head_dim]     (attention_bias: Qwen2)
    model.layers.{i}.self_attn.k_proj.bias             [kv_heads*head_dim]  (attention_bias)
    model.layers.{i}.self_attn.v_proj.bias             [kv_heads*head_dim]  (attention_bias)
    model.layers.{i}.self_attn.o_proj.weight           [hidden, heads*head_dim]
    model.layers.{i}.self_attn.q_norm.weight           [head_dim]   (qk_norm: Qwen3)
    model.layers.{i}.self_attn.k_norm.weight           [head_dim]   (qk_norm)
    model.layers.{i}.post_attention_layernorm.weight   [hidden]
    model.layers.{i}.mlp.gate_proj.weight              [intermediate, hidden]
    model.layers.{i}.mlp.up_proj.weight                [intermediate, hidden]
    model.layers.{i}.mlp.down_proj.weight              [hidden, intermediate]
    model.norm.weight                                  [hidden]
    lm_head.weight                                     [vocab, hidden]  (absent when tie_word_embeddings)

Draft (MTP) layers, prefix ``mtp.layers.{j}.`` for j in 0..num_nextn_predict_layers-1,
DeepSeek-V3 names::

    mtp.layers.{j}.enorm.weight                        [hidden]   norm of embed(x_{t+1})
    mtp.layers.{j}.hnorm.weight                        [hidden]   norm of h_t
    mtp.layers.{j}.eh_proj.weight                      [hidden, 2*hidden]  input = cat([enorm(e), hnorm(h)])
    mtp.layers.{j}.<every trunk-layer sub-name above>  (input_layernorm.weight, self_attn.*, mlp.*, ...)
    mtp.layers.{j}.shared_head.norm.weight             [hidden]

MiMo's layout (``mtp_layout`` "mimo", `MiMoForCausalLM`), prefix ``model.mtp_layers.{j}.``::

    model.mtp_layers.{j}.token_layernorm.weight        [hidden]   norm of embed(x_{t+1})
    model.mtp_layers.{j}.hidden_layernorm.weight       [hidden]   norm of h_t
    model.mtp_layers.{j}.input_proj.weight             [hidden, 2*hidden]  input = cat([hidden, token]): h FIRST
    model.mtp_layers.{j}.<every trunk-layer sub-name above>
    model.mtp_layers.{j}.final_layernorm.weight        [hidden]

The embedding and the output head are shared with the trunk: they belong to the target and
are never repeated under ``mtp.``. Selector "target" = the first list, "draft" = the MTP list,
"all" = both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from sidecar.errors import CheckpointError
from sidecar.model.architectures import UnsupportedConfigError
from sidecar.model.model import ModelConfig

MTP_PREFIX = "mtp.layers."
MIMO_MTP_PREFIX = "model.mtp_layers."
_OWN_NAMES = {  # an MTP layer's own tensors (beside its decoder layer's), by layout: (token norm, hidden norm, proj, head)
    "specrl": ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"),
    "mimo": ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight", "final_layernorm.weight"),
}


def draft_prefix(config: ModelConfig) -> str:
    """Where the MTP layers' names start: "mtp.layers." or MiMo's "model.mtp_layers."."""
    return MIMO_MTP_PREFIX if config.mtp_layout == "mimo" else MTP_PREFIX


def mtp_own_names(config: ModelConfig) -> tuple[str, str, str, str]:
    """An MTP layer's own sub-names in the config's layout: token norm, hidden norm, projection, head norm."""
    names = _OWN_NAMES[config.mtp_layout]
    return names[0], names[1], names[2], names[3]


CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _layer_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One decoder layer's sub-names and shapes, in the module tree's order."""
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    out: dict[str, tuple[int, ...]] = {"input_layernorm.weight": (h,)}
    for proj, rows in (("q", q), ("k", kv), ("v", kv)):
        out[f"self_attn.{proj}_proj.weight"] = (rows, h)
        if c.attention_bias:
            out[f"self_attn.{proj}_proj.bias"] = (rows,)
    out["self_attn.o_proj.weight"] = (h, q)
    if c.qk_norm:
        out |= {"self_attn.q_norm.weight": (c.head_dim,), "self_attn.k_norm.weight": (c.head_dim,)}
    return out | {
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (c.intermediate_size, h),
        "mlp.up_proj.weight": (c.intermediate_size, h),
        "mlp.down_proj.weight": (h, c.intermediate_size),
    }


def target_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the target (trunk + output head), in checkpoint order."""
    h = config.hidden_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    layer = _layer_shapes(config)
    for i in range(config.num_hidden_layers):
        out.update({f"model.layers.{i}.{s}": shape for s, shape in layer.items()})
    out["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (config.vocab_size, h)
    return out


def draft_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the MTP draft layers (empty when num_nextn_predict_layers is 0)."""
    h = config.hidden_size
    layer = _layer_shapes(config)
    out: dict[str, tuple[int, ...]] = {}
    token, hidden, proj, head = mtp_own_names(config)
    for j in range(config.num_nextn_predict_layers):
        p = f"{draft_prefix(config)}{j}."
        out[p + token] = (h,)
        out[p + hidden] = (h,)
        out[p + proj] = (h, 2 * h)
        out.update({p + s: shape for s, shape in layer.items()})
        out[p + head] = (h,)
    return out


def target_tensor_names(config: ModelConfig) -> list[str]:
    return list(target_tensor_shapes(config))


def draft_tensor_names(config: ModelConfig) -> list[str]:
    return list(draft_tensor_shapes(config))


def check_state_dict(config: ModelConfig, state_dict: Mapping[str, Tensor], *, source: str = "state dict") -> None:
    """Raise CheckpointError unless `state_dict` holds exactly the contract's tensors with the right shapes."""
    expected = target_tensor_shapes(config) | draft_tensor_shapes(config)
    missing = [n for n in expected if n not in state_dict]
    unknown = [n for n in state_dict if n not in expected]
    if missing:
        raise CheckpointError(
            f"{source}: {len(missing)} tensor(s) missing, e.g. {missing[:3]}; "
            "the checkpoint does not match its config.json (see sidecar/model/checkpoint.py for the names)"
        )
    if unknown:
        raise CheckpointError(
            f"{source}: {len(unknown)} tensor(s) the config does not describe, e.g. {unknown[:3]}; "
            "check num_hidden_layers / num_nextn_predict_layers / tie_word_embeddings in config.json"
        )
    for name, shape in expected.items():
        got = tuple(state_dict[name].shape)
        if got != shape:
            raise CheckpointError(f"{source}: {name} has shape {list(got)}, config.json implies {list(shape)}")


def save_checkpoint(path: str | Path, config: ModelConfig, state_dict: Mapping[str, Tensor]) -> None:
    """Write config.json and model.safetensors (tensors cast to config.torch_dtype, contiguous, CPU)."""
    check_state_dict(config, state_dict)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {n: state_dict[n].detach().to("cpu", config.dtype).contiguous() for n in state_dict}
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(config.to_hf_dict(), indent=2, sort_keys=True) + "\n")


def read_config_json(path: Path, kind: str) -> dict[str, Any]:
    """The config.json of the `kind` directory `path` (a checkpoint, a draft) as a dict;
    CheckpointError naming the file when the directory, the file or its JSON object is missing."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: {kind} directory does not exist")
    cfg_path = path / CONFIG_FILE
    try:
        raw = json.loads(cfg_path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{cfg_path}: missing; a {kind} needs config.json next to its weights") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path}: must hold a JSON object")
    return raw


def read_tensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of the safetensors files in `path` (one file or an index of shards), CPU."""
    single, index = path / WEIGHTS_FILE, path / INDEX_FILE
    try:
        if single.is_file():
            return load_file(str(single))
        if not index.is_file():
            raise CheckpointError(
                f"{path}: neither {WEIGHTS_FILE} nor {INDEX_FILE} exists; not a safetensors checkpoint"
            )
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid index (needs a 'weight_map' object): {e}") from e
        tensors: dict[str, Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = path / shard
            if not shard_path.is_file():
                raise CheckpointError(f"{index} lists shard {shard!r}, which does not exist")
            tensors.update(load_file(str(shard_path)))
        absent = [n for n in weight_map if n not in tensors]
        if absent:
            raise CheckpointError(f"{index} maps {absent[:3]} to shards that do not contain them")
        return tensors
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors data ({e}); the file is truncated or corrupt") from e


def load_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, Tensor]]:
    """Read and validate a checkpoint directory: (config, tensors by contract name, CPU).

    Raises CheckpointError naming the file and the problem for a missing or malformed
    config.json, unreadable safetensors, and missing, unknown or misshapen tensors.
    """
    path = Path(path)
    raw = read_config_json(path, "checkpoint")
    cfg_path = path / CONFIG_FILE
    try:
        config = ModelConfig.from_hf_dict(raw)
    except KeyError as e:
        raise CheckpointError(f"{cfg_path}: required key {e} is missing") from e
    except UnsupportedConfigError as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: invalid model config: {e}") from e
    tensors = read_tensors(path)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints store the duplicate anyway
    check_state_dict(config, tensors, source=str(path))
    return config, tensors


def model_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """The model's parameters by contract name (the module tree mirrors the contract)."""
    return {n: p.detach() for n, p in model.named_parameters()}
