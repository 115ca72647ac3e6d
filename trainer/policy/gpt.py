"""The policy network as a megatron-core ``GPTModel``, equal to the engine's decoder of each family.

Qwen3 (Yang et al. 2025, arXiv:2505.09388), Qwen2 and Llama in Megatron's vocabulary: RMSNorm
(``normalization``), SwiGLU (``gated_linear_unit`` + ``silu``), grouped-query attention
(``num_query_groups``), RMSNorm on each query/key head before the rotary embedding where the family
has it (``qk_layernorm``: Qwen3), biases on q/k/v only where it has them (``add_qkv_bias``: Qwen2;
never on the output projection or the MLP), the family read from config.json's ``architectures``
(`sidecar.model.architectures.FAMILIES`, the descriptor the engine reads); RoPE, YaRN or llama3
configured from ``yarn`` (`yarn.megatron.configure`, the same ``RopeConfig`` the engines use), tied
or untied output head. The local (pure megatron-core) layer spec is used without
TransformerEngine, the TE spec where TE is importable on CUDA. Mixture-of-experts families
(Qwen3-MoE, GLM-4.5: `ModelConfig.moe`) get Megatron-core's MoE layers where the engine's layers are
sparse, their routers configured by `trainer.policy.moe` (and GLM-4.5's partial rotary as
``rotary_percent``).

`forward` returns the tensor-parallel logits shard *and* the final hidden states after the final
norm (what the output layer sees), which the MTP draft head consumes (detached). Dropout is 0: the
RL objective needs deterministic log-probs, and the engine has none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from sidecar.model.architectures import Family, family_of
from sidecar.model.config import ModelConfig
from trainer.policy import moe, platform


def _te_available() -> bool:
    if not platform.has_cuda():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def check_hf_config(hf: Mapping[str, Any], *, tensor_parallel: int, expert_parallel: int = 1) -> None:
    """Raise ValueError naming the key when `hf` cannot be built (or sharded) as asked."""
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in hf:
            raise ValueError(f"model config lacks {key!r}; it must carry the config.json keys of its family")
    heads = int(hf["num_attention_heads"])
    groups = int(hf.get("num_key_value_heads") or heads)
    if heads % groups:
        raise ValueError(f"num_attention_heads={heads} must be a multiple of num_key_value_heads={groups}")
    for key, value in (
        ("num_key_value_heads", groups),
        ("num_attention_heads", heads),
        ("vocab_size", int(hf["vocab_size"])),
        ("intermediate_size", int(hf["intermediate_size"])),
    ):
        if value % tensor_parallel:
            raise ValueError(
                f"{key}={value} is not divisible by tensor_parallel={tensor_parallel}; choose a tensor-parallel "
                "size that divides it (the vocabulary is not padded, so log-probs stay exact)"
            )
    experts = model_config(hf).moe
    if experts is not None:
        moe.check(experts, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel)
    elif expert_parallel > 1:
        raise ValueError(f"expert_parallel={expert_parallel} but the model is dense (no experts): set it to 1")


def model_config(hf: Mapping[str, Any]) -> ModelConfig:
    """The engine's reading of a config.json dict: its attention variants (GLM-4.5 reads
    attention_bias, use_qk_norm and partial_rotary_factor from it) and its experts."""
    return ModelConfig.from_hf_dict(hf)


def family(hf: Mapping[str, Any]) -> Family:
    """The family of a config.json dict (its attention variants), as the engine reads it."""
    archs = hf.get("architectures")
    return family_of(list(archs) if archs else None, hf.get("model_type"))


def transformer_config(
    hf: Mapping[str, Any],
    *,
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
    router: moe.RouterConfig | None = None,
) -> Any:
    """megatron-core ``TransformerConfig`` for a config.json dict of a supported family (float32, no
    dropout); a mixture of experts' keys from `trainer.policy.moe.megatron_kwargs`."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_hf_config(hf, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel)
    heads = int(hf["num_attention_heads"])
    attention = model_config(hf)
    experts: dict[str, Any] = {}
    if attention.moe is not None:
        experts = moe.megatron_kwargs(
            attention.moe,
            int(hf["num_hidden_layers"]),
            router or moe.RouterConfig(),
            tensor_parallel=tensor_parallel,
            expert_parallel=expert_parallel,
        )
    return TransformerConfig(
        num_layers=int(hf["num_hidden_layers"]),
        hidden_size=int(hf["hidden_size"]),
        ffn_hidden_size=int(hf["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads") or heads),
        kv_channels=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=attention.attention_bias,
        qk_layernorm=attention.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Fusions are CUDA kernels (or TE); the unfused paths are exact in float32.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # Initialise the full matrix and split it: the same seed gives the same model at any TP size.
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        **experts,
    )


