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
  ``num_nextn_predict_layers`` (absent or 0: no draft, speculation unavailable); a mixture of
  experts' keys as transformers spells them (``moe.MoEConfig.from_hf_dict``: num_experts /
  num_local_experts / n_routed_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
  mlp_only_layers, decoder_sparse_step; n_group, topk_group, routed_scaling_factor,
  n_shared_experts, first_k_dense_replace), transformers' class default where one is absent.
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

Mixture-of-experts layers (``Qwen3MoeForCausalLM``, ``Glm4MoeForCausalLM``; the keys in
``moe.MoEConfig``). A *sparse* layer i (``MoEConfig.is_sparse(i)``: Qwen3-MoE's unless ``i in
mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``; GLM-4.5's unless ``i <
first_k_dense_replace``) has, in place of the three ``mlp.*_proj`` names above, Hugging Face's
per-expert names (what ``save_pretrained`` writes and the hub ships; transformers 5's fused
in-memory ``experts.gate_up_proj`` is not a file name), E = num_experts, I = moe_intermediate_size::

    model.layers.{i}.mlp.gate.weight                   [E, hidden]  the router (float32 logits)
    model.layers.{i}.mlp.gate.e_score_correction_bias  [E]          sigmoid_grouped routers only
    model.layers.{i}.mlp.experts.{e}.gate_proj.weight  [I, hidden]  for e in 0..E-1
    model.layers.{i}.mlp.experts.{e}.up_proj.weight    [I, hidden]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight  [hidden, I]
    model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight  n_shared_experts > 0 only:
                                                       [n*I, hidden], [n*I, hidden], [hidden, n*I]

