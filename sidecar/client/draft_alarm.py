"""The draft-collapse alarm on the client side: one loud warning per collapse, not per reading.

A sidecar raises `draft_collapsed` in GetStats while a weight version's draft has collapsed
(`sidecar.speculation.collapse`), and keeps it raised for as long as the collapse lasts. A
trainer reads GetStats every step, so reporting every reading would repeat the same warning
each step and bury it. `DraftAlarms` remembers what each sidecar last raised and reports a
collapse once when it appears (and once, quietly, when it clears); the fleet and the TRL
integration share it.
"""

from __future__ import annotations

import logging

from sidecar.types import DraftCollapse, SidecarStats

log = logging.getLogger(__name__)


class DraftAlarms:
    """Per sidecar address, the raised collapse; `observe` says when a new one appears."""

    def __init__(self) -> None:
        self._raised: dict[str, tuple[int, DraftCollapse]] = {}

    def observe(self, address: str, stats: SidecarStats) -> str | None:
        """A GetStats reading of the sidecar at `address`: the warning line (also logged) when
        it raises a collapse not reported before, else None."""
        condition = stats.draft_collapsed
        before = self._raised.get(address)
        if condition is None:
            if before is not None:
                del self._raised[address]
                log.info("sidecar %s: the draft works again (weight version %d)", address, stats.weight_version)
            return None
        self._raised[address] = (stats.draft_collapses, condition)
        if before is not None and (before[0], before[1].weight_version) == (
            stats.draft_collapses,
            condition.weight_version,
        ):
            return None  # the same collapse, still raised (possibly spanning a later version)
        message = f"sidecar {address}: {condition.describe()}"
        log.warning(message)
        return message

    def raised(self) -> dict[str, DraftCollapse]:
        """The collapse each sidecar raises now, by address (as of its latest reading)."""
        return {address: condition for address, (_, condition) in self._raised.items()}