def build_gpt_model(
    hf: Mapping[str, Any],
    *,
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
    router: moe.RouterConfig | None = None,
) -> Any:
    """A megatron-core ``GPTModel`` for `hf` (Megatron parallel state must be initialised). A
    mixture of experts gets one layer spec per layer (dense or sparse: ``moe_layer_freq``), its
    experts a ``SequentialMLP`` on the local spec (the TE spec's ``TEGroupedMLP`` on CUDA with
    TransformerEngine, untested here), and a `trainer.policy.moe.PositionReplay` slot in every router."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    import yarn.megatron

    platform.apply_cpu_accommodations()
    config = transformer_config(hf, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel, router=router)
    engine_config = model_config(hf)
    rope = engine_config.rope_config()  # head_dim: the rotated dimensions (GLM-4.5's partial rotary)
    rope_kwargs = yarn.megatron.configure(config, rope, rotary_percent=engine_config.partial_rotary_factor)
    qk_norm = config.qk_layernorm
    spec: Any
    if config.num_moe_experts:
        platform.apply_moe_accommodations()
        # SequentialMLP on both specs: the grouped experts (TEGroupedMLP) need CUDA kernels and
        # name their weights otherwise (`experts.linear_fc1.weight{e}`), which the bridge does not map
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=_te_available(), normalization="RMSNorm")
    elif _te_available():
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=int(hf["vocab_size"]),
        max_sequence_length=int(hf.get("max_position_embeddings", 4096)),
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        **rope_kwargs,
    )
    yarn.megatron.install_frequencies(model, rope)
    if config.num_moe_experts:
        moe.install_replay(model)
    return model.to(platform.device())


def forward(model: Any, tokens: Tensor) -> tuple[Tensor, Tensor]:  # tokens: (B, S) int64
    """Full causal forward. Returns (logits (B, S, V/tp) this rank's vocab shard, hidden (B, S, H)).

    `hidden` is the decoder output after the final norm — the input of the output layer — captured
    with a forward hook on ``model.decoder`` so only GPTModel's public forward is used.
    """
    platform.apply_cpu_accommodations()  # cheap identity check; megatron calls current_device per forward
    batch, seq = tokens.shape
    captured: list[Tensor] = []
    handle = model.decoder.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        position_ids = torch.arange(seq, device=tokens.device)[None].expand(batch, seq)
        logits = model(tokens, position_ids, platform.attention_mask(seq, tokens.device))  # (B, S, V/tp)
    finally:
        handle.remove()
    return logits, captured[0].transpose(0, 1)  # decoder output is (S, B, H)


def forward_taps(model: Any, tokens: Tensor, layers: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
    """`forward`, plus the residual stream *entering* each of `layers` (0: the embedding's output),
    concatenated low to high: (logits (B, S, V/tp), hidden (B, S, H), taps (B, S, len(layers) H)).

    The taps an EAGLE-3 draft reads (`sidecar.model.eagle3`: the engine taps the same points of its
    own forward). Captured with forward pre-hooks on the decoder's layers, so the computation is
    `forward`'s, bit for bit; the taps share the forward's graph (detach them to train a draft)."""
    found: dict[int, Tensor] = {}
    handles = []
    for i in layers:
        if not 0 <= i < len(model.decoder.layers):
            raise ValueError(f"tap layer {i} outside the decoder's {len(model.decoder.layers)} layers")

        def hook(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any], i: int = i) -> None:
            found[i] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

        handles.append(model.decoder.layers[i].register_forward_pre_hook(hook, with_kwargs=True))
    try:
        logits, hidden = forward(model, tokens)
    finally:
        for handle in handles:
            handle.remove()
    return logits, hidden, torch.cat([found[i].transpose(0, 1) for i in layers], dim=-1)  # layers see (S, B, H)


def token_logprobs(
    logits: Tensor,  # (B, S, V/tp) this rank's vocab shard
    targets: Tensor,  # (B, S) int64 token ids
    temperature: float = 1.0,
) -> Tensor:  # (B, S) float32
    """log_softmax(logits / T)[target] over the full vocabulary, tensor-parallel aware.

    The engine's definition (proto Sample.logprobs): T = 1 when sampling is greedy (T = 0). Uses
    megatron-core's vocab-parallel cross entropy (differentiable), which never gathers the
    vocabulary. Its forward subtracts the max *in place* from a float32 input, so it always gets
    a fresh tensor here.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    t = temperature if temperature > 0 else 1.0
    scaled = logits.float() / t  # a new tensor: see the docstring
    return -vocab_parallel_cross_entropy(scaled, targets)


def gather_vocab(logits: Tensor) -> Tensor:  # (..., V/tp) -> (..., V), differentiable
    """All-gather a vocab-parallel tensor over the tensor-parallel group (identity at TP 1)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits)


def output_weight(model: Any) -> Tensor:  # (V/tp, H)
    """The output layer's weight (the embedding when tied), this rank's vocab shard."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def shared_head(model: Any) -> Callable[[Tensor], Tensor]:
    """The output head for the draft: hidden (..., H) -> full-vocab logits (..., V), weight DETACHED.

    Tensor-parallel like Megatron's ColumnParallelLinear: the input enters through
    ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce of the input gradient
    backward — each rank only sees its vocab shard's contribution) and the shard logits are
    all-gathered. The weight is detached, so no gradient reaches the trunk's head.
    """
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    weight = output_weight(model).detach()
    return lambda h: gather_vocab(F.linear(copy_to_tensor_model_parallel_region(h), weight))


def embed(model: Any, tokens: Tensor) -> Tensor:  # tokens (B, S) -> (B, S, H)
    """Word embeddings of `tokens` (vocab-parallel lookup, all-reduced; no position embedding)."""
    return model.embedding.word_embeddings(tokens)
