"""Draft kinds behind one interface: the target's MTP layers, or a separate EAGLE-3 draft.

Why an interface: the speculative round (`speculative.draft`, `decode_round`) and the engine's
bookkeeping (pending draft inputs, per-layer draft caches, prefill, rollback) are the same for
every draft that reads one state per confirmed target position and chains on its own outputs;
only four things differ, and a `Drafter` supplies them:

- `target_step`: the target's cached forward, returning its final-normed hidden states (the
  logits) and the draft's input state at each of those positions — the same hidden states for
  MTP; fc(low | middle | high taps) for EAGLE-3 (`model.eagle3`);
- `step(j, tokens, states, cache, plan, rope_positions)`: draft layer j over new positions;
- `head(j, out)`: draft logits over the *target* vocabulary (-inf outside a reduced draft
  vocabulary, so q is exactly 0 there and rejection sampling stays exact: EAGLE-3's from its
  checkpoint, MTP's the most frequent ids of the policy's own tokens, `draft_vocab`);
- `new_cache`: a one-layer KV cache shaped for the draft's attention (an EAGLE-3 draft's heads
  and head_dim need not be the target's).

`num_layers` draft caches per row; 0 means the engine cannot speculate (kind "none").
"""

from __future__ import annotations

import torch
from torch import Tensor

from sidecar.engine.draft_vocab import DraftVocab
from sidecar.model.eagle3 import PUSH_PREFIX, Eagle3Draft
from sidecar.model.kv_cache import AttentionPlan, KVCache
from sidecar.model.kv_pages import KVPages
from sidecar.model.model import Qwen3WithMTP


class Drafter:
    """The MTP draft of a `Qwen3WithMTP` (none when it has no MTP layers); base of the others.
    `draft_vocab_size` > 0: its head scores only that many ids (`draft_vocab.DraftVocab`)."""

    kind = "mtp"

    def __init__(self, model: Qwen3WithMTP, draft_vocab_size: int = 0) -> None:
        self.model = model
        c = model.config
        self.num_layers = c.num_nextn_predict_layers
        self.num_kv_heads, self.head_dim, self.dtype = c.num_key_value_heads, c.head_dim, c.dtype
        if not 0 <= draft_vocab_size <= c.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [0, {c.vocab_size}] (0 or the model's vocab_size: the full "
                f"vocabulary), got {draft_vocab_size}"
            )
        reduced = self.num_layers > 0 and 0 < draft_vocab_size < c.vocab_size
        self.vocab = DraftVocab(draft_vocab_size, model.output_weight()) if reduced else None
        """The reduced draft vocabulary of the MTP head, or None (the full vocabulary)."""

    @property
    def name(self) -> str:
        """ "mtp", "eagle3", or "" when there is no draft (GetInfo's speculation method)."""
        return self.kind if self.num_layers else ""

    def slot_bytes(self) -> int:
        """KV bytes of one token in all the draft's layers."""
        return self.num_layers * KVCache.slot_bytes(self.num_kv_heads, self.head_dim, self.dtype)

    def pushed_parameters(self) -> dict[str, Tensor]:
        """Parameters a weight push addresses beside the model's own (part of its DRAFT selector):
        none for MTP, whose layers are the model's `mtp.*` parameters."""
        return {}

    def new_cache(self, batch: int, capacity: int, pages: KVPages | None = None) -> KVCache:
        """One draft layer's KV cache (`pages` given: a paged one over those blocks, see `kv_cache`)."""
        return self._cache(1, self.num_kv_heads, self.head_dim, batch, capacity, pages, owner=False)

    def target_cache(self, batch: int, capacity: int, pages: KVPages | None = None) -> KVCache:
        """The target's KV cache (all trunk layers; a paged one owns the pages' row order)."""
        c = self.model.config
        return self._cache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, batch, capacity, pages, owner=True)

    def token_bytes(self) -> int:
        """KV bytes of one token in the target's layers and the draft's (a paged block's per slot)."""
        c = self.model.config
        return c.num_hidden_layers * KVCache.slot_bytes(c.num_key_value_heads, c.head_dim, c.dtype) + self.slot_bytes()

    def _cache(
        self, layers: int, heads: int, dim: int, batch: int, capacity: int, pages: KVPages | None, owner: bool
    ) -> KVCache:
        device = self.model.output_weight().device
        return KVCache(
            num_layers=layers,
            num_kv_heads=heads,
            head_dim=dim,
            dtype=self.dtype,
            device=device,
            batch=batch,
            capacity=capacity,
            pages=pages,
            owner=owner,
        )

    def target_step(
        self,
        tokens: Tensor,  # (B, S)
        cache: KVCache,  # the target's
        plan: AttentionPlan,
    ) -> tuple[Tensor, Tensor]:  # (B, S, hidden) final-normed states, (B, S, draft hidden) draft inputs
        hidden = self.model.trunk_step(tokens, cache, plan)
        return hidden, hidden

    def step(
        self, j: int, tokens: Tensor, states: Tensor, cache: KVCache, plan: AttentionPlan, rope_positions: Tensor
    ) -> Tensor:  # (B, S, draft hidden) pre-norm outputs
        return self.model.mtp_step(j, tokens, states, cache, plan, rope_positions)

    def head(self, j: int, out: Tensor) -> Tensor:  # (B, hidden) -> (B, vocab)
        if self.vocab is None:
            return self.model.mtp_head(j, out)
        return self.vocab.logits(self.model.mtp_normed(j, out))

    def observe(self, tokens: list[int]) -> None:
        """Tokens the policy saw or emitted (the reduced vocabulary's counts; nothing without one)."""
        if self.vocab is not None:
            self.vocab.count(tokens)

    def prepare(self) -> None:
        """Before a round, outside any captured graph: re-choose the reduced vocabulary when due
        and re-gather its head rows when the output weight moved (a push)."""
        if self.vocab is None:
            return
        weight = self.model.output_weight()
        if self.vocab.due():
            self.vocab.choose(weight)
        self.vocab.gather(weight)

    def on_weight_push(self) -> None:
        """A new weight version: the reduced vocabulary is chosen again from recent counts."""
        if self.vocab is not None:
            self.vocab.on_weight_push()

    def head_tensors(self) -> list[Tensor]:
        """Tensors the head reads beside the parameters (a captured round holds their addresses)."""
        return [] if self.vocab is None else [self.vocab.ids, self.vocab.rows]

    def prefill(self, caches: list[KVCache], tokens: Tensor, states: Tensor, num: list[int]) -> None:
        """Draft positions t = 0..P-2 of freshly prefilled prompts (inputs states_t and x_{t+1},
        rotary position t + 1): `num[b]` of them on row b (0: the row does not draft)."""
        width = tokens.shape[1] - 1
        for j, cache in enumerate(caches):
            plan = cache.plan(num, width=width)
            self.step(j, tokens[:, 1:], states[:, :-1], cache, plan, plan.positions + 1)
            cache.commit(plan)


