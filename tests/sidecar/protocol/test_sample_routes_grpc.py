"""Routes through gRPC (issue 58): `GenerateRequest.routes` to a real sidecar and `Sample.routes` back.

Oracle: the same request on an engine of the same checkpoint in this process (its samples' routes,
which `tests/sidecar/engine/test_moe_sample_routes.py` checks against transformers' routers): the routes a
client receives are those bit for bit, with their first position and dtype. A dense model refuses a
routes request with INVALID_ARGUMENT naming why; the refusal harms no later request.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from sidecar.client.client import SidecarCallError, SidecarClient
from sidecar.engine.torch_engine import TorchEngine
from sidecar.model.checkpoint import save_checkpoint
from sidecar.types import GenerationRequest, SamplingParams
from tests.sidecar.server.test_moe_push import moe_config, moe_weights
from tests.sidecar_fixtures import start_sidecar

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9]]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("moe") / "ckpt"
    save_checkpoint(path, moe_config(), moe_weights(0))
    return path


@pytest.fixture(scope="module")
def moe_client(moe_checkpoint: Path) -> Iterator[SidecarClient]:
    sc = start_sidecar(moe_checkpoint, speculation_k=2)
    try:
        with SidecarClient(sc.address) as c:
            yield c
    finally:
        sc.stop(0.5)


@pytest.mark.parametrize("routes", ["sequence", "generated"])
def test_routes_arrive_as_the_engine_recorded_them(
    moe_checkpoint: Path, moe_client: SidecarClient, routes: str
) -> None:
    def request() -> GenerationRequest:
        sp = SamplingParams(temperature=1.0, max_new_tokens=9, seed=4)
        return GenerationRequest(prompts=PROMPTS, sampling=sp, samples_per_prompt=2, speculation_k=2, routes=routes)

    got = moe_client.generate(request(), timeout_s=60)
    want = TorchEngine.from_checkpoint(moe_checkpoint, speculation_k=2).generate(request())
    assert len(got) == len(want) == 6
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and g.routes is not None
        assert g.routes == w.routes  # ids, dtype (uint8: 4 experts) and first position
        prompt = PROMPTS[g.prompt_index]
        first = 0 if routes == "sequence" else len(prompt)
        assert g.routes.first_position == first
        assert g.routes.expert_ids.shape == (len(prompt) + len(g.token_ids) - 1 - first, 1, 2)  # 1 sparse layer, top 2
    plain = moe_client.generate(GenerationRequest(prompts=PROMPTS, sampling=SamplingParams(max_new_tokens=3)))
    assert all(s.routes is None for s in plain)  # off by default


def test_a_dense_model_refuses_a_routes_request(client: SidecarClient) -> None:
    with pytest.raises(SidecarCallError) as err:
        client.generate(
            GenerationRequest(prompts=[[1, 2]], sampling=SamplingParams(max_new_tokens=2), routes="generated")
        )
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "without experts" in err.value.details and "send routes 'off'" in err.value.details
    (ok,) = client.generate(GenerationRequest(prompts=[[1, 2]], sampling=SamplingParams(max_new_tokens=2)))
    assert ok.routes is None and len(ok.token_ids) == 2
