"""Acceptance rules of speculative decoding: the exact one, and known-wrong ones to measure power.

The engine accepts drafts with `sampling.rejection_sample` (exact: the emitted tokens follow
the target; `sampling.AcceptanceRule` is its signature). This module holds the
deliberately WRONG rules that a losslessness test must be able to reject — the bugs that
published "lossless" speculative RL systems actually shipped:

- `accept_every_draft`: every draft is kept (the output follows the draft q, not the target p);
- `resample_from_target`: on rejection the emitted token is drawn from p instead of the
  residual norm(max(0, p - q)) — biased towards tokens both models like;
- `greedy_verification`: a draft is accepted iff it is the target's argmax (what some backends'
  verify kernels do even for sampling requests);
- `in_fraction_of_rounds(rule, f)`: the wrong rule in a random fraction f of the rounds only
  (a smaller deviation, to show how small a bug a test can see).

Who uses the wrong rules: `specrl verify` simulates them on the verifier side, on the
deployment's own weights, to state the power of its tests; the engine tests inject them into a
`TorchEngine` with `with_acceptance_rule` to show that the certificate fails on them. Production
code never sets a rule: the engine's rule is the exact one, and no constructor takes another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from sidecar.engine.torch_engine import TorchEngine

from sidecar.engine.sampling import Acceptance, AcceptanceRule, rejection_sample, sample_from

EXACT: AcceptanceRule = rejection_sample
"""The engine's rule: accept w.p. min(1, p/q), resample from the residual on rejection."""


def accept_every_draft(
    draft_tokens: Tensor, q: Tensor, p: Tensor, num_draft: Tensor, accept_uniforms: Tensor, final_uniforms: Tensor
) -> Acceptance:
    """WRONG: keep every draft, then the bonus token from p (the output follows q)."""
    rows = torch.arange(len(num_draft), device=p.device)
    return Acceptance(num_accepted=num_draft.clone(), next_token=sample_from(p[rows, num_draft], final_uniforms))


def resample_from_target(
    draft_tokens: Tensor, q: Tensor, p: Tensor, num_draft: Tensor, accept_uniforms: Tensor, final_uniforms: Tensor
) -> Acceptance:
    """WRONG: the exact acceptance test, but a rejected position is resampled from p, not the residual."""
    acc = rejection_sample(draft_tokens, q, p, num_draft, accept_uniforms, final_uniforms)
    rows = torch.arange(len(num_draft), device=p.device)
    return Acceptance(num_accepted=acc.num_accepted, next_token=sample_from(p[rows, acc.num_accepted], final_uniforms))


def greedy_verification(
    draft_tokens: Tensor, q: Tensor, p: Tensor, num_draft: Tensor, accept_uniforms: Tensor, final_uniforms: Tensor
) -> Acceptance:
    """WRONG at temperature > 0: accept a draft iff it is the target's argmax, emit the argmax
    after it (what a greedy-only verify kernel does to a sampling request)."""
    b, k = draft_tokens.shape
    best = p.argmax(dim=-1)  # (B, K+1)
    ok = (draft_tokens == best[:, :k]) & (torch.arange(k, device=p.device)[None, :] < num_draft[:, None])
    num_accepted = ok.to(torch.int64).cumprod(dim=1).sum(dim=1)
    return Acceptance(num_accepted=num_accepted, next_token=best[torch.arange(b, device=p.device), num_accepted])


WRONG_RULES: dict[str, AcceptanceRule] = {
    "accept_every_draft": accept_every_draft,
    "resample_from_target": resample_from_target,
    "greedy_verification": greedy_verification,
}
"""The built-in wrong rules by name."""

POWER_RULES = ("accept_every_draft", "resample_from_target")
"""The rules a certificate's power statement simulates by default: the gross and the subtle
error (greedy verification at temperature > 0 is grosser still)."""


class _InFractionOfRounds:
    """`rule` for a row in a fraction of the rounds, the exact rule otherwise.

    Which rounds go wrong is drawn from this object's own generator, so the rows' own random
    streams (and thus the tokens of the exact rounds) are untouched.
    """

    def __init__(self, rule: AcceptanceRule, fraction: float, seed: int) -> None:
        self.rule = rule
        self.fraction = fraction
        self._generator = torch.Generator().manual_seed(seed)

    def __call__(
        self,
        draft_tokens: Tensor,
        q: Tensor,
        p: Tensor,
        num_draft: Tensor,
        accept_uniforms: Tensor,
        final_uniforms: Tensor,
    ) -> Acceptance:
        args = (draft_tokens, q, p, num_draft, accept_uniforms, final_uniforms)
        exact, wrong = rejection_sample(*args), self.rule(*args)
        use_wrong = (torch.rand(len(num_draft), generator=self._generator) < self.fraction).to(p.device)
        return Acceptance(
            num_accepted=torch.where(use_wrong, wrong.num_accepted, exact.num_accepted),
            next_token=torch.where(use_wrong, wrong.next_token, exact.next_token),
        )


def in_fraction_of_rounds(rule: AcceptanceRule, fraction: float, seed: int = 0) -> AcceptanceRule:
    """`rule` in a random `fraction` of each row's rounds (0 < fraction <= 1), exact otherwise."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return rule if fraction == 1.0 else _InFractionOfRounds(rule, fraction, seed)


def with_acceptance_rule(engine: TorchEngine, rule: AcceptanceRule) -> TorchEngine:
    """`engine`, now accepting drafts with `rule` instead of the exact rule (for power
    simulations and tests only: the engine never serves a wrong rule otherwise)."""
    engine.runner.acceptance_rule = rule
    return engine
