"""The draft-collapse alarm: a weight version whose draft stopped working, said out loud.

Why: the failure users of every framework report is a draft whose weights were lost or left
stale by a weight sync or a sleep/wake cycle (SGLang #31674/#13268, verl #6947, vLLM #52487).
Outputs stay exact — rejection sampling is lossless for any draft — so nothing errors: the
acceptance length tau falls to ~1.0 and rollouts slow down by a quarter, silently. A sidecar
therefore compares each weight version's acceptance with that of the last version whose draft
worked, and raises `DraftCollapse` (GetStats `draft_collapsed`, Prometheus
`specrl_draft_collapsed`, a warning in the fleet's and the trainer's logs) when it falls to ~1.

What is judged: tau over the verify steps that drafted, 1 + A / n, where n counts the verify
steps (one row's round) with at least one draft token and A the draft tokens they accepted
(`drafting_tau`). Plain rounds are left out: automatic k chooses k = 0 wherever drafting does
not pay, and a version decoded plainly is not a collapsed draft. A version is

- *collapsed* when n >= `min_rounds`, its samples finished s >= `min_samples` and
  1 + A / n <= `collapsed_tau` (1.05: within 5% of plain decoding);
- *working* when n >= `min_rounds`, s >= `min_samples` and 1 + A / n >= `healthy_tau` (1.2);
- undecided otherwise (too little evidence, or in between: a weak draft is the controller's
  business, not an alarm).

The alarm fires on the first collapsed version newer than a working one (the *reference*: the
newest working version seen), and stays raised through later collapsed or undecided versions;
it clears when a later version is judged working. One collapse is one episode (`collapses`
counts them), whatever number of versions it spans.

Calibration (`specrl bench collapse-calibration` simulates the rule's sequential check after every
engine step over a version's life of 4,096 drafting rounds; rows with per-row acceptance
~ Beta(mean, relative sd 0.5), finishing after a geometric number of rounds; 20,000 versions per
line, 2026-11-27; README, "Drafts cannot silently go stale", has the table):

- false alarms: a working draft of per-token acceptance 0.3 (tau 1.3 at k = 1, the hardest k;
  1.42 at k = 3) raised 0 alarms in 20,000 versions (< 1.5e-4 at 95%) at batch 1 with rows of
  256 rounds, at batch 8 with rows of 64, and at k = 3; so did acceptance 0.2. Independent rounds
  would give P(Binomial(256, 0.3) <= 12) = 1.2e-24 at the first check: rows, not rounds, make the
  evidence noisy. A weak draft of acceptance 0.1 alarms on 0.5-0.9% of versions; 0.05, the
  threshold itself, on 85%;
- power: a dead draft (acceptance 0, tau exactly 1.0) fires on every version that reaches
  `min_rounds` drafting rounds and `min_samples` samples (99.1% of the simulated lives at batch 1
  with rows of 256 rounds: the rest finished fewer than 8 rows); a near-dead one of acceptance
  0.02 (a random draft over a small vocabulary) on 99.0% there and on 100% at batch 8, 0.03 on
  100%.

`min_rounds` = 256: a collapsed version drafts in vain for 256 rounds (4 engine steps at batch 64)
before automatic k holds it. `min_samples` = 8 keeps a few prompts the draft cannot predict (long
rows whose rounds are all low) from judging a version alone: with 4, a working draft (0.3)
alarmed on 1 of 2,000 simulated versions at batch 1 with rows of 256 rounds.

Pure logic: counters in, verdicts out (no torch, no clock); `fires` works elementwise on numbers
or tensors alike, so the calibration simulates this very rule.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from sidecar.types import DraftCollapse, SpeculationCounters, VersionStats


@dataclass(kw_only=True, slots=True)
class CollapseRule:
    """Thresholds of the collapse alarm (see the module docstring for their error rates)."""

    collapsed_tau: float = 1.05
    """tau over drafting verify steps at or below which a version's draft counts as collapsed."""
    healthy_tau: float = 1.2
    """tau over drafting verify steps at or above which a version's draft counts as working (a
    reference a later collapse is measured against)."""
    min_rounds: int = 256
    """Drafting verify steps (row rounds with >= 1 draft token) a version needs for a verdict."""
    min_samples: int = 8
    """Samples finished on a version before it gets a verdict (evidence from several rows)."""

    def __post_init__(self) -> None:
        if not 1.0 <= self.collapsed_tau < self.healthy_tau:
            raise ValueError(
                f"CollapseRule needs 1 <= collapsed_tau < healthy_tau, got collapsed_tau={self.collapsed_tau}, "
                f"healthy_tau={self.healthy_tau}; a collapsed draft's tau is ~1.0, a working one's well above"
            )
        for name in ("min_rounds", "min_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"CollapseRule.{name} must be >= 1, got {getattr(self, name)}")

    def fires(self, rounds: Any, accepted: Any, samples: Any) -> Any:
        """Whether a version with `rounds` drafting verify steps, `accepted` draft tokens accepted
        and `samples` finished counts as collapsed (elementwise on tensors)."""
        enough = (rounds >= self.min_rounds) & (samples >= self.min_samples)
        return enough & (accepted <= (self.collapsed_tau - 1.0) * rounds)

    def verdict(self, stats: VersionStats) -> Verdict:
        """A version's verdict from its counters."""
        rounds = drafting_rounds(stats.counters)
        accepted = stats.counters.accepted_tokens
        if self.fires(rounds, accepted, stats.samples_finished):
            return Verdict.COLLAPSED
        enough = rounds >= self.min_rounds and stats.samples_finished >= self.min_samples
        return Verdict.WORKING if enough and accepted >= (self.healthy_tau - 1.0) * rounds else Verdict.UNDECIDED


class Verdict(enum.Enum):
    COLLAPSED = "collapsed"
    WORKING = "working"
    UNDECIDED = "undecided"


def drafting_rounds(counters: SpeculationCounters) -> int:
    """Verify steps (row rounds) that drafted at least one token: those that reached position 1."""
    return counters.drafted_per_position[0] if counters.drafted_per_position else 0


def drafting_tau(counters: SpeculationCounters) -> float:
    """tau over the verify steps that drafted: 1 + accepted draft tokens per such step (0 when
    none drafted). Equals the acceptance length when every step drafts and none ends a row early."""
    rounds = drafting_rounds(counters)
    return 1.0 + counters.accepted_tokens / rounds if rounds else 0.0


@dataclass(kw_only=True, slots=True)
class _Reference:
    version: int
    tau: float


class CollapseWatch:
    """Judges the versions a sidecar serves and keeps the collapse condition (module docstring).

    `observe` takes the recent versions' stats after every engine step; each call re-judges
    them with their grown counters (a version's verdict can only firm up)."""

    def __init__(self, rule: CollapseRule | None = None) -> None:
        self.rule = rule or CollapseRule()
        self.condition: DraftCollapse | None = None
        """The raised alarm, or None."""
        self.collapses = 0
        """Collapse episodes raised since the sidecar started (monotonic)."""
        self.recovered_at = 0
        """The version whose working draft cleared the last collapse (0: none cleared yet)."""
        self._reference: _Reference | None = None

    def observe(self, versions: list[VersionStats]) -> DraftCollapse | None:
        """Judge `versions` (any order) and return the condition now raised, if any."""
        for stats in sorted(versions, key=lambda v: v.weight_version):
            version = stats.weight_version
            verdict = self.rule.verdict(stats)
            if verdict is Verdict.WORKING:
                if self.condition is not None and version > self.condition.latest_version:
                    self.condition = None  # a later version's draft works again
                    self.recovered_at = version
                if self._reference is None or version >= self._reference.version:
                    self._reference = _Reference(version=version, tau=drafting_tau(stats.counters))
            elif verdict is Verdict.COLLAPSED:
                ref = self._reference
                if ref is None or version <= ref.version:
                    continue  # nothing newer worked before it: no collapse to report
                tau = drafting_tau(stats.counters)
                rounds = drafting_rounds(stats.counters)
                if self.condition is None:
                    self.collapses += 1
                    self.condition = DraftCollapse(
                        weight_version=version,
                        latest_version=version,
                        reference_version=ref.version,
                        tau_before=ref.tau,
                        tau_after=tau,
                        verify_steps=rounds,
                    )
                elif version >= self.condition.latest_version:
                    self.condition.latest_version = version
                    self.condition.tau_after = tau
                    self.condition.verify_steps = rounds
        return self.condition

    def collapsed(self, version: int) -> bool:
        """Whether `version` is the collapsed version the raised alarm last judged."""
        return self.condition is not None and self.condition.latest_version == version
