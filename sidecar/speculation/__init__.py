"""Automatic k (adaptive speculation): choose the draft length k of each engine step from measured costs.

Why: whether speculation pays depends on the hardware, the batch size and the draft's current
acceptance (BENCHMARKS.md at ca4d93b, "Embedded engine": every static k from 1 to 7 lost 25-70% at batch
>= 16 on a CPU, while k = 3 won 1.5x on the demo's 8-row batches). So k is a decision made per
engine step, not a constant (README, "Automatic k"):

    choose k in {0..K} maximising   E[tokens per row | k] / (cost(B, k) * stragglers(B, k, rows))
    E[tokens per row | k] = mean over the rows of 1 + sum_{i=1..k} S_i prod_{j<=i} alpha_j
                            (alpha_j: acceptance of draft position j given all before it
                            accepted; S_i: P(none of the step's first i tokens is a stop
                            token) at the row's output position, after which nothing is emitted)
    cost(B, k) = verify(B, k + 1) + draft(B, k)                        (seconds, measured)
    stragglers(B, k, rows) ~ 1 + z_B sigma_k / sqrt(r E[tokens | k])   (1 for k = 0; see below)

- **Costs** are measured online by the engine (`observe_step`: seconds of the draft phase and of
  the whole decode step, per batch-size bucket and k); the estimate of each (bucket, width) is
  the median of its last `cost_window` measurements (a garbage collection or a growing cache
  makes one step several times slower; an average would carry that for many steps). A width
  measured fewer than `min_cost_samples` times in a bucket is not trusted alone: it is
  interpolated / extrapolated linearly from the bucket's trusted widths (beyond the widest, the
  cheaper of that and the nearest measured bucket's cost relative to plain: a dear width must
  not price every longer draft out unmeasured), or, with plain the only trusted one, taken from
  the nearest measured bucket's cost relative to plain (else from the bucket's own few
  measurements, else a prior slope). The draft phase is measured per k the
  same way (it has a fixed part — the refresh of the MTP cache and the first draft head — so a
  cost per token would overprice long drafts from short ones), from steady drafting steps only:
  a step that resumes drafting after plain rounds also refreshes the skipped positions (the
  engine reports it as `catch_up`), a one-off cost of switching that had made batch 1 price
  k = 3 23% above its steady cost and refuse every draft. (A line fitted through all widths was
  tried: on a CPU the verify cost is concave in the width — the first draft adds the speculative
  sampling work — so the line overpriced long drafts and batch 1 chose k = 2 where k = 3 was best.)
- **Acceptance** per draft position is a discounted count of the rounds that reached the
  position and of those that accepted it (`observe_acceptance`), so it follows a drifting draft
  (the counts age by verify rounds: a plain step neither adds evidence nor ages it);
  a weight push (`on_weight_version`) multiplies the counts by `version_discount`: the old
  version's acceptance stays a prior worth about one engine step, the new version's rounds take over
  within ~4 engine steps of a push that changes acceptance (measured in BENCHMARKS.md,
  "Adaptive speculation"). Drafts verified after an accepted stop token are not evidence (the
  row ended; the engine cuts each row's report at its end).
- **Rows** (`RowState`, passed by the engine each step: output length and tokens left): a row's
  stop tokens come where rows end by output position (`StopHazard`,
  `AcceptanceEstimate.batch_tokens`). It matters where a batch runs until its last row: an RL
  batch's answers end within a few tokens of each other (BENCHMARKS.md at ca4d93b, "Adaptive speculation",
  sixth session).
- **Stragglers**: acceptance differs between rows, so rows of a batch that would finish
  together under plain decoding finish at different steps under speculation, and the batch runs
  until its slowest row is done. When no request waits for a finished row's place (the engine
  passes `tokens_left`, the most tokens a row may still emit), a k > 0 step is priced by the
  expected excess of the slowest row's steps (`straggler_factor`: a normal approximation of the
  steps to emit the rows' remaining tokens, checked against a simulated batch in the tests). It is what made k = 1
  lose 4-8% end to end at greedy batch 4 while it gained 4% per step, and it ends a batch on
  plain decoding when few tokens are left. With a queue (continuous batching) it is 1.
- **Margin**: k > 0 is chosen only when it predicts at least `min_gain` more tokens per second
  than plain decoding: near break-even the prediction is within its own noise, and the MTP
  prefill of the prompt at admission and a catch-up refresh when drafting resumes are not in
  the per-step model. Plain wins the ties.
- **Exploration**: plain decoding (k = 0) is measured first in every bucket (it is the baseline
  of the guard); then every `probe_every` steps after the last probe's last step (the interval
  doubling up to `max_probe_every` unless the last probe made its k the best by `min_gain`:
  near a tie the best k flips between neighbours with or without a probe's help, and resetting
  on every flip had made probes 15-24% of the steps at batch 4-16, ~27% of the RL workload's
  batch-4 bucket) the controller runs the least recently measured of
  {best - 1, best + 1, 0, the best k > 0} for `min_cost_samples` steps in a row (the first of
  them after plain rounds is a catch-up, the others measure steady drafting; with a median of
  the last `cost_window` = 5 they replace what the last probe measured), so costs and acceptance
  of the neighbours stay fresh. The last one lets a bucket at plain decoding re-measure the
  draft length that would win, not only k = 1; and a bucket at plain adds every k > 0 it predicts
  within `min_gain` of plain, so that each takes its turn: after k = 1 and k = 3 were both measured
  in a slow stretch, k = 1's next probe made it the best k > 0, and k = 3, the true best (9% over
  plain at batch 1), was never re-measured (0 of 400 steps).
  A bucket at plain decoding does not wait the doubled interval for a k > 0 that it predicts
  near break-even: its options (k = 1, the best k > 0 and every k > 0 within `min_gain` of plain,
  in turn) come `probe_every` steps after the last probe while predicted within `min_gain` of plain, later in proportion to their
  predicted loss beyond that (`plain_probe_interval`), so each such probe costs about
  3 x min_gain / probe_every of the throughput (~0.6%). The
  asymmetry is the shape of the rate: flat near the best k > 0 (on the RL workload static k = 3-6
  are within 3% of each other), where probing more often buys little (tried: loss-scaled
  intervals for every option raised probes to 13-15% of the steps, and auto fell to 0.92-0.96x
  of the best static k on the RL workload in three sweeps), but a cliff between k = 0 and the
  best k > 0, where an estimate taken in a slow stretch costs the whole gain: at temperature 1,
  batch 1 (k = 3 gains 5-15%; its cost moves by 10-25% with the box's load for minutes at a
  time) such a bucket stayed at plain with k = 3 predicted within 3% of it for up to ~1,300
  steps, 0.88-0.91x of static k = 3 in grid runs (BENCHMARKS.md at ca4d93b, "Adaptive speculation", fifth
  session). A neighbour measured fewer than `min_cost_samples` times in the bucket goes first,
  every `learn_every` steps, so that a new batch size trusts its own costs within its first
  few dozen steps (at batch 64 the doubling interval had taken 7 generations of 16 tokens to
  measure k = 1 three times, and until then every row kept a draft it never used). Rows that
  join a batch where every k > 0 was measured slower than plain by more than the margin carry
  no draft at all where keeping it (its prefill, a plain bucket's probes) costs more than the
  option to draft is worth under the bucket's cost noise (`may_draft`; every `refuse_every`-th
  such admission keeps its draft to re-measure).
- **Guard**: the model can be wrong (stale acceptance after a push, a cost that moved, a bug).
  Over the last `guard_rows` row-rounds (at least `guard_min_steps` steps) of model-chosen
  steps with k > 0 in a bucket, the realised tokens
  per second per row (a step counted at most `guard_outlier` x the window's median time, as the
  plain cost is a median) are compared with plain decoding's measured rate; below `guard_ratio` of it
  the bucket backs off to k = 0 for `backoff_steps` steps (doubling on each consecutive trip, up
  to `max_backoff_steps`) and then re-probes. `cost_bias` is the test hook that makes the model
  deliberately wrong.

Pure logic: no torch, no clock. The engine passes measured durations in, so tests drive it with
injected costs and acceptance.
"""