The router's two tensors are float32 in every dtype, stored, pushed and served so (``ROUTER_SUFFIXES``;
a bf16 router is refused). Dense layers of an MoE model keep the dense names (width
``intermediate_size``). An MTP layer j is
sparse when ``is_sparse(num_hidden_layers + j)`` and then carries the same expert names under its
prefix. Nothing changes for dense checkpoints. (Megatron-core's grouped-GEMM layout, the trainer's
concern, maps to these names in its bridge: expert e's ``linear_fc1`` rows are gate then up.)

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

GLM-4.5's own MTP layer (``Glm4MoeForCausalLM``, ``architectures.Family.mtp_as_decoder_layers``): its
checkpoints keep MTP layer j in the DeepSeek-V3 layout as decoder layer
``model.layers.{num_hidden_layers + j}.`` (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, a
full sparse decoder layer, and copies of the embedding and output head as ``embed_tokens.weight`` /
``shared_head.head.weight``). ``load_checkpoint`` serves them under the contract's ``mtp.layers.{j}.``
names (the copies dropped when they equal the trunk's, refused when not), so pushes, checksums and
the trainer's export address a GLM draft as any other: ``mtp.layers.{j}.*``; ``save_checkpoint``
writes them back under GLM's names. A config.json announcing MTP layers whose tensors are absent
(what transformers' ``save_pretrained`` writes) serves with none.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from sidecar.errors import CheckpointError
from sidecar.model.architectures import UnsupportedConfigError, family_of
from sidecar.model.model import ModelConfig
from sidecar.model.moe import MoEConfig

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


def _layer_shapes(c: ModelConfig, idx: int) -> dict[str, tuple[int, ...]]:
    """Decoder layer `idx`'s sub-names and shapes (an MTP layer: num_hidden_layers + j), in the
    module tree's order."""
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attention: dict[str, tuple[int, ...]] = {"input_layernorm.weight": (h,)}
    for proj, rows in (("q", q), ("k", kv), ("v", kv)):
        attention[f"self_attn.{proj}_proj.weight"] = (rows, h)
        if c.attention_bias:
            attention[f"self_attn.{proj}_proj.bias"] = (rows,)
    attention["self_attn.o_proj.weight"] = (h, q)
    if c.qk_norm:
        attention |= {"self_attn.q_norm.weight": (c.head_dim,), "self_attn.k_norm.weight": (c.head_dim,)}
    attention["post_attention_layernorm.weight"] = (h,)
    if c.moe is None or not c.is_sparse(idx):
        return attention | _swiglu_shapes("mlp.", h, c.intermediate_size)
    return attention | expert_shapes(c.moe, h)


def _swiglu_shapes(prefix: str, h: int, width: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}gate_proj.weight": (width, h),
        f"{prefix}up_proj.weight": (width, h),
        f"{prefix}down_proj.weight": (h, width),
    }


def expert_shapes(moe: MoEConfig, hidden: int) -> dict[str, tuple[int, ...]]:
    """A sparse layer's MLP sub-names and shapes: router, expert-score bias, experts, shared experts."""
    out: dict[str, tuple[int, ...]] = {"mlp.gate.weight": (moe.num_experts, hidden)}
    if moe.router == "sigmoid_grouped":
        out["mlp.gate.e_score_correction_bias"] = (moe.num_experts,)
    for e in range(moe.num_experts):
        out |= _swiglu_shapes(f"mlp.experts.{e}.", hidden, moe.moe_intermediate_size)
    if moe.n_shared_experts:
        out |= _swiglu_shapes("mlp.shared_experts.", hidden, moe.moe_intermediate_size * moe.n_shared_experts)
    return out


def target_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the target (trunk + output head), in checkpoint order."""
    h = config.hidden_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        out.update({f"model.layers.{i}.{s}": shape for s, shape in _layer_shapes(config, i).items()})
    out["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (config.vocab_size, h)
    return out


def draft_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the MTP draft layers (empty when num_nextn_predict_layers is 0)."""
    h = config.hidden_size
    out: dict[str, tuple[int, ...]] = {}
    token, hidden, proj, head = mtp_own_names(config)
    for j in range(config.num_nextn_predict_layers):
        p = f"{draft_prefix(config)}{j}."
        out[p + token] = (h,)
        out[p + hidden] = (h,)
        out[p + proj] = (h, 2 * h)
        out.update({p + s: shape for s, shape in _layer_shapes(config, config.num_hidden_layers + j).items()})
        out[p + head] = (h,)
    return out


def target_tensor_names(config: ModelConfig) -> list[str]:
    return list(target_tensor_shapes(config))


def draft_tensor_names(config: ModelConfig) -> list[str]:
    return list(draft_tensor_shapes(config))


ROUTER_SUFFIXES = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")
"""A router's tensors: stored and served in float32 whatever the model's dtype (the router runs in
float32; transformers keeps GLM-4.5's so too), so a bf16 model's choices are not bf16-rounded."""


def tensor_dtype(config: ModelConfig, name: str) -> torch.dtype:
    """The dtype tensor `name` is stored, pushed and served in: float32 for a router's, else the model's."""
    return torch.float32 if name.endswith(ROUTER_SUFFIXES) else config.dtype


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
    tensors = {
        n: t.detach().to("cpu", tensor_dtype(config, n)).contiguous()
        for n, t in native_draft_names(config, state_dict).items()
    }
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
    if family_of(config.architectures).mtp_as_decoder_layers:
        config, tensors = _draft_from_decoder_layers(config, tensors, str(path))
    check_state_dict(config, tensors, source=str(path))
    return config, tensors


_SHARED_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
"""A DeepSeek-V3-layout MTP layer's copies of the shared embedding and output head (GLM-4.5 ships them)."""


def _draft_from_decoder_layers(
    config: ModelConfig, tensors: dict[str, Tensor], source: str
) -> tuple[ModelConfig, dict[str, Tensor]]:
    """GLM-4.5's / DeepSeek-V3's MTP layers, `model.layers.{num_hidden_layers + j}.*`, under the
    contract's `mtp.layers.{j}.*`; their copies of the embedding and output head dropped where they
    equal the trunk's (refused where not: the engine shares them). A checkpoint whose config.json
    announces MTP layers but that holds none of their tensors (transformers' `save_pretrained`
    writes none) serves without them: num_nextn_predict_layers 0."""
    out: dict[str, Tensor] = {}
    found = 0
    for name, t in tensors.items():
        j = _native_draft_index(config, name)
        if j is None:
            out[name] = t
            continue
        found += 1
        sub = name.split(".", 3)[3]
        shared = _SHARED_COPIES.get(sub)
        if shared is None:
            out[f"{MTP_PREFIX}{j}.{sub}"] = t
        elif shared in tensors and not torch.equal(tensors[shared], t):
            raise CheckpointError(
                f"{source}: {name} differs from {shared}; specrl's MTP draft shares the trunk's embedding and "
                "output head, so it cannot serve this draft layer exactly"
            )
    if not found and config.num_nextn_predict_layers:
        config = dataclasses.replace(config, num_nextn_predict_layers=0)
    return config, out


def _native_draft_index(config: ModelConfig, name: str) -> int | None:
    """j for a tensor `model.layers.{num_hidden_layers + j}.*` of a decoder-layers draft layout."""
    parts = name.split(".", 3)
    if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None
    j = int(parts[2]) - config.num_hidden_layers
    return j if j >= 0 else None


def native_draft_names(config: ModelConfig, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`tensors` by the names the family's checkpoints use: a decoder-layers draft layout's
    `mtp.layers.{j}.*` as `model.layers.{num_hidden_layers + j}.*` (what `save_checkpoint` writes)."""
    if not family_of(config.architectures).mtp_as_decoder_layers:
        return dict(tensors)
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        if name.startswith(MTP_PREFIX):
            j, sub = name[len(MTP_PREFIX) :].split(".", 1)
            name = f"model.layers.{config.num_hidden_layers + int(j)}.{sub}"
        out[name] = t
    return out


def model_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """The model's parameters by contract name (the module tree mirrors the contract)."""
    return {n: p.detach() for n, p in model.named_parameters()}
