"""A reduced draft vocabulary for the MTP head: FR-Spec's frequency-ranked draft (arXiv 2502.14856).

Why: the MTP draft scores every token with the target's whole output head, a (vocab, hidden)
matrix it reads once per draft token. At Qwen3 shapes that head is most of what a draft step
reads (151,936 x 4,096 at 8B: 1.2 GB in bf16, more than the MTP layer itself), while an RL policy
emits a small, skewed part of its vocabulary. FR-Spec drafts over the `size` most frequent ids
only and keeps decoding exact: the draft's logits are -inf outside the subset, so q is exactly 0
there, a draft never proposes such a token, and rejection sampling (accept with min(1, p/q), else
resample from norm(max(0, p - q))) still emits exactly the target's distribution — any q does; a
smaller support only lowers acceptance. The target decides greedy decoding token for token too.

Here the frequencies are the policy's own: every token the engine sees (prompts at admission,
every emitted token) is counted on the host. The subset is re-chosen between engine steps: at
every weight push (the policy moved), and whenever the tokens counted since the last choice are
as many as those counted before it, at most `RECHOOSE_TOKENS` (so after 1, 2, 4, ... tokens at
first — the initial subset, ids 0..size-1, knows nothing — then every `RECHOOSE_TOKENS`). A push
also halves the counts, so a count's weight halves with every version and the subset follows the
policy's drift. Ties go to the smaller id: the subset is a pure function of the counts.

The subset's rows of the output weight are gathered into one contiguous (size, hidden) tensor
when the subset changes or the weight does (a push; its version counter, as `decode_weights`
does), so a draft token reads size x hidden weights instead of vocab x hidden. The ids and the rows
keep their storage for the engine's life (changes are copied in place): a captured CUDA graph
(`round_graphs`) reads them at the addresses it was captured with.

What it does not keep: at temperature > 0 a sample depends on q, so on the subset, so on what the
sidecar generated before (it stays exactly distributed, but is not reproducible from its seed
alone, like automatic k). That is one reason it is off by default (`draft_vocab_size` 0).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

RECHOOSE_TOKENS = 4096
"""Most counted tokens between two choices of the subset without a weight push."""


class DraftVocab:
    """The draft vocabulary of an MTP head: `size` target ids, their output-weight rows, and the
    token counts they are chosen from (see the module docstring)."""

    def __init__(self, size: int, weight: Tensor) -> None:
        """`weight`: the output projection (vocab, hidden) the rows are gathered from."""
        vocab = weight.shape[0]
        if not 0 < size < vocab:
            raise ValueError(
                f"draft_vocab_size must be in [1, {vocab}) for a reduced draft vocabulary (0: the full "
                f"vocabulary of {vocab} ids), got {size}"
            )
        self.size, self.vocab_size = size, vocab
        self.ids = torch.arange(size, device=weight.device)  # (size,) int64 target ids, ascending
        """The subset's target ids, ascending (storage kept: captured graphs read it)."""
        self.rows = torch.empty(size, weight.shape[1], dtype=weight.dtype, device=weight.device)
        """(size, hidden) the output weight's rows of `ids`, contiguous (storage kept)."""
        self.counts = torch.zeros(vocab, dtype=torch.int64)
        """Host counts of every id seen (halved at each weight push)."""
        self.counted = 0
        """Tokens counted since the subset was last chosen."""
        self.total = 0
        """Tokens in `counts` (halved with them)."""
        self._pushed = False  # a weight push since the last choice
        self.chosen = 0
        """Times the subset was chosen from counts (0: still the initial ids 0..size-1)."""
        self._gathered: tuple[int, int] | None = None  # the weight's (address, version) when its rows were gathered
        self.gather(weight)

    # ---- counting and choosing (host, between engine steps) ---------------------------------
    def count(self, tokens: Iterable[int]) -> None:
        """Count token ids the policy saw or emitted."""
        ids = torch.as_tensor(list(tokens), dtype=torch.int64)
        if ids.numel():
            self.counts.index_put_((ids,), torch.ones_like(ids), accumulate=True)
            self.counted += ids.numel()
            self.total += ids.numel()

    def forget(self) -> None:
        """Drop every count (the subset is chosen again from the next tokens counted)."""
        self.counts.zero_()
        self.counted = self.chosen = self.total = 0

    def due(self) -> bool:
        """Whether to choose again: a push since the last choice, or as many tokens counted since
        it as before it (at least one, at most `RECHOOSE_TOKENS`)."""
        before = self.total - self.counted
        return self.counted > 0 and (self._pushed or self.counted >= min(max(before, 1), RECHOOSE_TOKENS))

    def on_weight_push(self) -> None:
        """A new policy: halve the counts (older versions weigh less) and choose again at the next round."""
        self.counts //= 2
        self.total = int(self.counts.sum())
        self.counted = min(self.counted, self.total)
        self._pushed = True

    def choose(self, weight: Tensor) -> bool:
        """Re-choose the subset from the counts (the `size` most frequent ids, ties to the smaller
        id) and gather its rows when it changed; True when it changed."""
        self.counted, self._pushed = 0, False
        self.chosen += 1
        ids = most_frequent(self.counts, self.size).to(self.ids.device)
        if torch.equal(ids, self.ids):
            return False
        self.ids.copy_(ids)
        self._gathered = None
        self.gather(weight)
        return True

    def gather(self, weight: Tensor) -> None:
        """Copy the subset's rows of `weight` into `rows` (in place) when the weight or the subset
        changed since the last gather. An inference tensor keeps no version counter: gathered every call."""
        try:
            now: tuple[int, int] | None = (weight.data_ptr(), weight._version)
        except RuntimeError:
            now = None
        if now is None or now != self._gathered:
            with torch.no_grad():
                torch.index_select(weight, 0, self.ids, out=self.rows)
            self._gathered = now

    # ---- the head (device, inside a round: no host reads) ------------------------------------
    def logits(self, normed: Tensor) -> Tensor:  # (..., hidden) -> (..., vocab), -inf outside the subset
        """Draft logits over the target vocabulary from final-normed states: the subset's rows only."""
        small = F.linear(normed, self.rows)  # (..., size)
        full = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy(-1, self.ids, small)


def most_frequent(counts: Tensor, size: int) -> Tensor:  # (vocab,) int64 -> (size,) int64 ascending ids
    """The `size` ids of the largest counts, ties broken towards the smaller id, in ascending order."""
    vocab = counts.shape[0]
    key = counts.to(torch.int64) * vocab + (vocab - 1 - torch.arange(vocab))  # distinct: no tie left to topk
    return key.topk(size).indices.sort().values
