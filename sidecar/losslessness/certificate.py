"""The losslessness certificate of a running sidecar: `verify_sidecar` (behind `specrl verify`).

Speculative decoding is lossless only if the acceptance rule is exactly right; the bugs that
shipped in "lossless" systems (keeping drafts, resampling from the target instead of the
residual, greedy verification at temperature > 0) are invisible in reward curves. This module
tests a deployment — its checkpoint, sidecar, engine, k and sampling settings — through the
public protocol only (the client), against an independent oracle: the same checkpoint loaded
on the verifier side, proven identical to the served weights by CRC-32, run with plain full
forwards (`exact_target`). Four checks, each with a verdict:

- **weights**: the served version and per-tensor CRC-32 (DescribeWeights with checksums) equal
  the local checkpoint's, and the version does not change while the certificate runs. Every
  other check is about these weights; on a mismatch they are refused.
- **greedy** (per k): temperature 0 with speculation equals plain decoding (k = 0, same
  sidecar) token for token, and every token is the target's argmax (up to exact ties).
- **distribution** (per k and temperature > 0): tokens sampled with speculation follow the
  target's exact per-prefix distributions (`statistics.conditional_fit` per position, Fisher's
  combination over positions; exact p-values, so a correct sidecar fails at rate <= alpha
  whatever its distributions), with total-variation estimates; and **power**: the same test,
  at the same sample size, run `power_runs` times on samples of each built-in wrong acceptance
  rule (`wrong_rules.WRONG_RULES`) in each of a decreasing series of fractions of the
  rounds, simulated on the verifier side from the same weights and draft — so the power
  statement is about this deployment's distributions: the smallest simulated deviation the
  test detects in >= `power_target` of the runs. A check that does not reach that power
  against the full-strength wrong rules is *underpowered*, not passed. At k = 0 (plain
  sampling) there is no acceptance rule to get wrong, and no power statement.
- **logprobs**: every reported log-prob against the exact log_softmax(logits / T)[token]
  (T = 1 when greedy; before top-k/top-p), max absolute difference within a tolerance.

Verdicts: pass, fail (evidence of a defect), underpowered (no evidence of a defect, but not
enough evidence for a pass: too few samples, speculation not exercised, weights unproven, no
--model). The certificate's verdict is the worst of its checks; `EXIT_STATUS` maps it to the
CLI's exit status.
"""

from __future__ import annotations

import enum
import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from sidecar.client.client import SidecarClient
from sidecar.engine.torch_engine import TorchEngine
from sidecar.losslessness.exact_target import ExactTokens, draw_prompts, exact_tokens, weight_mismatches
from sidecar.losslessness.statistics import Fit, combine, conditional_fit
from sidecar.losslessness.wrong_rules import POWER_RULES, WRONG_RULES, in_fraction_of_rounds, with_acceptance_rule
from sidecar.model.eagle3 import PUSH_PREFIX, Eagle3Draft
from sidecar.model.model import Qwen3WithMTP
from sidecar.types import GenerationRequest, Sample, SamplingParams, SpeculationCounters, WeightSelector


class Verdict(enum.Enum):
    PASS = "pass"
    UNDERPOWERED = "underpowered"
    FAIL = "fail"


_SEVERITY = {Verdict.PASS: 0, Verdict.UNDERPOWERED: 1, Verdict.FAIL: 2}
EXIT_STATUS = {Verdict.PASS: 0, Verdict.FAIL: 1, Verdict.UNDERPOWERED: 3}
"""Exit status of `specrl verify` per certificate verdict (2 is click's usage error)."""


