"""The engine's commit: a round's or a prefill's packed result turned into tokens, counters and ends.

The runner (`runner`) hands back one packed host copy per forward (`rows.round_outcome`); here
each row takes its emitted tokens and log-probs, its counters, its next pending draft inputs
(`rows.Pending`), and the rows that stopped are named. What the engine keeps across steps (the
statistics per weight version, the requests still live, the controller) it updates from the
`Committed` record this returns (`TorchEngine._commit_round`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sidecar.engine.decode_round import RoundOutput
from sidecar.engine.row_scheduler import StepPlan
from sidecar.engine.rows import CATCH_UP_POSITIONS, REASON_LENGTH, REASON_STOP, Pending, Sequence, add_rounds
from sidecar.engine.runner import Prefill
from sidecar.types import FinishReason

REASONS = {REASON_STOP: FinishReason.STOP, REASON_LENGTH: FinishReason.LENGTH}


@dataclass(kw_only=True, slots=True)
class Committed:
    """What one round did to its rows."""

    finished: list[tuple[Sequence, FinishReason]] = field(default_factory=list)
    keep: list[int] = field(default_factory=list)
    """Rows still running, in the round's row order."""
    num_accepted: list[int] = field(default_factory=list)
    """Accepted drafts per row."""
    emitted: int = 0
    """Tokens emitted by all rows."""
    stopped: int = 0
    """Rows a stop token ended."""
    ends: list[tuple[int, int, bool]] = field(default_factory=list)
    """Per row: output length before the round, tokens emitted, whether a stop token ended it."""
    evidence: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    """Per drafting row: its drafts before its end, accepted (automatic k's acceptance evidence)."""


def commit_round(plan: StepPlan, out: RoundOutput, packed: list[list[float]], version: int, drafts: bool) -> Committed:
    """Each row of `plan` takes the tokens the round emitted (`packed`, its one host copy) under
    weight `version`, and its counters; a row still running takes its next pending draft input
    from the verified positions (`drafts`: the engine serves a draft)."""
    done = Committed()
    width = plan.round_k + 1
    asked = out.routes is not None and any(s.routes != "off" for s in plan.rows)
    routes = out.routes.cpu() if out.routes is not None and asked else None  # one host copy, when a row asked
    for i, s in enumerate(plan.rows):
        row = packed[i]
        a, n, reason = int(row[2 * width]), int(row[2 * width + 1]), int(row[2 * width + 2])
        done.num_accepted.append(a)
        before = len(s.output)
        if routes is not None and s.routes != "off":  # the inputs of its n emitted tokens: accepted columns only
            s.add_routes(routes[:, i, :n])
        s.extend(row[:n], row[width : width + n], version)
        k = plan.row_k[i]
        add_rounds(s.counters, [k], [a], n)
        if k:  # an accepted stop token ends the row: the drafts after it say nothing
            done.evidence[0].append(min(k, n))
            done.evidence[1].append(min(a, n))
        done.emitted += n
        done.ends.append((before, n, reason == REASON_STOP))
        if reason:
            done.stopped += reason == REASON_STOP
            done.finished.append((s, REASONS[reason]))
            continue
        if s.drafts and drafts and s.pending is not None:
            new_pending = Pending(base=out.hidden, row=i, start=0, count=a + 1)
            if k:  # the round consumed the row's pending states
                s.pending = [new_pending]
            else:  # a round without drafting: keep only the latest positions (see CATCH_UP_POSITIONS)
                s.pending = [*s.pending, new_pending]
                while len(s.pending) > 1 and s.num_pending - s.pending[0].count >= CATCH_UP_POSITIONS:
                    s.pending.pop(0)
                    s.draft_gap = True
        done.keep.append(i)
    return done


def emitted_ids(plan: StepPlan, packed: list[list[float]]) -> list[int]:
    """The token ids the round emitted, every row's (what a reduced draft vocabulary counts)."""
    width = plan.round_k + 1
    return [int(t) for row in packed for t in row[: int(row[2 * width + 1])]]


def commit_prefill(new: list[Sequence], prefill: Prefill, version: int, drafts: bool) -> Committed:
    """Each new sequence takes its first token (a resumed one drew it before it was preempted, and
    takes nothing) and, when it drafts, its pending draft input: its prefix's last state."""
    done = Committed()
    routes = None if prefill.routes is None else prefill.routes.cpu()
    for i, (s, (tok, lp, _, _, reason)) in enumerate(zip(new, prefill.packed, strict=True)):
        src = prefill.source[i]
        if routes is not None and s.wants_prompt_routes:  # every prompt position is an input
            s.add_routes(routes[:, src, : prefill.lengths[src]])
        if not s.output:
            add_rounds(s.counters, [0], [0], 1)
            s.extend([tok], [lp], version)
            done.emitted += 1
            if reason:
                done.finished.append((s, REASONS[int(reason)]))
                continue
        if s.drafts and drafts:
            last = prefill.lengths[src] - prefill.cached[src] - 1  # its column in the prefill's states
            s.pending = [Pending(base=prefill.states, row=src, start=last, count=1)]
        done.keep.append(i)
    return done


def verify_union(
    routes: torch.Tensor,  # (sparse layers, B, round_k + 1, top k) a round's routes
    row_k: list[int],  # drafts per row: its first row_k + 1 columns were verified
    experts: int,
) -> tuple[int, float]:  # (tokens verified, distinct experts per sparse layer, the layers' mean)
    """The experts a verify read: every verified column's, accepted or not (padding columns aside)."""
    host = routes.cpu()
    valid = torch.arange(host.shape[2])[None, :] <= torch.tensor(row_k)[:, None]  # (B, round_k + 1)
    ids = host[:, valid].reshape(host.shape[0], -1).long()  # (layers, tokens * top k)
    hit = torch.zeros(host.shape[0], experts, dtype=torch.bool).scatter_(1, ids, True)
    return int(valid.sum()), float(hit.sum(dim=1).float().mean())
