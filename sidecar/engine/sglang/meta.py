"""SGLang 0.5.23's per-request output → specrl's `Sample` and raw `SpeculationCounters`.

A finished ``async_generate`` call (``skip_tokenizer_init=True``, ``return_logprob=True``)
returns ``{"output_ids": [...], "meta_info": {...}}``. The keys read here, and where SGLang
builds them (``sglang/srt/managers/tokenizer_manager.py``):

- ``finish_reason``: ``{"type": "stop"|"length"|"abort", ...}`` (``schedule_batch.FINISH_*.to_json``).
- ``output_token_logprobs``: ``[(logprob, token_id, text|None), ...]`` — on the speculative verify
  path ``log_softmax(logits / T)`` before top-k/top-p, T = 1 when greedy
  (``layers/logprob_processor.py``), which is specrl's definition.
- ``weight_version`` (the last span's version) and ``weight_versions``
  (``[{"version", "start", "end"}, ...]``, spans of output tokens per served version,
  ``utils/weight_versions.py``); specrl pushes integer versions as strings.
- ``completion_tokens``, ``num_retractions``.
- Only when ``spec_verify_ct > 0`` (``_calculate_spec_decoding_metrics``):
  ``spec_verify_ct`` (verify forwards), ``spec_num_correct_drafts`` (accepted drafts, bonus
  excluded), ``spec_num_proposed_drafts`` (= verify_ct · (num_draft_tokens − 1)),
  ``spec_accept_length`` (= completion_tokens / verify_ct — counts the prefill token, so it is
  NOT specrl's tau) and ``spec_correct_drafts_histogram`` (entry n = verify steps that
  accepted exactly n drafts).

specrl's counters (proto/specrl/v1/common.proto) count every target forward that emitted a
token, the prefill included: verify_steps = spec_verify_ct + 1 (prefill) + num_retractions
(each re-prefill after a retraction emits one token); without speculation every token is its
own step. With top-k 1 chain drafting every verify step proposes positions 0..k-1, so
drafted_per_position = [verify_ct] · k and accepted_per_position[i] = number of verify steps
that accepted more than i drafts = sum of histogram[n] for n > i.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sidecar.types import FinishReason, Sample, SpeculationCounters

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


class MetaInfoError(ValueError):
    """An SGLang output that does not have the shape 0.5.23 produces."""


def counters_from_meta_info(meta: Mapping[str, Any], *, num_tokens: int, speculation_k: int) -> SpeculationCounters:
    """Raw speculation counters of one finished request (see the module docstring)."""
    verify_ct = int(meta.get("spec_verify_ct", 0) or 0)
    if verify_ct == 0:
        return SpeculationCounters(verify_steps=num_tokens, generated_tokens=num_tokens)
    drafted = int(meta["spec_num_proposed_drafts"])
    accepted = int(meta["spec_num_correct_drafts"])
    if drafted != verify_ct * speculation_k:
        raise MetaInfoError(
            f"spec_num_proposed_drafts={drafted} but spec_verify_ct={verify_ct} with k={speculation_k} "
            f"implies {verify_ct * speculation_k}; is SGLang running with speculative_num_steps={speculation_k}?"
        )
    if not 0 <= accepted <= drafted:
        raise MetaInfoError(f"spec_num_correct_drafts={accepted} is outside [0, {drafted}]")
    hist: Sequence[int] = meta.get("spec_correct_drafts_histogram") or []
    drafted_pos: list[int] = []
    accepted_pos: list[int] = []
    if hist:
        if (
            sum(hist) != verify_ct
            or sum(n * c for n, c in enumerate(hist)) != accepted
            or len(hist) > speculation_k + 1
        ):
            raise MetaInfoError(
                f"spec_correct_drafts_histogram={list(hist)} disagrees with spec_verify_ct={verify_ct}, "
                f"spec_num_correct_drafts={accepted}, k={speculation_k}"
            )
        drafted_pos = [verify_ct] * speculation_k
        accepted_pos = [sum(hist[i + 1 :]) for i in range(speculation_k)]
    prefills = 1 + int(meta.get("num_retractions", 0) or 0)
    return SpeculationCounters(
        verify_steps=verify_ct + prefills,
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        generated_tokens=num_tokens,
        drafted_per_position=drafted_pos,
        accepted_per_position=accepted_pos,
    )


def _version(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        raise MetaInfoError(
            f"weight version {v!r} is not an integer; was it set by someone other than specrl?"
        ) from None


def sample_from_meta_info(
    out: Mapping[str, Any], *, request_id: str, prompt_index: int, sample_index: int, speculation_k: int
) -> Sample:
    """specrl's `Sample` of one finished SGLang request output."""
    try:
        token_ids = [int(t) for t in out["output_ids"]]
        meta = out["meta_info"]
        finish = meta["finish_reason"]
    except (KeyError, TypeError) as e:
        raise MetaInfoError(f"SGLang output lacks {e}; expected output_ids and meta_info.finish_reason") from e
    if not isinstance(finish, Mapping) or finish.get("type") not in _FINISH:
        raise MetaInfoError(f"finish_reason {finish!r} is not a finished request's reason (stop/length/abort)")
    reason = _FINISH[finish["type"]]
    logprob_rows = meta.get("output_token_logprobs") or []
    logprobs = [float(row[0]) for row in logprob_rows]
    lp_ids = [int(row[1]) for row in logprob_rows]
    if lp_ids != token_ids[: len(lp_ids)] or (len(lp_ids) != len(token_ids) and reason is not FinishReason.ABORT):
        raise MetaInfoError(
            f"output_token_logprobs covers tokens {lp_ids[:8]}... but output_ids are {token_ids[:8]}... "
            f"({len(lp_ids)} vs {len(token_ids)}); was return_logprob set?"
        )
    token_ids = token_ids[: len(lp_ids)]  # an abort may report ids whose log-probs never arrived
    spans = meta.get("weight_versions") or []
    last = _version(meta["weight_version"]) if "weight_version" in meta else None
    first = _version(spans[0]["version"]) if spans else last
    if first is None or last is None:
        raise MetaInfoError("meta_info has no weight_version")
    return Sample(
        request_id=request_id,
        prompt_index=prompt_index,
        sample_index=sample_index,
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=reason,
        weight_version=first,
        last_weight_version=last,
        counters=counters_from_meta_info(meta, num_tokens=len(token_ids), speculation_k=speculation_k),
    )
