"""Counters per weight version, kept bounded however long a run is.

An RL run serves a new weight version every step, so counters kept for every version ever served
grow with the run, and so would every engine step that reads them (the scheduler refreshes its
snapshot after each step). The ledger keeps the `keep` most recent versions one by one and folds
every older one into a single cumulative entry, `earlier`: GetStats lists the recent versions and
its `total` still counts everything since the sidecar started (proto/specrl/v1/control.proto).
"""

from __future__ import annotations

from sidecar.types import VersionStats

RECENT_VERSIONS = 8
"""Weight versions whose counters GetStats lists one by one (a client reading stats every step
or every few steps sees each version while it is recent; older ones are summed in `total`)."""


def fold(into: VersionStats, stats: VersionStats) -> None:
    """Add `stats`' counters, samples and busy time to `into`."""
    into.counters.add(stats.counters)
    into.samples_finished += stats.samples_finished
    into.samples_nonfinite += stats.samples_nonfinite
    into.prompt_tokens += stats.prompt_tokens
    into.prefill_tokens += stats.prefill_tokens
    into.prefix_cache_hit_tokens += stats.prefix_cache_hit_tokens
    into.busy_seconds += stats.busy_seconds


class VersionLedger:
    """`VersionStats` of the recent weight versions, and one cumulative entry for all older ones."""

    def __init__(self, keep: int = RECENT_VERSIONS) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._recent: dict[int, VersionStats] = {0: VersionStats(weight_version=0)}
        self.earlier = VersionStats(weight_version=0)
        """The sum over the versions no longer listed (its weight_version: the newest of them)."""

    def serve(self, version: int) -> None:
        """`version` is served from now on: it gets an entry; the oldest beyond `keep` are folded."""
        self._recent.setdefault(version, VersionStats(weight_version=version))
        while len(self._recent) > self.keep:
            oldest = min(self._recent)
            fold(self.earlier, self._recent.pop(oldest))
            self.earlier.weight_version = max(self.earlier.weight_version, oldest)

    def __getitem__(self, version: int) -> VersionStats:
        """The entry that counts what `version` does: its own while it is recent, `earlier` after
        (a sample finishing now may have started on a version since folded)."""
        stats = self._recent.get(version)
        if stats is not None:
            return stats
        if version < min(self._recent):
            return self.earlier
        self.serve(version)
        return self._recent[version]

    def recent(self) -> list[VersionStats]:
        """The recent versions' entries, oldest first (at most `keep`)."""
        return [self._recent[v] for v in sorted(self._recent)]
