"""The automatic-k controller: each engine step, the k that maximises expected tokens per second.

The model, its estimates and its guard are described in the package docstring (`sidecar.speculation`).
Pure logic: no torch, no clock. The engine passes measured durations in, so tests drive it with
injected costs and acceptance.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from sidecar.speculation.acceptance import AcceptanceEstimate
from sidecar.speculation.config import RowState, SpeculationControllerConfig, SpeculationDecision, batch_bucket
from sidecar.speculation.costs import (
    BucketCosts,
    CostSamples,
    expected_max_of_normals,
    interpolate_cost,
    option_value,
    rates_per_row,
)
from sidecar.speculation.expert_union import ExpertReads, MeasuredUnion


class SpeculationController:
    """The per-step k controller; see the module docstring."""

    def __init__(self, config: SpeculationControllerConfig, expert_reads: ExpertReads | None = None) -> None:
        self.config = config
        self.union: MeasuredUnion | None = None
        """The experts the engine's verifies read, measured (`observe_expert_union`), for an
        `expert_reads` without a `measured` union of its own."""
        if expert_reads is not None and expert_reads.measured is None and expert_reads.sparse_layers > 0:
            self.union = MeasuredUnion(expert_reads.experts, expert_reads.top_k)
            expert_reads = dataclasses.replace(expert_reads, measured=self.union)
        self.expert_reads = expert_reads
        """A mixture-of-experts target's bytes per forward (`expert_union`): the prior of a verify's
        cost counts the union of the experts its batch × width tokens read, measured where the
        engine measured it, the uniform formula otherwise (None: a dense target)."""
        self.acceptance = AcceptanceEstimate(config)
        self._buckets: dict[int, BucketCosts] = {}
        self._observations = 0  # steps observed (cached derived estimates are valid for one count)
        self._near_cache: dict[int, tuple[int, BucketCosts | None]] = {}
        self.trips = 0
        self._prefill = CostSamples(config.cost_window)
        """Seconds per prompt token of the draft's prefill at admission (`observe_draft_prefill`)."""
        self.last = SpeculationDecision(
            k=0, reason="off" if not config.max_speculation_k else "probe", batch_size=0, detail="no decode step yet"
        )
        self._pending_reason = ""
        self.held = ""
        """Why drafting is held off until the next weight version ('' when it is not): the
        served version's draft collapsed (`hold`)."""

    def observe_expert_union(self, tokens: int, distinct: float) -> None:
        """A verify of `tokens` tokens (every row's verified columns) read `distinct` experts per
        sparse layer (the engine's measurement from its routes; nothing to do for a dense target)."""
        if self.union is not None:
            self.union.observe(tokens, distinct)

    # ---- predictions ------------------------------------------------------------------------
    def _bucket(self, batch: int) -> BucketCosts:
        edge = batch_bucket(batch)
        if edge not in self._buckets:
            self._buckets[edge] = BucketCosts(window=self.config.cost_window, min_samples=self.config.min_cost_samples)
        return self._buckets[edge]

    def predicted_seconds(self, batch: int, k: int) -> float | None:
        """Predicted seconds of one decode step with k drafts at this batch (None before plain is measured)."""
        seconds = self.predicted_steps(batch, [k])
        return None if seconds is None else seconds[0]

    def predicted_steps(self, batch: int, ks: list[int]) -> list[float] | None:
        """`predicted_seconds` of each k of `ks`, the bucket's costs looked up once."""
        b = self._bucket(batch)
        verify_costs = b.verify
        plain = verify_costs.get(1)
        if plain is None:
            return None
        near = self._nearest_measured(batch)
        own_draft = b.draft
        if near is None and len(verify_costs) < 2:  # no trusted k > 0 anywhere: own few measurements, not priors
            verify_costs, own_draft = b.untrusted()
        near_verify = near.verify if near is not None else None
        out = []
        for k in ks:
            verify = self._verify_seconds(verify_costs, k + 1, plain, near_verify, batch)
            if k == 0:
                out.append(verify)
                continue
            if own_draft:  # the draft phase of k, from the measured k (a draft of 0 tokens costs nothing)
                draft = interpolate_cost({0: 0.0, **own_draft}, k)
            elif near is not None and near.draft:  # the same share of a plain step as at the nearest batch
                draft = interpolate_cost({0: 0.0, **near.draft}, k) / near.verify[1] * plain
            else:
                draft = k * self.config.prior_draft_cost * plain
            out.append((verify + draft) * self.config.cost_bias)
        return out

    def _nearest_measured(self, batch: int) -> BucketCosts | None:
        """The nearest other bucket with plain and some k > 0 measured (its relative costs are the
        best guess for a bucket that has not measured them yet)."""
        own = batch_bucket(batch)
        cached = self._near_cache.get(own)
        if cached is not None and cached[0] == self._observations:
            return cached[1]
        near = self._find_nearest(own)
        self._near_cache[own] = (self._observations, near)
        return near

    def _find_nearest(self, own: int) -> BucketCosts | None:
        measured = [
            (abs(math.log(edge / own)), edge)
            for edge, other in self._buckets.items()
            if edge != own and len(other.verify) >= 2 and 1 in other.verify
        ]
        return self._buckets[min(measured)[1]] if measured else None

    def _verify_seconds(
        self, costs: dict[int, float], width: int, plain: float, near: dict[int, float] | None = None, batch: int = 1
    ) -> float:
        """Seconds of a width-`width` verify from a bucket's trusted costs (width -> seconds).

        Beyond the widths the bucket measured, the cheaper of its own extrapolation and the
        nearest measured batch size's cost relative to its plain step (`near`): an estimate too
        cheap is corrected by the steps that choose it, one too dear is never measured again.
        Extrapolating from the bucket's own last two widths alone had one slow reading of k = 2
        at batch 8 price every longer draft out (the engine model of `specrl bench adaptive sim`
        ran k = 1 there for 784 steps and never tried k = 3, the best; BENCHMARKS.md at ca4d93b, "Adaptive
        speculation", seventh session).

        Nothing measured: the prior, a plain step's cost plus `prior_verify_slope` per extra token,
        and for a mixture-of-experts target the extra experts the width reads at this batch
        (`ExpertReads.verify_ratio`: a k = 3 verify at batch 1 of Qwen3-30B-A3B's shape reads ~3x a
        plain step's bytes)."""
        if width in costs or len(costs) >= 2:
            own = interpolate_cost(costs, width)
            if near is not None and width > max(costs) and len(near) >= 2:
                return min(own, plain * interpolate_cost(near, width) / near[1])
            return own
        if near is not None:  # the nearest measured batch size's cost relative to its plain step
            return plain * self._verify_seconds(near, width, near[1]) / near[1]
        union = 1.0 if self.expert_reads is None else self.expert_reads.verify_ratio(batch, width)
        return plain * (union + self.config.prior_verify_slope * (width - 1))

    def straggler_factor(
        self,
        batch: int,
        k: int,
        tokens_left: int | None,
        spread: float | None = None,
        rows: list[RowState] | None = None,
    ) -> float:
        """Expected time to finish the batch with k drafts over (its steps x its step cost).

        Under plain decoding rows with the same tokens left finish at the same step; under
        speculation each row's steps to emit r tokens vary (about normal, mean r / mu, variance
        r sigma^2 / mu^3 for per-step tokens of mean mu and variance sigma^2), and the batch runs
        until its slowest row is done: E[max of B] adds ~z_B sigma / sqrt(r mu) of the steps
        (z_B = `expected_max_of_normals(B)`). Rows also differ in acceptance itself (a prompt the
        draft predicts well, one it does not: greedy batch 4 on the bench model had 33% more steps
        after its first row finished under k = 1 than its random acceptance explains), which does
        not average out over the steps: with `spread` the relative standard deviation of the
        rows' acceptance (module function `acceptance_spread`; None: the finished rows' pooled
        `AcceptanceEstimate.spread`), their tokens per step vary by cv_mu, the relative variance
        of a row's steps is sigma^2 / (r mu) + cv_mu^2, and every row takes 1 + cv_mu^2 times the
        steps of a row at the mean acceptance on average (the steps r / mu are convex in mu:
        without this term the price ran 3.6% short of a simulated batch at spread 0.3, and the
        pooled estimate's own shortfall took it past 10%).

        How many tokens each row still emits is itself random where rows end at a stop token.
        With the `rows`' output lengths and caps, each row's remaining tokens R have a mean and
        variance from where rows end (`StopHazard.remaining`), pooled over the batch (mean m,
        variance s^2, the spread of the rows' means included); the batch's end is ~ m + z_B s
        tokens away under plain decoding and m (1 + cv_mu^2) + z_B sqrt(s^2 + m sigma^2 / mu +
        cv_mu^2 m^2) under speculation (mu, sigma^2 of a running row: no stop truncation), and the
        factor is their ratio. Rows that all reach the cap (s = 0) get the formula above; rows
        whose ends scatter widely (large s) make speculation's noise small beside it. Rows that
        end by stop tokens at one position should be priced like rows at the cap, but are not
        yet: `StopHazard`'s prior keeps a few % of rows going past that position at the overall
        rate up to the cap, a rare long tail whose variance swamps s, and the price comes out
        8-23% short of a simulated batch — about what the overall rate alone gives (without
        `rows`: B (1 - h)^r rows expected to reach the cap, ~1 on the RL workload; an exact
        E[max] under the same hazard was tried and did not change the decisions: BENCHMARKS.md at ca4d93b,
        "Adaptive speculation", seventh session). 1 at batch 1, for k = 0, and with
        `tokens_left` None (rows that finish early are replaced from the queue: throughput, not
        the batch's end, is what counts)."""
        return self.straggler_factors(batch, [k], tokens_left, spread, rows)[0]

    def straggler_factors(
        self,
        batch: int,
        ks: list[int],
        tokens_left: int | None,
        spread: float | None = None,
        rows: list[RowState] | None = None,
    ) -> list[float]:
        """`straggler_factor` for each k of `ks`, the per-k moments and the rows' remaining
        tokens computed once for all of them (this runs every decode step)."""
        if batch < 2 or tokens_left is None or not any(ks):
            return [1.0] * len(ks)
        acceptance = self.acceptance
        if spread is None:
            spread = acceptance.spread()
        upto = max(ks)
        running = [1.0] * upto if rows else None  # with rows, R counts up to the stop token
        mus = acceptance.tokens_by_k(upto, survival=running)
        variances = acceptance.variances_by_k(upto)
        if spread > 0:  # cv_mu^2: the rows' tokens per step vary by cv_mu between rows
            his = acceptance.tokens_by_k(upto, scale=1.0 + spread, survival=running)
            los = acceptance.tokens_by_k(upto, scale=max(1.0 - spread, 0.0), survival=running)
            betweens = [((hi - lo) / (2 * mu)) ** 2 for hi, lo, mu in zip(his, los, mus, strict=True)]
        else:
            betweens = [0.0] * (upto + 1)
        out = []
        if not rows:
            r = max(tokens_left, 1)
            z = expected_max_of_normals(max(1, round(batch * (1.0 - acceptance.end_rate()) ** r)))
            for k in ks:
                # a row's steps r / mu_row average r / mu x (1 + cv_mu^2) (1/x is convex), and the
                # slowest of the rows expected to reach the cap adds z_B standard deviations
                mu, between = mus[k], betweens[k]
                out.append(1.0 if k == 0 else 1.0 + between + z * math.sqrt(variances[k] / (r * mu) + between))
            return out
        m, s2 = self._remaining_tokens(rows, tokens_left)
        z = expected_max_of_normals(len(rows))
        plain = m + z * math.sqrt(s2)
        for k in ks:
            mu, between = mus[k], betweens[k]
            spec = m * (1.0 + between) + z * math.sqrt(s2 + m * variances[k] / mu + between * m * m)
            out.append(1.0 if k == 0 else spec / plain)
        return out

    def _remaining_tokens(self, rows: list[RowState], tokens_left: int) -> tuple[float, float]:
        """(mean, variance) of the tokens a row of the batch still emits, pooled over `rows`
        (`StopHazard.remaining`; a row without its own cap has `tokens_left`)."""
        moments = [
            self.acceptance.stops.remaining(row.length, tokens_left if row.left is None else row.left) for row in rows
        ]
        mean = sum(m for m, _ in moments) / len(moments)
        variance = sum(v + (m - mean) ** 2 for m, v in moments) / len(moments)
        return max(mean, 1.0), variance

    def expected_rates(
        self, batch: int, tokens_left: int | None = None, rows: list[RowState] | None = None
    ) -> list[float] | None:
        """Predicted tokens per second per row for k = 0..max_speculation_k (None before plain is measured).
        `tokens_left`: the most tokens a row of the batch may still emit when nothing waits to
        take a finished row's place (then no row drafts more than it may emit, and k > 0 pays
        for the batch's stragglers: `straggler_factor`); None while requests wait. `rows`: the
        batch's rows (each one's acceptance so far and output length:
        `AcceptanceEstimate.batch_tokens`); None: every row at the sidecar's average."""
        priced = self._price(batch, tokens_left, rows)
        return None if priced is None else rates_per_row(priced)

    def _price(
        self, batch: int, tokens_left: int | None, rows: list[RowState] | None
    ) -> list[tuple[float, float, float]] | None:
        """(tokens per row, step seconds, straggler factor) per k = 0..max_speculation_k, every k in one pass
        (this runs every decode step); None before plain is measured."""
        tokens = self.acceptance.batch_tokens(rows, self.config.max_speculation_k)
        drafts = [
            k if tokens_left is None else min(k, max(tokens_left - 1, 0))
            for k in range(self.config.max_speculation_k + 1)
        ]
        seconds = self.predicted_steps(batch, drafts)
        if seconds is None:
            return None
        factors = self.straggler_factors(batch, drafts, tokens_left, rows=rows)
        return [(tokens[d], t, f) for d, t, f in zip(drafts, seconds, factors, strict=True)]

    # ---- decisions --------------------------------------------------------------------------
    def decide(
        self, batch: int, tokens_left: int | None = None, rows: list[RowState] | None = None
    ) -> SpeculationDecision:
        """k for the next decode step of a batch of `batch` rows (`tokens_left`, `rows`: see
        `expected_rates`)."""
        cfg = self.config
        if cfg.max_speculation_k == 0:
            self.last = SpeculationDecision(k=0, reason="off", batch_size=batch, detail="max k is 0")
            return self.last
        if self.held:
            self.last = SpeculationDecision(k=0, reason="collapsed", batch_size=batch, detail=self.held)
            return self.last
        b = self._bucket(batch)
        b.steps += 1
        if b.steps <= b.backoff_until:
            self.last = SpeculationDecision(
                k=0,
                reason="guard",
                batch_size=batch,
                detail=f"{self._pending_reason or 'realised throughput below plain'}; plain for "
                f"{b.backoff_until - b.steps + 1} more steps at batch {batch}",
            )
            return self.last
        priced = self._price(batch, tokens_left, rows)
        if priced is None:
            self.last = SpeculationDecision(
                k=0, reason="probe", batch_size=batch, detail=f"measuring plain decoding at batch {batch}"
            )
            return self.last
        rates = rates_per_row(priced)
        burst_k, burst_left = b.burst
        if burst_left > 0:
            b.burst = (burst_k, burst_left - 1)
            self.last = SpeculationDecision(
                k=burst_k,
                reason="probe",
                batch_size=batch,
                expected_speedup=rates[burst_k] / rates[0],
                detail=f"measuring k={burst_k} at batch {batch} ({cfg.min_cost_samples} steps in a row)",
            )
            return self.last
        best = self._best(rates)
        speedup = rates[best] / rates[0]
        started = self._start_probe(b, rates, best)
        if started is not None:
            probe, learning = started
            self.last = SpeculationDecision(
                k=probe,
                reason="probe",
                batch_size=batch,
                expected_speedup=rates[probe] / rates[0],
                detail=f"{'measuring' if learning else 're-measuring'} k={probe} against the best "
                f"k={best} at batch {batch} (predicted {rates[probe] / rates[best]:.2f}x of it)",
            )
            return self.last
        tau, step, stragglers = priced[best]
        self.last = SpeculationDecision(
            k=best,
            reason="model",
            batch_size=batch,
            expected_speedup=speedup,
            detail=(
                f"k={best} predicts {speedup:.2f}x plain at batch {batch} (tau {tau:.2f}; "
                f"step {1e3 * step:.2f} ms vs plain {1e3 * priced[0][1]:.2f} ms"
                + (f"; stragglers x{stragglers:.2f}" if stragglers > 1 else "")
                + ")"
            ),
        )
        return self.last

    def plain_probe_interval(self, rates: list[float], k: int) -> float:
        """Steps between probes of `k` > 0 from a bucket at plain decoding (`rates`: predicted
        tokens/s per k): `probe_every` while k is predicted within `min_gain` of plain, longer in
        proportion to its predicted loss beyond that, at most `max_probe_every` (see the module
        docstring, "Exploration")."""
        cfg = self.config
        loss = max(1.0 - rates[k] / rates[0], 0.0)
        if loss <= cfg.min_gain:
            return float(cfg.probe_every)
        if cfg.min_gain == 0:
            return float(cfg.max_probe_every)
        return min(cfg.probe_every * loss / cfg.min_gain, float(cfg.max_probe_every))

    def _start_probe(self, b: BucketCosts, rates: list[float], best: int) -> tuple[int, bool] | None:
        """Start a probe in bucket `b` if one is due: (its k, still learning its cost), else None.

        The options are the best's neighbours, plain decoding and the best k > 0, and, from a
        bucket at plain, every k > 0 predicted within `min_gain` of plain; least recently measured
        first. One not yet measured `min_cost_samples` times goes first, every
        `learn_every` steps (its cost is borrowed or interpolated, not its own). Otherwise a probe
        starts when the bucket's probe interval has passed since the last one: `probe_every`,
        doubling up to `max_probe_every` unless a probe made its k the best by `min_gain`; from a
        bucket at plain, no later than `plain_probe_interval` of the k probed. Intervals count
        from a probe's last step (bursts of 3 starting every 4 steps had left a bucket that
        learns — a batch size seen a few steps per generation — one step in four its own)."""
        cfg = self.config
        challenger = max(range(1, cfg.max_speculation_k + 1), key=lambda k: (rates[k], -k))
        candidates = {best - 1, best + 1, 0, challenger}
        if best == 0:  # every k > 0 near break-even takes its turn: a fresh reading can make k = 1
            # the best k > 0 and lock out a k = 3 measured in a slow stretch (never best + 1)
            candidates |= {
                k for k in range(1, cfg.max_speculation_k + 1) if rates[k] >= (1.0 - cfg.min_gain) * rates[0]
            }
        options = sorted({k for k in candidates if 0 <= k <= cfg.max_speculation_k and k != best})
        if not options:
            return None
        probe = min(options, key=lambda k: (b.measured(k) >= cfg.min_cost_samples, b.last_measured.get(k, -1), k))
        learning = b.measured(probe) < cfg.min_cost_samples
        if learning:
            interval = float(cfg.learn_every)
        else:
            interval = float(b.probe_interval or cfg.probe_every)
            if best == 0:
                interval = min(interval, self.plain_probe_interval(rates, probe))
        if b.steps - b.last_probe_step < interval:
            return None
        if not learning:  # the interval doubles unless the last probe made its k the best by the margin
            runner_up = max(r for k, r in enumerate(rates) if k != best)
            moved = best == b.last_probe_k and rates[best] >= (1.0 + cfg.min_gain) * runner_up
            stable = not moved and b.probe_interval > 0
            b.probe_interval = min(2 * b.probe_interval, cfg.max_probe_every) if stable else cfg.probe_every
            b.last_probe_k = probe
        b.last_probe_step = b.steps + cfg.min_cost_samples - 1  # intervals count from the burst's last step
        b.burst = (probe, cfg.min_cost_samples - 1)  # this step and the next ones
        return probe, learning

    def may_draft(
        self,
        batch: int,
        tokens_left: int | None = None,
        rows: list[RowState] | None = None,
        joining: int | None = None,
        prompt_tokens: int | None = None,
    ) -> bool:
        """False when the `joining` rows (the last of `rows`; None: all of the batch) should be
        admitted to a batch of this size without a draft. A row admitted without one never
        drafts for its whole generation, so a refusal is worth its cost only where speculation
        surely loses: what it saves is the draft's upkeep (`_upkeep`), the MTP prefill of the
        rows' `prompt_tokens` (timed by the engine: `observe_draft_prefill`) and the probes of a
        bucket at plain (the pending inputs kept through plain rounds are bounded by the engine
        and not counted); what it gives up is the option to draft, which each step takes only
        where it pays.

        The best k > 0 is predicted at a relative gain g over plain decoding, known to within
        the standard error se of two measured costs (`BucketCosts.ratio_error`: the bucket's own
        step noise, robust to a slow outlier, pooled over its widths). Keeping the draft is
        worth E[max(G, 0)] of the joining rows' generation at plain speed, G ~ N(g, se^2)
        (`option_value`). The rows are refused when that is less than the upkeep, and k > 0 is
        predicted to lose by more than `min_gain` (within the margin each step decides). Before
        the engine has timed a prefill, the prefill counts as `min_gain` of the generation.
        With exact costs (se = 0) any loss beyond the margin refuses, as before; at temperature
        1, batch 4 on the bench model, where k = 1 gains ~5% and one step's cost scatters by
        5-14%, a refusal on a noisy estimate had turned drafting off for the rows' whole
        generation and, `refuse_every` admissions in a row, a whole grid cell (auto at 0.89x
        plain, 0.84x of static k = 1; BENCHMARKS.md at ca4d93b, "Adaptive speculation", seventh session),
        while the prefill it saved is ~0.6% of a generation there (60 prompt tokens at ~120 us
        against 48 steps of ~25 ms).

        A guard back-off does not count: it is temporary. Only the bucket's own trusted
        measurements of k > 0 (at least `min_cost_samples`) can refuse a draft (another batch
        size's relative costs may be far off, and a refused bucket would never measure again),
        and every `refuse_every`-th refusal in a row is turned into an admission with a draft,
        so a bucket that once measured plain best can learn that this changed (a weight push
        that improved the draft, a machine less loaded)."""
        b = self._bucket(batch)
        rates = self.expected_rates(batch, tokens_left, rows)
        if rates is None or len(b.verify) < 2:
            return True  # k > 0 not measured here (min_cost_samples times) yet
        best = max(range(1, len(rates)), key=lambda k: rates[k])
        gain = rates[best] / rates[0] - 1.0
        if gain >= -self.config.min_gain:
            b.refusals = 0
            return True
        se = b.ratio_error(best)
        worth, upkeep = option_value(gain, se), self._upkeep(batch, tokens_left, rows, joining, prompt_tokens)
        if worth >= upkeep:
            b.refusals = 0
            return True
        b.refusals += 1
        if b.refusals >= self.config.refuse_every:
            b.refusals = 0
            return True
        self.last = SpeculationDecision(  # what GetStats shows while no row drafts (decide is not asked)
            k=0,
            reason="model",
            batch_size=batch,
            detail=f"rows joining batch {batch} admitted without a draft: the best k={best} predicts "
            f"{1.0 + gain:.2f}x plain (se {se:.2f}); drafting is worth {100 * worth:.2f}% of their "
            f"generation, keeping the draft costs {100 * upkeep:.2f}%",
        )
        return False

    def _upkeep(
        self,
        batch: int,
        tokens_left: int | None,
        rows: list[RowState] | None,
        joining: int | None,
        prompt_tokens: int | None,
    ) -> float:
        """What keeping the joining rows' drafts costs, as a share of their generation at plain
        speed: their draft prefill (over their share of the batch's steps until they are done;
        `min_gain` of the generation before a prefill is timed or while neither `tokens_left`
        nor the rows' caps are known), and the probes that a bucket at
        plain runs while rows keep drafts (`min_cost_samples` steps of a k > 0 about every
        `probe_every` x loss / `min_gain` steps, each losing `loss`: `min_cost_samples` x
        `min_gain` / `probe_every` of the throughput, ~0.6%; `plain_probe_interval`)."""
        cfg = self.config
        probing = cfg.min_cost_samples * cfg.min_gain / cfg.probe_every
        plain = self._bucket(batch).verify.get(1)
        joining = batch if joining is None else min(max(joining, 1), batch)
        new = (rows or [])[-joining:]
        caps = [r.left for r in new if r.left is not None]
        cap = tokens_left if tokens_left is not None else max(caps, default=None)
        if not self._prefill or prompt_tokens is None or plain is None or cap is None:
            return cfg.min_gain + probing  # the prefill or the generation it is set against unknown
        remaining = self._remaining_tokens(new, cap)[0] if new else float(max(cap, 1))
        generation = remaining * plain * joining / batch
        return prompt_tokens * self._prefill.median() / generation + probing

    def observe_draft_prefill(self, tokens: int, seconds: float) -> None:
        """The engine ran the draft's prefill of `tokens` prompt tokens in `seconds` (admission)."""
        if tokens > 0 and seconds >= 0:
            self._prefill.add(seconds / tokens)

    def _best(self, rates: list[float]) -> int:
        """The k of the highest predicted rate; a k > 0 must beat plain by `min_gain` (ties: smaller k)."""
        best = max(range(len(rates)), key=lambda k: (rates[k], -k))
        return best if rates[best] >= (1.0 + self.config.min_gain) * rates[0] else 0

    # ---- observations -----------------------------------------------------------------------
    def observe_step(
        self,
        *,
        batch: int,
        k: int,
        draft_seconds: float,
        step_seconds: float,
        tokens: int,
        chosen: bool = True,
        catch_up: bool = False,
        ended: int = 0,
        rows: list[tuple[int, int, bool]] | None = None,
    ) -> None:
        """A decode step ran: `k` drafts (the widest row), the draft phase took `draft_seconds` of
        its `step_seconds`, and `tokens` were emitted over `batch` rows, `ended` of them a stop
        token. `chosen`: the step's k came from this controller's 'model' decision (only those
        feed the guard). `catch_up`: the draft phase also refreshed positions skipped by plain
        rounds (its cost is not that of steady drafting: only the verify is recorded). `rows`: per
        row (output length before the step, tokens emitted, ended by a stop token), where the
        rows end (`StopHazard`); None: only the overall rate is learnt."""
        self.acceptance.observe_ends(tokens, ended, rows)
        if batch < 1 or step_seconds <= 0 or draft_seconds < 0 or draft_seconds > step_seconds:
            return  # nothing measurable (clock resolution, empty step)
        b = self._bucket(batch)
        self._observations += 1
        b.observe(k + 1, step_seconds - draft_seconds, draft_seconds if k > 0 and not catch_up else None)
        b.last_measured[k] = b.steps
        if not (chosen and k > 0 and self.last.reason == "model"):
            return
        b.guard_window.append((batch, tokens / batch, step_seconds))
        row_rounds = sum(n for n, _, _ in b.guard_window)
        if len(b.guard_window) < self.config.guard_min_steps or row_rounds < self.config.guard_rows:
            return
        plain = b.verify.get(1)
        cap = self.config.guard_outlier * statistics.median(s for _, _, s in b.guard_window)
        realised = sum(t for _, t, _ in b.guard_window) / sum(min(s, cap) for _, _, s in b.guard_window)
        steps = len(b.guard_window)
        b.guard_window.clear()
        if plain is None:
            return
        ratio = realised * plain  # realised tokens/s per row over plain's (1 token per row per plain step)
        if ratio < self.config.guard_ratio:
            b.backoff_len = min(
                2 * b.backoff_len if b.backoff_len else self.config.backoff_steps, self.config.max_backoff_steps
            )
            b.backoff_until = b.steps + b.backoff_len
            self.trips += 1
            self._pending_reason = (
                f"realised {ratio:.2f}x plain over {steps} steps ({row_rounds} row-rounds) at batch {batch} "
                f"(model predicted {self.last.expected_speedup:.2f}x)"
            )
        else:
            b.backoff_len = 0

    def observe_acceptance(self, drafted: list[int], accepted: list[int]) -> None:
        """Per row of a decode step: drafts verified and drafts accepted."""
        self.acceptance.observe(drafted, accepted)

    def observe_finished_row(self, drafted: int, accepted: int) -> None:
        """A row finished: its drafts proposed at position 1 and how many were accepted (how much
        rows differ in acceptance: `AcceptanceEstimate.spread`)."""
        self.acceptance.observe_row(drafted, accepted)

    def on_weight_version(self) -> None:
        """A weight push landed: the old version's acceptance becomes a weak prior, and a hold
        (`hold`) ends: the new version's draft is judged afresh."""
        self.acceptance.discount(self.config.version_discount)
        self.held = ""

    def hold(self, why: str) -> None:
        """Draft nothing (k = 0, reason "collapsed") until the next weight version: the served
        version's draft collapsed (`sidecar.speculation.collapse`). Rows keep their draft inputs,
        so drafting resumes on the next version without a new prefill."""
        self.held = why
