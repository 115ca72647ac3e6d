"""Model builders shared by the engine tests (tiny, from configs; no downloads)."""

from __future__ import annotations

import torch

from sidecar.model.eagle3 import Eagle3Config, Eagle3Draft, build_eagle3
from sidecar.model.model import ModelConfig, Qwen3WithMTP, build_model
from sidecar.types import SamplingParams


def aligned_draft_model(config: ModelConfig, seed: int, eps: float = 0.002) -> Qwen3WithMTP:
    """A target that is nearly a bigram model, and an MTP layer that copies it by construction.

    The trunk's attention and MLP outputs are scaled by `eps`, so h_t ~ norm(embed(x_t)). The
    MTP layer keeps only the embedding half of eh_proj (identity) and zeroes its own attention
    and MLP outputs, so its logits are lm_head(norm(embed(x_{t+1}))): the target's prediction at
    t+1 up to the eps terms. Acceptance is high but not perfect.
    """
    model = build_model(config, seed=seed)
    h = config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(eps)
            layer.mlp.down_proj.weight.mul_(eps)
        for j in range(config.num_nextn_predict_layers):
            mtp = model.mtp_layer(j)  # either layout: the projection's embedding half passes (MiMo's is second)
            mtp.proj.weight.zero_()
            mtp.proj.weight[:, slice(h, 2 * h) if mtp.hidden_first else slice(0, h)] = torch.eye(h)
            mtp.self_attn.o_proj.weight.zero_()
            mtp.mlp.down_proj.weight.zero_()
    return model


def hf_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:  # (..., V) -> (..., V)
    """The filtered sampling distribution by Hugging Face's own logits warpers (the oracle for
    temperature -> top-k -> top-p); greedy is one-hot on the argmax."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    if sp.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    scores = TemperatureLogitsWarper(sp.temperature)(None, logits.clone())
    if sp.top_k:
        scores = TopKLogitsWarper(sp.top_k)(None, scores)
    if sp.top_p < 1:
        scores = TopPLogitsWarper(sp.top_p)(None, scores)
    return scores.softmax(-1)


TAPS = [1, 2, 3]
"""The EAGLE-3 taps of the 4-layer `eagle3_target` (the default 2, L/2, L-3 needs L >= 7)."""


def eagle3_target(vocab_size: int = 64, seed: int = 5, eps: float = 0.002) -> Qwen3WithMTP:
    """A 4-layer target without MTP layers, nearly a bigram model (see `aligned_draft_model`)."""
    model = build_model(
        ModelConfig.tiny(vocab_size=vocab_size, num_hidden_layers=4, num_nextn_predict_layers=0), seed=seed
    )
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(eps)
            layer.mlp.down_proj.weight.mul_(eps)
    return model


def aligned_eagle3(target: Qwen3WithMTP, draft_vocab: list[int] | None = None, sharpness: float = 3.0) -> Eagle3Draft:
    """An EAGLE-3 draft that copies a near-bigram target by construction (acceptance high, not 1).

    fc = 0, so refreshed positions carry no target state; q/k = the embedding half (q scaled by
    `sharpness`), so a position attends mostly to itself and to earlier copies of its token;
    v = norm(embed) - norm(state) and o = I, so the output is about norm(embed(x_{t+1})) (the
    `- norm(state)` cancels the residual of chained steps); MLP off; lm_head = the target's rows of
    the draft vocabulary. Its logits are then close to the target's prediction at t + 1."""
    c = target.config
    h = c.hidden_size
    cfg = Eagle3Config.for_target(
        c,
        num_key_value_heads=c.num_attention_heads,
        draft_vocab_size=len(draft_vocab) if draft_vocab else c.vocab_size,
        aux_layer_ids=TAPS if c.num_hidden_layers < 7 else None,
    )
    assert cfg.num_attention_heads * cfg.head_dim == h
    draft = build_eagle3(cfg, seed=0)
    eye = torch.eye(h)
    with torch.no_grad():
        draft.fc.weight.zero_()
        attn = draft.midlayer.self_attn
        for proj, half in ((attn.q_proj, sharpness * eye), (attn.k_proj, eye)):
            proj.weight.zero_()
            proj.weight[:, :h] = half
        attn.v_proj.weight.copy_(torch.cat([eye, -eye], dim=1))
        attn.o_proj.weight.copy_(eye)
        draft.midlayer.mlp.down_proj.weight.zero_()
        ids = torch.tensor(draft_vocab) if draft_vocab else torch.arange(c.vocab_size)
        draft.lm_head.weight.copy_(target.output_weight()[ids])
        draft.set_draft_vocab(ids)
    return draft