@dataclass(kw_only=True, slots=True)
class VerifyConfig:
    """What to test and how hard. More samples: more power (and more time, linearly)."""

    ks: tuple[int, ...] | None = None
    """Draft lengths to certify; None: the sidecar's current k."""
    temperatures: tuple[float, ...] = (0.0, 1.0)
    """0 runs the greedy check; each > 0 runs a distribution check."""
    top_p: float = 1.0
    top_k: int = 0
    prompts: list[list[int]] | None = None
    """Token-id prompts for every check; None: drawn from the target itself (needs the model)."""
    num_prompts: int = 4
    """Prompts drawn when `prompts` is None."""
    prompt_length: int = 6
    first_token: int | None = None
    """First token of drawn prompts (the tokenizer's BOS gives in-distribution prompts); None: random."""
    greedy_new_tokens: int = 32
    samples_per_prompt: int = 500
    """Samples per prompt of each distribution check (and of each power simulation)."""
    sample_tokens: int | None = None
    """Tokens per sample in the distribution check; None: 2k + 3 (the first token, then at
    least two full speculative rounds including their bonus tokens)."""
    alpha: float = 1e-3
    """Significance level: the rate at which a check fails a correct sidecar is at most this
    (exact p-values; `DistributionFits.rejects` splits it between the joint and the positions)."""
    logprob_tolerance: float = 1e-4
    """Max |reported - exact| log-prob (float32 engines agree within 1e-4, DESIGN invariant 2)."""
    argmax_tie_tolerance: float = 1e-4
    """A greedy token whose logit is this close to the maximum counts as an exact tie."""
    wrong_rules: tuple[str, ...] = POWER_RULES
    """Wrong acceptance rules simulated for the power statement (names of WRONG_RULES)."""
    power_fractions: tuple[float, ...] = (1.0, 0.5, 0.25)
    """Fractions of rounds in which a wrong rule is applied in the power simulations."""
    power_runs: int = 5
    """Simulated runs of each wrong rule and fraction (each as large as the check itself)."""
    power_target: float = 0.8
    """A simulated deviation counts as detected when at least this share of its runs reject it;
    a check passes only if every wrong rule at full strength is detected."""
    seed: int = 0
    timeout_s: float = 1800.0
    """Deadline of each Generate call."""

    def __post_init__(self) -> None:
        if self.ks is not None and (not self.ks or any(k < 0 for k in self.ks)):
            raise ValueError(f"ks must be non-empty draft lengths >= 0 (or None: the sidecar's k), got {self.ks}")
        if not self.temperatures or any(not t >= 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be non-empty and >= 0, got {self.temperatures}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.prompts is not None and (not self.prompts or any(not p for p in self.prompts)):
            raise ValueError("prompts must be non-empty token-id lists (or None: drawn from the model)")
        for name in ("num_prompts", "prompt_length", "greedy_new_tokens", "samples_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"VerifyConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.first_token is not None and self.first_token < 0:
            raise ValueError(f"first_token must be a token id >= 0 or None (random), got {self.first_token}")
        if self.sample_tokens is not None and self.sample_tokens < 1:
            raise ValueError(f"sample_tokens must be >= 1 or None (2k + 3), got {self.sample_tokens}")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        unknown = set(self.wrong_rules) - set(WRONG_RULES)
        if unknown:
            raise ValueError(f"unknown wrong_rules {sorted(unknown)}; choose from {sorted(WRONG_RULES)}")
        if any(not 0.0 < f <= 1.0 for f in self.power_fractions):
            raise ValueError(f"power_fractions must be in (0, 1], got {self.power_fractions}")
        if self.wrong_rules and 1.0 not in self.power_fractions:
            raise ValueError(
                f"power_fractions must include 1.0 (the wrong rules at full strength), got {self.power_fractions}"
            )
        if self.power_runs < 1:
            raise ValueError(f"power_runs must be >= 1, got {self.power_runs}")
        if not 0.0 < self.power_target <= 1.0:
            raise ValueError(f"power_target must be in (0, 1], got {self.power_target}")


@dataclass(kw_only=True, slots=True)
class Check:
    """One check of the certificate."""

    name: str
    verdict: Verdict
    summary: str
    """One line: what was found."""
    details: dict[str, Any] = field(default_factory=dict)
    """JSON-able evidence (p-values, sample sizes, mismatches, ...)."""


@dataclass(kw_only=True, slots=True)
class Certificate:
    """The result of `verify_sidecar`: the checks and what they were run on."""

    sidecar: str
    engine: dict[str, Any]
    weight_version: int
    checksums: dict[str, str]
    """Served tensor name -> CRC-32 (8 hex digits; 00000000 when the sidecar cannot tell)."""
    prompts: list[list[int]]
    config: dict[str, Any]
    checks: list[Check]
    seconds: float = 0.0

    @property
    def verdict(self) -> Verdict:
        return max((c.verdict for c in self.checks), key=_SEVERITY.__getitem__, default=Verdict.UNDERPOWERED)

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS[self.verdict]


Progress = Callable[[str], None]


def _no_progress(_: str) -> None:
    pass


def verify_sidecar(
    client: SidecarClient,
    model: Qwen3WithMTP | None,
    config: VerifyConfig | None = None,
    progress: Progress = _no_progress,
    draft: Eagle3Draft | None = None,
) -> Certificate:
    """Certify the sidecar behind `client`; `model` is the verifier's copy of the served
    checkpoint (None: only the checks that need no model run; the others are underpowered), and
    `draft` that of the EAGLE-3 draft it serves beside it, if any (for the power simulation)."""
    config = config or VerifyConfig()
    started = time.perf_counter()
    info = client.info()
    specs, version = client.describe_weights(WeightSelector.ALL, include_checksums=True)
    weights = _weights_check(specs, version, model, draft)
    # A proven or unprovable (no checksums: the weights check says so) model is the oracle; a
    # disproven one is not: every check that needs it is refused.
    oracle = model if weights.verdict != Verdict.FAIL else None
    refused = None if model is None or oracle is not None else "refused: the local --model is not the served model"
    ks = config.ks if config.ks is not None else (info.engine.speculation_k,)
    if config.prompts is not None:
        prompts = [list(p) for p in config.prompts]
    elif model is not None:
        prompts = draw_prompts(model, config.num_prompts, config.prompt_length, config.seed, config.first_token)
    else:
        gen = torch.Generator().manual_seed(config.seed)
        vocab = info.engine.model.vocab_size
        prompts = torch.randint(0, vocab, (config.num_prompts, config.prompt_length), generator=gen).tolist()
    logprob_errors: list[float] = []
    checks = [weights]
    for k in ks:
        if 0.0 in config.temperatures:
            progress(f"greedy check, k={k}")
            checks.append(_greedy_check(client, oracle, prompts, k, config, logprob_errors, refused))
    for k in ks:
        for t in config.temperatures:
            if t > 0:
                progress(f"distribution check, k={k}, temperature={t}")
                checks.append(
                    _distribution_check(client, oracle, prompts, k, t, config, logprob_errors, refused, progress, draft)
                )
    checks.append(_logprob_check(logprob_errors, oracle, config, refused))
    _, version_after = client.describe_weights(WeightSelector.ALL)
    if version_after != version:
        checks.append(
            Check(
                name="weights-stable",
                verdict=Verdict.FAIL,
                summary=f"the served weight version changed from {version} to {version_after} during the run; "
                "rerun while no weights are pushed",
            )
        )
    return Certificate(
        sidecar=client.address,
        engine={
            "engine": info.engine.engine,
            "engine_version": info.engine.engine_version,
            "device": info.engine.device_name,
            "model": info.engine.model.name,
            "vocab_size": info.engine.model.vocab_size,
            "num_mtp_layers": info.engine.model.num_mtp_layers,
            "speculation_method": info.engine.speculation_method,
            "speculation_k": info.engine.speculation_k,
        },
        weight_version=version,
        checksums={s.name: f"{s.crc32:08x}" for s in specs},
        prompts=prompts,
        config=_config_dict(config, ks),
        checks=checks,
        seconds=time.perf_counter() - started,
    )


def _config_dict(config: VerifyConfig, ks: tuple[int, ...]) -> dict[str, Any]:
    out = {name: getattr(config, name) for name in VerifyConfig.__slots__ if name != "prompts"}
    out["ks"] = list(ks)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


# --- weights ---------------------------------------------------------------------------------


def _weights_check(
    specs: list[Any], version: int, model: Qwen3WithMTP | None, draft: Eagle3Draft | None = None
) -> Check:
    known = [s for s in specs if s.crc32 != 0]
    details: dict[str, Any] = {"weight_version": version, "tensors": len(specs), "checksummed": len(known)}
    if len(known) < len(specs):
        return Check(
            name="weights",
            verdict=Verdict.UNDERPOWERED,
            summary=f"version {version}; the sidecar reports no checksums for {len(specs) - len(known)} of "
            f"{len(specs)} tensors, so the certificate cannot be tied to its weights",
            details=details,
        )
    if model is None:
        return Check(
            name="weights",
            verdict=Verdict.UNDERPOWERED,
            summary=f"version {version}, {len(specs)} checksums recorded; not compared (pass --model CKPT)",
            details=details,
        )
    problems = weight_mismatches(model, specs, draft)
    details["mismatches"] = problems[:20]
    if draft is None:
        details["draft_tensors_not_compared"] = sum(s.name.startswith(PUSH_PREFIX) for s in specs)
    if problems:
        return Check(
            name="weights",
            verdict=Verdict.FAIL,
            summary=f"the local model differs from the served version {version} in {len(problems)} tensors "
            f"(first: {problems[0]}); pass the checkpoint the sidecar serves",
            details=details,
        )
    return Check(
        name="weights",
        verdict=Verdict.PASS,
        summary=f"version {version}: all {len(specs)} served tensors match the local checkpoint (CRC-32)",
        details=details,
    )


# --- greedy ----------------------------------------------------------------------------------


def _counters(samples: list[Sample]) -> SpeculationCounters:
    total = SpeculationCounters()
    for s in samples:
        total.add(s.counters)
    return total


def _greedy_check(
    client: SidecarClient,
    oracle: Qwen3WithMTP | None,
    prompts: list[list[int]],
    k: int,
    config: VerifyConfig,
    logprob_errors: list[float],
    refused: str | None,
) -> Check:
    name = f"greedy k={k}"
    sp = SamplingParams(temperature=0.0, max_new_tokens=config.greedy_new_tokens, seed=config.seed)
    spec = client.generate(GenerationRequest(prompts=prompts, sampling=sp, speculation_k=k), config.timeout_s)
    plain = client.generate(GenerationRequest(prompts=prompts, sampling=sp, speculation_k=0), config.timeout_s)
    mismatches = []
    for s, p in zip(spec, plain, strict=True):
        if s.token_ids != p.token_ids:
            at = next((i for i, (a, b) in enumerate(zip(s.token_ids, p.token_ids, strict=False)) if a != b), None)
            at = at if at is not None else min(len(s.token_ids), len(p.token_ids))
            mismatches.append({"prompt": s.prompt_index, "first_difference_at": at})
    counters = _counters(spec)
    details: dict[str, Any] = {
        "prompts": len(prompts),
        "new_tokens": config.greedy_new_tokens,
        "tokens_compared": sum(len(s.token_ids) for s in spec),
        "mismatches": mismatches,
        "drafted_tokens": counters.drafted_tokens,
        "acceptance_rate": counters.acceptance_rate,
    }
    not_argmax = 0
    if oracle is not None:
        for prompt, group in ((prompts[s.prompt_index], [s, p]) for s, p in zip(spec, plain, strict=True)):
            exact = exact_tokens(oracle, prompt, [g.token_ids for g in group], sp)
            not_argmax += int(((exact.argmax_margin > config.argmax_tie_tolerance) & exact.mask).sum())
            _collect_logprob_errors(exact, group, logprob_errors)
        details["tokens_not_the_target_argmax"] = not_argmax
    if mismatches or not_argmax:
        what = []
        if mismatches:
            what.append(f"{len(mismatches)} of {len(prompts)} speculative outputs differ from plain decoding")
        if not_argmax:
            what.append(f"{not_argmax} tokens are not the target's argmax")
        return Check(name=name, verdict=Verdict.FAIL, summary="; ".join(what), details=details)
    if k > 0 and counters.drafted_tokens == 0:
        return Check(
            name=name,
            verdict=Verdict.UNDERPOWERED,
            summary="outputs equal, but the sidecar drafted nothing: speculation was not exercised",
            details=details,
        )
    checked = "and every token is the target's argmax" if oracle is not None else f"({refused or 'no --model'})"
    return Check(
        name=name,
        verdict=Verdict.PASS,
        summary=f"{details['tokens_compared']} tokens over {len(prompts)} prompts equal plain decoding {checked}; "
        f"acceptance rate {counters.acceptance_rate:.2f}",
        details=details,
    )


def _collect_logprob_errors(exact: ExactTokens, samples: list[Sample], out: list[float]) -> None:
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        reported = torch.tensor(s.logprobs, dtype=torch.float64)
        out.append(float((reported - exact.logprobs[i, :n].double()).abs().max()) if n else 0.0)


# --- distribution ----------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class DistributionFits:
    """The distribution test of one set of samples: one fit per position and their joint."""

    per_position: list[Fit]
    joint: Fit

    def rejects(self, alpha: float) -> bool:
        """At level alpha: an impossible token, the joint p-value below alpha / 2, or any
        position's below alpha / (2 x positions) (Bonferroni: the whole check errs at rate
        <= alpha). The joint (Fisher's) sees a deviation spread over the positions, as a wrong
        acceptance rule's is; the positions see one concentrated in a single position."""
        worst = min((f.p_value for f in self.per_position), default=1.0)
        return (
            self.joint.impossible > 0
            or self.joint.p_value < alpha / 2
            or worst < alpha / (2 * max(len(self.per_position), 1))
        )

    def summary(self) -> dict[str, Any]:
        return {
            "joint_p_value": self.joint.p_value,
            "joint_statistic": self.joint.statistic,
            "joint_df": self.joint.df,
            "impossible_tokens": self.joint.impossible,
            "min_position_p_value": min((f.p_value for f in self.per_position if f.samples), default=1.0),
            "max_tv": max((f.tv for f in self.per_position), default=0.0),
            "max_tv_noise": max((f.tv_noise for f in self.per_position), default=0.0),
        }


def distribution_fits(exact: list[ExactTokens], seed: int, alpha: float) -> DistributionFits:
    """Per-position fits over all prompts' samples (`statistics.conditional_fit`, samples grouped
    by prompt and prefix; `seed` draws their randomisation), and their joint combination. The
    Monte Carlo p-values resolve down to a quarter of the per-position level of `rejects(alpha)`
    (a position with p at a quarter of it is rejected 92% of the time; a finer p-value decides
    little, and a deviating position costs 1 / resolution simulations)."""
    width = max(e.mask.shape[1] for e in exact)
    per_position = []
    for t in range(width):
        parts = [(j, e) for j, e in enumerate(exact) if t < e.mask.shape[1]]
        probs = torch.cat([e.probs[e.mask[:, t], t] for _, e in parts])
        tokens = torch.cat([e.tokens[e.mask[:, t], t] for _, e in parts])
        prefixes = torch.cat(
            [torch.cat([torch.full((len(e.tokens), 1), j), e.tokens[:, :t]], dim=1)[e.mask[:, t]] for j, e in parts]
        )  # (n, 1 + t): the prompt's index, then the tokens before t
        _, groups = torch.unique(prefixes, dim=0, return_inverse=True)
        resolution = alpha / (8 * width)  # a quarter of the per-position level; costs 1 / resolution simulations
        per_position.append(
            conditional_fit(probs, tokens, groups, seed=_seed(seed, "position", t), resolution=resolution)
        )
    return DistributionFits(per_position=per_position, joint=combine(per_position))


def _seed(*parts: object) -> int:
    """A request seed per (run seed, what, k, temperature, prompt): independent streams for every
    run of the certificate, so no two of its tests share random numbers."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _sampling(config: VerifyConfig, temperature: float, tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(
        temperature=temperature, top_p=config.top_p, top_k=config.top_k, max_new_tokens=tokens, seed=seed
    )


def _distribution_check(
    client: SidecarClient,
    oracle: Qwen3WithMTP | None,
    prompts: list[list[int]],
    k: int,
    temperature: float,
    config: VerifyConfig,
    logprob_errors: list[float],
    refused: str | None,
    progress: Progress,
    draft: Eagle3Draft | None = None,
) -> Check:
    name = f"distribution k={k} T={temperature}"
    tokens = config.sample_tokens or 2 * k + 3
    n = config.samples_per_prompt
    samples: list[list[Sample]] = []
    for j, prompt in enumerate(prompts):
        sp = _sampling(config, temperature, tokens, seed=_seed(config.seed, "sidecar", k, temperature, j))
        req = GenerationRequest(prompts=[prompt], sampling=sp, samples_per_prompt=n, speculation_k=k)
        samples.append(client.generate(req, config.timeout_s))
    counters = _counters([s for group in samples for s in group])
    details: dict[str, Any] = {
        "k": k,
        "temperature": temperature,
        "top_p": config.top_p,
        "top_k": config.top_k,
        "prompts": len(prompts),
        "samples_per_prompt": n,
        "tokens_per_sample": tokens,
        "drafted_tokens": counters.drafted_tokens,
        "acceptance_rate": counters.acceptance_rate,
    }
    if oracle is None:
        return Check(
            name=name,
            verdict=Verdict.UNDERPOWERED,
            summary=f"{refused or 'no --model: the exact distribution cannot be computed'}",
            details=details,
        )
    exact = []
    for prompt, group in zip(prompts, samples, strict=True):
        sp = _sampling(config, temperature, tokens, seed=0)
        e = exact_tokens(oracle, prompt, [s.token_ids for s in group], sp)
        _collect_logprob_errors(e, group, logprob_errors)
        exact.append(e)
    fits = distribution_fits(exact, _seed(config.seed, "fit", k, temperature), config.alpha)
    details |= fits.summary()
    details["positions"] = [
        {"position": t + 1, "p_value": f.p_value, "df": f.df, "samples": f.samples, "tv": f.tv, "tv_noise": f.tv_noise}
        for t, f in enumerate(fits.per_position)
    ]
    if fits.rejects(config.alpha):
        s = fits.summary()
        return Check(
            name=name,
            verdict=Verdict.FAIL,
            summary=f"speculative samples do not follow the target: joint p = {s['joint_p_value']:.2e}, "
            f"min per-position p = {s['min_position_p_value']:.2e}, {s['impossible_tokens']} impossible tokens "
            f"(alpha {config.alpha}, {n * len(prompts)} samples)",
            details=details,
        )
    power = _power(oracle, prompts, k, temperature, tokens, config, progress, draft)
    details["power"] = power
    details["power_runs"] = config.power_runs
    details["power_target"] = config.power_target
    weak = [p["rule"] for p in power if p["fraction"] == 1.0 and not p["detected"]]
    if k > 0 and counters.drafted_tokens == 0:
        verdict, why = Verdict.UNDERPOWERED, "the sidecar drafted nothing: speculation was not exercised"
    elif weak or (k > 0 and not power):
        verdict = Verdict.UNDERPOWERED
        why = (
            f"the test detects the wrong rule(s) {weak} in fewer than {config.power_target:.0%} of simulated runs "
            "at this sample size; raise --samples"
            if weak
            else "no wrong rule was simulated, so the test's power is unknown "
            "(a sidecar serving an EAGLE-3 draft: give the verifier its --draft)"
        )
    else:
        verdict, why = Verdict.PASS, ""
    return Check(
        name=name,
        verdict=verdict,
        summary=f"joint p = {fits.joint.p_value:.3f} over {n * len(prompts)} samples x {tokens} tokens, "
        f"max TV {details['max_tv']:.3f} (noise {details['max_tv_noise']:.3f}), acceptance rate "
        f"{counters.acceptance_rate:.2f}; {_power_line(power, config, k)}" + (f"; {why}" if why else ""),
        details=details,
    )


def _power_line(power: list[dict[str, Any]], config: VerifyConfig, k: int) -> str:
    """The smallest simulated deviation of each wrong rule that the test detects with the target power."""
    if k == 0:
        return "k = 0: plain sampling, no acceptance rule to get wrong"
    if not power:
        return "no power simulation"
    parts = []
    for rule in dict.fromkeys(p["rule"] for p in power):
        detected = [p for p in power if p["rule"] == rule and p["detected"]]
        if detected:
            least = min(detected, key=lambda p: p["fraction"])
            parts.append(f"{rule} down to {least['fraction']:.0%} of rounds (TV {least['max_tv']:.3f})")
        else:
            parts.append(f"{rule} NOT even in 100% of rounds")
    return f"detects (in >= {config.power_target:.0%} of simulated runs) " + ", ".join(parts)


def _power(
    model: Qwen3WithMTP,
    prompts: list[list[int]],
    k: int,
    temperature: float,
    tokens: int,
    config: VerifyConfig,
    progress: Progress,
    draft: Eagle3Draft | None = None,
) -> list[dict[str, Any]]:
    """The same test on samples of each wrong rule in each fraction of rounds (largest first),
    simulated on the verifier side with the embedded engine on the same weights and draft,
    `power_runs` times each: a fraction is detected when at least `power_target` of its runs
    reject. Runs stop once that is decided, and fractions once one is not detected."""
    if k == 0 or (model.config.num_nextn_predict_layers == 0 and draft is None):
        return []
    out = []
    n = config.samples_per_prompt
    need = math.ceil(config.power_target * config.power_runs)
    for rule_name in config.wrong_rules:
        for fraction in sorted(config.power_fractions, reverse=True):
            max_tv, joint, worst = [], [], []
            rejected = missed = 0
            while rejected < need and missed <= config.power_runs - need:
                run = rejected + missed
                progress(f"  power: {rule_name} in {fraction:.0%} of rounds, run {run + 1}")
                seed = _seed(config.seed, rule_name, fraction, run, k, temperature)
                rule = in_fraction_of_rounds(WRONG_RULES[rule_name], fraction, seed=seed)
                engine = with_acceptance_rule(
                    TorchEngine(model, speculation_k=k, max_speculation_k=k, max_batch_size=n, draft=draft), rule
                )
                exact = []
                for j, prompt in enumerate(prompts):
                    sp = _sampling(config, temperature, tokens, seed=_seed(seed, j))
                    group = engine.generate(GenerationRequest(prompts=[prompt], sampling=sp, samples_per_prompt=n))
                    exact.append(exact_tokens(model, prompt, [s.token_ids for s in group], sp))
                fits = distribution_fits(exact, _seed(seed, "fit"), config.alpha)
                rejected, missed = rejected + fits.rejects(config.alpha), missed + (not fits.rejects(config.alpha))
                summary = fits.summary()
                max_tv.append(summary["max_tv"])
                joint.append(summary["joint_p_value"])
                worst.append(summary["min_position_p_value"])
            out.append(
                {
                    "rule": rule_name,
                    "fraction": fraction,
                    "runs": rejected + missed,
                    "rejected": rejected,
                    "detected": rejected >= need,
                    "max_tv": sum(max_tv) / len(max_tv),
                    "joint_p_values": joint,
                    "min_position_p_values": worst,
                }
            )
            if rejected < need:
                break
    return out


# --- log-probs -------------------------------------------------------------------------------


def _logprob_check(
    errors: list[float], oracle: Qwen3WithMTP | None, config: VerifyConfig, refused: str | None
) -> Check:
    semantics = "log_softmax(logits / T)[token], T = 1 when greedy, before top-k/top-p, float32"
    if oracle is None:
        return Check(
            name="logprobs",
            verdict=Verdict.UNDERPOWERED,
            summary=refused or "no --model: the exact log-probs cannot be computed",
            details={"semantics": semantics},
        )
    worst = max(errors, default=0.0)
    details = {
        "semantics": semantics,
        "samples": len(errors),
        "max_abs_diff": worst,
        "tolerance": config.logprob_tolerance,
    }
    if not errors:
        return Check(name="logprobs", verdict=Verdict.UNDERPOWERED, summary="no samples were checked", details=details)
    verdict = Verdict.PASS if worst <= config.logprob_tolerance else Verdict.FAIL
    return Check(
        name="logprobs",
        verdict=verdict,
        summary=f"max |reported - exact| = {worst:.2e} over {len(errors)} samples "
        f"({'within' if verdict == Verdict.PASS else 'ABOVE'} tolerance {config.logprob_tolerance:g}; {semantics})",
        details=details,
    )
