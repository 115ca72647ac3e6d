"""Teacher-forced scoring: the log-probs a trainer recomputes, by the plain full forward.

No cache and no speculation: the reference forward itself (`Qwen3WithMTP.forward`), so a score
is exactly what the policy assigns, whatever the engine's decode path does. Kept apart from
`torch_engine.py` (which serves it) because it shares nothing with the decode round.
"""

from __future__ import annotations

import torch

from sidecar.engine.sampling import token_logprobs
from sidecar.errors import InvalidRequestError
from sidecar.model.model import Qwen3WithMTP
from sidecar.types import ScoreRequest

SCORE_TOKENS = 8192
"""Sequence tokens per scoring forward (bounds the logits tensor to ~this x vocab floats)."""


def score(model: Qwen3WithMTP, request: ScoreRequest) -> list[list[float]]:
    """Teacher-forced log-probs with the plain full forward (no cache, no speculation), in
    groups of sequences of about SCORE_TOKENS tokens, right-padded (causal: the padding
    never reaches a real position)."""
    config, device = model.config, model.output_weight().device
    vocab, context = config.vocab_size, config.max_position_embeddings
    for i, seq in enumerate(request.sequences):
        bad = [t for t in seq if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"sequences[{i}] holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if len(seq) > context:
            raise InvalidRequestError(f"sequences[{i}] has {len(seq)} tokens, more than the model context of {context}")
    temperature = request.temperature if request.temperature > 0 else 1.0
    order = list(range(len(request.sequences)))
    group: list[int] = []
    out: list[list[float]] = [[] for _ in order]

    def flush() -> None:
        seqs = [request.sequences[i] for i in group]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.int64)
        for row, s in enumerate(seqs):
            ids[row, : len(s)] = torch.tensor(s)
        ids = ids.to(device)
        with torch.no_grad():
            logits = model(ids)  # (b, width, V): position t predicts token t + 1
        temps = torch.full((len(seqs),), temperature, dtype=torch.float32, device=device)
        lps = token_logprobs(logits[:, :-1], ids[:, 1:], temps)  # (b, width - 1)
        for row, i in enumerate(group):
            start, n = request.start_indices[i], len(request.sequences[i])
            out[i] = lps[row, start - 1 : n - 1].tolist()

    tokens = 0
    for i in order:
        n = len(request.sequences[i])
        if group and tokens + n > SCORE_TOKENS:
            flush()
            group, tokens = [], 0
        group.append(i)
        tokens += n
    if group:
        flush()
    return out
