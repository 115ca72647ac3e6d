"""The target's exact distributions, computed on the verifier side by teacher-forced forwards.

The verifier loads the checkpoint with the embedded engine's model code and proves it holds the
sidecar's weights (`weight_mismatches` against DescribeWeights' checksums). Then, for each
sampled sequence, one plain full forward (no KV cache, no speculation, no engine) over
prompt + tokens gives the logits that predicted every token; the engine's documented semantics
turn them into

- the sampling distribution of each token (`sampling.filtered_probs`: temperature, then top-k,
  then top-p, renormalised; one-hot on the argmax at temperature 0), and
- the reported log-prob of each token (`sampling.token_logprobs`: log_softmax(logits / T) in
  float32, T = 1 at temperature 0, before top-k/top-p).

That is the null hypothesis the statistics test: each sampled token was drawn from exactly the
distribution plain sampling would have used after that sample's own prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from sidecar.engine.sampling import RowSampling, filtered_probs, token_logprobs
from sidecar.model.checkpoint import load_checkpoint
from sidecar.model.eagle3 import PUSH_PREFIX, Eagle3Draft
from sidecar.model.model import Qwen3WithMTP, build_model
from sidecar.types import SamplingParams, TensorSpec
from sidecar.weight_transport.tensors import tensor_crc32


def load_model(path: str | Path) -> Qwen3WithMTP:
    """The checkpoint at `path` in the embedded engine's model code, on CPU, in eval mode."""
    config, tensors = load_checkpoint(path)
    model = build_model(config, device="cpu")
    model.load_state_dict(tensors, strict=True)
    return model.eval()


def weight_mismatches(model: Qwen3WithMTP, served: Sequence[TensorSpec], draft: Eagle3Draft | None = None) -> list[str]:
    """Why `model` (and `draft`, the served EAGLE-3 draft's local copy) is not the served model
    (empty when every served tensor's name, dtype, shape and CRC-32 equal the local one's).
    `served` comes from DescribeWeights(include_checksums). Without `draft`, a served EAGLE-3
    draft's tensors (`eagle3.*`) are not compared: a draft's weights do not bear on exactness."""
    params: dict[str, Tensor] = dict(model.named_parameters())
    if draft is not None:
        params |= {PUSH_PREFIX + n: p for n, p in draft.named_parameters()}
    else:
        served = [s for s in served if not s.name.startswith(PUSH_PREFIX)]
    problems = []
    for spec in served:
        local = params.get(spec.name)
        if local is None:
            problems.append(f"{spec.name}: served but absent from the local checkpoint")
        elif local.dtype != spec.dtype or tuple(local.shape) != tuple(spec.shape):
            problems.append(
                f"{spec.name}: served {spec.dtype} {tuple(spec.shape)}, local {local.dtype} {tuple(local.shape)}"
            )
        elif tensor_crc32(local) != spec.crc32:
            problems.append(f"{spec.name}: CRC-32 {spec.crc32:08x} served, {tensor_crc32(local):08x} local")
    names = {s.name for s in served}
    problems += [f"{n}: in the local checkpoint but not served" for n in params if n not in names]
    return problems


@dataclass(kw_only=True, slots=True)
class ExactTokens:
    """Exact quantities for every token of a set of samples of one prompt."""

    probs: Tensor
    """(n, L, V) float64 the distribution each token was to be drawn from (0 past a sample's end)."""
    logprobs: Tensor
    """(n, L) float32 the documented reported log-prob of each token."""
    argmax_margin: Tensor
    """(n, L) float32 max logit minus the token's logit (0 for a greedy-correct token)."""
    mask: Tensor
    """(n, L) bool: the position holds a generated token."""
    tokens: Tensor
    """(n, L) int64 the tokens (0 past a sample's end)."""


@torch.inference_mode()
def exact_tokens(
    model: Qwen3WithMTP,
    prompt: Sequence[int],
    samples: Sequence[Sequence[int]],
    sampling: SamplingParams,
    *,
    batch_size: int = 256,
) -> ExactTokens:
    """Teacher-forced exact distributions and log-probs of `samples` (generated tokens) after
    `prompt`; identical samples share one forward."""
    n, width = len(samples), max((len(s) for s in samples), default=0)
    vocab = model.config.vocab_size
    tokens = torch.zeros(n, width, dtype=torch.int64)
    mask = torch.zeros(n, width, dtype=torch.bool)
    for i, s in enumerate(samples):
        tokens[i, : len(s)] = torch.tensor(list(s), dtype=torch.int64)
        mask[i, : len(s)] = True
    unique, inverse = torch.unique(torch.cat([tokens, mask.to(torch.int64)], dim=1), dim=0, return_inverse=True)
    u_tokens = unique[:, :width]
    prompt_t = torch.tensor(list(prompt), dtype=torch.int64)
    logits = torch.empty(len(unique), width, vocab, dtype=torch.float32)
    for start in range(0, len(unique), batch_size):
        chunk = u_tokens[start : start + batch_size]
        ids = torch.cat([prompt_t.expand(len(chunk), -1), chunk], dim=1)
        # logits at prompt_len-1 .. prompt_len+width-2 predict generated tokens 0 .. width-1
        out = model(ids)[:, len(prompt) - 1 : len(prompt) - 1 + width]
        logits[start : start + len(chunk)] = out.float()
    logits = logits[inverse]  # (n, width, V)
    rows = RowSampling.of([sampling] * n)
    probs = filtered_probs(logits, rows).double() * mask[..., None]
    logprobs = token_logprobs(logits, tokens, rows.temperature)
    margin = logits.max(dim=-1).values - logits.gather(-1, tokens[..., None])[..., 0]
    return ExactTokens(probs=probs, logprobs=logprobs, argmax_margin=margin, mask=mask, tokens=tokens)


@torch.inference_mode()
def draw_prompts(
    model: Qwen3WithMTP, count: int, length: int, seed: int, first_token: int | None = None
) -> list[list[int]]:
    """`count` prompts of `length` tokens sampled from the target itself (temperature 1) after
    `first_token` (the tokenizer's BOS gives in-distribution prompts) or, when None, a random
    one: contexts for any checkpoint, no tokenizer needed."""
    gen = torch.Generator().manual_seed(seed)
    if first_token is None:
        ids = torch.randint(0, model.config.vocab_size, (count, 1), generator=gen)
    else:
        ids = torch.full((count, 1), first_token, dtype=torch.int64)
    for _ in range(length - 1):
        probs = torch.softmax(model(ids)[:, -1].double(), dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return ids.tolist()