class Eagle3Drafter(Drafter):
    """A separate EAGLE-3 draft beside a target without MTP layers (one draft layer)."""

    kind = "eagle3"

    def __init__(self, model: Qwen3WithMTP, draft: Eagle3Draft, draft_vocab_size: int = 0) -> None:
        super().__init__(model)
        if draft_vocab_size:
            raise ValueError(
                "draft_vocab_size reduces the MTP head's vocabulary; an EAGLE-3 draft's is fixed in its "
                "checkpoint (draft_vocab_size, d2t/t2d in its config.json): leave draft_vocab_size at 0"
            )
        if model.config.num_nextn_predict_layers:
            raise ValueError(
                "the target has MTP layers and an EAGLE-3 draft was given too: serve one draft kind "
                "(drop --draft, or use a checkpoint without num_nextn_predict_layers)"
            )
        draft.config.check_target(model.config)
        draft.check_vocab()
        if draft.config.dtype != model.config.dtype:
            raise ValueError(
                f"the draft's torch_dtype {draft.config.torch_dtype} differs from the target's "
                f"{model.config.torch_dtype}: save the draft in the target's dtype"
            )
        self.draft = draft.to(model.output_weight().device)
        self.taps = draft.config.aux_layers(model.config.num_hidden_layers)
        c = draft.config
        self.num_layers, self.num_kv_heads, self.head_dim = 1, c.num_key_value_heads, c.head_dim

    def target_step(self, tokens: Tensor, cache: KVCache, plan: AttentionPlan) -> tuple[Tensor, Tensor]:
        aux: list[Tensor] = []
        hidden = self.model.trunk_step(tokens, cache, plan, aux_layers=self.taps, aux=aux)
        return hidden, self.draft.fuse(torch.cat(aux, dim=-1))

    def step(
        self, j: int, tokens: Tensor, states: Tensor, cache: KVCache, plan: AttentionPlan, rope_positions: Tensor
    ) -> Tensor:
        return self.draft.step(tokens, states, self.model.model.embed_tokens.weight, cache, plan, rope_positions)

    def head(self, j: int, out: Tensor) -> Tensor:
        return self.draft.target_logits(out)

    def pushed_parameters(self) -> dict[str, Tensor]:
        """The draft's weights as `eagle3.<checkpoint name>` (its token maps are not pushed)."""
        return {PUSH_PREFIX + n: p for n, p in self.draft.named_parameters()}


def make_drafter(model: Qwen3WithMTP, draft: Eagle3Draft | None = None, draft_vocab_size: int = 0) -> Drafter:
    """The drafter of a served model: its MTP layers (their head over `draft_vocab_size` ids when
    > 0), or the given EAGLE-3 draft."""
    return Drafter(model, draft_vocab_size) if draft is None else Eagle3Drafter(model, draft, draft_vocab_size)
