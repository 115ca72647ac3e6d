"""The decode round traces whole, and its traced form equals eager (issue 40).

`decode_round.decode_round` is the function a compiled or captured execution takes whole. Here
dynamo traces it with `fullgraph=True` (any graph break — a host read such as `.item()` or
`.tolist()`, a Python branch on a tensor's value — is an error) and the traced graphs run in place
of the eager round through whole generations: continuous batching (rows join and leave), ragged
rows, plain and speculative rounds, temperature 1 and greedy. Oracles: the same engine run eagerly
(token for token, log-probs), and for greedy rows the plain full forward decoding one token at a
time. backend="eager" runs the traced graphs as they are (tracing only, no code generation), which
is what keeps GPU capture possible when no GPU is at hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_static_engine import oracle_greedy

from sidecar.engine.decode_round import decode_round
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.model import Qwen3WithMTP
from sidecar.types import GenerationRequest, Sample, SamplingParams

PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12, 13]]


class CountingBackend:
    """A dynamo backend that runs each traced graph as it is and counts graphs and their calls."""

    def __init__(self) -> None:
        self.graphs = 0
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs += 1

        def run(*args: Any) -> Any:
            self.calls += 1
            return gm.forward(*args)

        return run


def generate(engine: TorchEngine, k: int) -> list[Sample]:
    """Two requests, the second submitted while the first runs (rows join mid-generation)."""
    first = GenerationRequest(
        prompts=PROMPTS,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=10, seed=5),
        speculation_k=k,
        request_id="a",
    )
    second = GenerationRequest(
        prompts=PROMPTS[:2],
        sampling=SamplingParams(temperature=0.0, max_new_tokens=8),
        speculation_k=k,
        request_id="b",
    )
    engine.submit(first)
    out = engine.step() + engine.step()
    engine.submit(second)
    for _ in range(100):
        if not engine.has_work():
            break
        out += engine.step()
    return sorted(out, key=lambda s: (s.request_id, s.prompt_index, s.sample_index))


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 3])
def test_the_round_traced_with_fullgraph_equals_eager_and_the_oracle(aligned_model: Qwen3WithMTP, k: int) -> None:
    torch._dynamo.reset()
    eager = generate(TorchEngine(aligned_model, max_context=64), k)
    backend = CountingBackend()
    traced = TorchEngine(aligned_model, max_context=64)
    rounds = 0

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal rounds
        rounds += 1
        return compiled(*args, **kwargs)

    compiled = torch.compile(decode_round, fullgraph=True, backend=backend)
    traced._round = counted
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=256):
        out = generate(traced, k)
    assert rounds >= 4 and backend.calls == rounds  # every round ran as one traced graph, none fell back
    assert [s.token_ids for s in out] == [s.token_ids for s in eager]
    for x, y in zip(out, eager, strict=True):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-6, rtol=0)
    greedy = [s for s in out if s.request_id == "b"]
    assert [s.token_ids for s in greedy] == [oracle_greedy(aligned_model, p, 8) for p in PROMPTS[:2]]
    if k:
        assert sum(s.counters.accepted_tokens for s in out) > 0  # the draft chain was traced and used
