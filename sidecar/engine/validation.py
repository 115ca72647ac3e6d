"""Checks that run before the engine touches anything: requests and weight updates.

Both raise the specific errors of `sidecar.errors` with a message that says what was wrong
and what to do; neither changes any state, so a rejected request or update leaves the engine
serving exactly as before.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from sidecar.errors import InvalidRequestError, StaleVersionError, UnknownTensorError, WeightMismatchError
from sidecar.model.model import ModelConfig
from sidecar.types import GenerationRequest, WeightSelector, temperature_problem


def validate_request(request: GenerationRequest, config: ModelConfig, max_speculation_k: int) -> None:
    """Raise InvalidRequestError naming the first problem of `request` for a model of `config`."""
    sp = request.sampling
    # The dataclasses check these on construction; fields may have been reassigned since.
    problem = temperature_problem(sp.temperature)
    if problem:
        raise InvalidRequestError(problem)
    if not (isinstance(sp.top_p, int | float) and 0.0 < sp.top_p <= 1.0):
        raise InvalidRequestError(f"top_p must be in (0, 1] (1 disables it), got {sp.top_p}")
    if not isinstance(sp.top_k, int) or sp.top_k < 0:
        raise InvalidRequestError(f"top_k must be an integer >= 0 (0 disables it), got {sp.top_k}")
    if not isinstance(sp.max_new_tokens, int) or sp.max_new_tokens <= 0:
        raise InvalidRequestError(f"max_new_tokens must be an integer > 0, got {sp.max_new_tokens}")
    vocab = config.vocab_size
    bad_stop = [t for t in sp.stop_token_ids if not 0 <= t < vocab]
    if bad_stop:
        raise InvalidRequestError(f"stop_token_ids {bad_stop} are outside the vocabulary [0, {vocab})")
    if not request.prompts:
        raise InvalidRequestError("prompts is empty; send at least one tokenised prompt")
    if request.samples_per_prompt < 1:
        raise InvalidRequestError(f"samples_per_prompt must be >= 1, got {request.samples_per_prompt}")
    context = config.max_position_embeddings
    for i, prompt in enumerate(request.prompts):
        if len(prompt) == 0:
            raise InvalidRequestError(f"prompts[{i}] is empty; every prompt needs at least one token")
        bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise InvalidRequestError(
                f"prompts[{i}] holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}; "
                "was it tokenised for another model?"
            )
        if len(prompt) + sp.max_new_tokens > context:
            raise InvalidRequestError(
                f"prompts[{i}] has {len(prompt)} tokens; with max_new_tokens={sp.max_new_tokens} that exceeds "
                f"the model context of {context} (max_position_embeddings); shorten the prompt or lower max_new_tokens"
            )
    if request.routes != "off" and config.moe is None:
        raise InvalidRequestError(
            f"routes={request.routes!r} asked of a model without experts ({(config.architectures or ['a dense model'])[0]} "
            "has no mixture-of-experts layers, so its tokens have no routes); send routes 'off'"
        )
    k = request.speculation_k
    if k is not None:
        if k < 0:
            raise InvalidRequestError(f"speculation_k must be >= 0 (0 = plain decoding), got {k}")
        if k > max_speculation_k:
            why = (
                "the model has no MTP draft layers (num_nextn_predict_layers = 0) and no EAGLE-3 draft is "
                "served beside it, so only 0 is possible"
                if config.num_nextn_predict_layers == 0 and max_speculation_k == 0
                else f"the engine's max_speculation_k is {max_speculation_k}"
            )
            raise InvalidRequestError(f"speculation_k={k} is not available: {why}")


def check_weights(
    tensors: Mapping[str, torch.Tensor],
    *,
    selector: WeightSelector,
    version: int,
    served_version: int,
    expected: Mapping[str, tuple[int, ...]],
    all_names: set[str],
    dtype: torch.dtype | Mapping[str, torch.dtype],
) -> None:
    """Raise before any copy unless `tensors` is exactly the `selector` part with the right layouts."""
    if version <= served_version:
        raise StaleVersionError(
            f"weight version {version} is not newer than the served version {served_version}; "
            "send a strictly increasing version"
        )
    for name in tensors:
        if name not in expected:
            if name in all_names:
                raise UnknownTensorError(
                    f"{name} is not part of selector {selector.value!r}; send it with the selector that contains it "
                    "(or 'all')"
                )
            raise UnknownTensorError(
                f"{name}: the model has no tensor of that name (see the checkpoint naming contract)"
            )
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise WeightMismatchError(
            f"update of selector {selector.value!r} lacks {len(missing)} tensor(s), e.g. {missing[:3]}; "
            "an update must contain every tensor of its selector"
        )
    for name, t in tensors.items():
        want = dtype if isinstance(dtype, torch.dtype) else dtype[name]
        if t.dtype != want:
            raise WeightMismatchError(f"{name} has dtype {t.dtype}, the served model uses {want}")
        if tuple(t.shape) != tuple(expected[name]):
            raise WeightMismatchError(f"{name} has shape {list(t.shape)}, the served model has {list(expected[name])}")
