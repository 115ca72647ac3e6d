"""Non-finite weights through `specrl serve` and a real client (issue 46).

- A push holding a NaN is refused (INVALID_ARGUMENT, naming the tensor) before anything applies:
  the served version and outputs stay as they were.
- Finite weights whose activations overflow (a diverged run's) are served; their samples carry
  non-finite log-probs, GetStats and Prometheus count them, the fleet warns; a push restoring the
  original weights restores the original outputs exactly (tokens and log-probs).
Oracle: the sidecar's own answers before any bad push, and plain greedy decoding of the weights.
"""

from __future__ import annotations

import logging
import math
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sidecar.client.client import SidecarCallError, SidecarClient
from sidecar.client.fleet import Fleet
from sidecar.types import Sample
from tests.sidecar_fixtures import PROMPTS, greedy_oracle, greedy_request, make_checkpoint, weights

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """`specrl serve` of the tiny checkpoint (seed 0) in a subprocess: (gRPC address, metrics port)."""
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("nonfinite") / "ckpt", seed=0)
    specrl = Path(sys.executable).parent / "specrl"
    proc = subprocess.Popen(
        [
            str(specrl),
            "serve",
            "--model",
            str(checkpoint),
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--shutdown-grace-s",
            "1",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        address, metrics = None, None
        for _ in range(400):  # log lines until the bound address
            line = proc.stderr.readline()
            if not line:
                break
            if "metrics on :" in line:
                metrics = int(line.rsplit("metrics on :", 1)[1].split()[0])
            if "listening on" in line:
                address = line.rsplit(" ", 1)[-1].strip()
                break
        assert address and metrics, "serve never logged its addresses"
        yield address, metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def answers(samples: list[Sample]) -> list[tuple[list[int], list[float]]]:
    return [(s.token_ids, s.logprobs) for s in samples]


def prometheus(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_nonfinite_weights_are_refused_or_visible_and_a_good_push_restores_the_outputs(
    served: tuple[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    address, metrics_port = served
    good = weights(0)
    with SidecarClient(address) as client:
        reference = answers(client.generate(greedy_request()))
        assert [t for t, _ in reference] == greedy_oracle(0, PROMPTS)

        nan = dict(good)
        nan["model.layers.1.mlp.down_proj.weight"] = good["model.layers.1.mlp.down_proj.weight"].clone()
        nan["model.layers.1.mlp.down_proj.weight"][2, 5] = math.nan
        with pytest.raises(SidecarCallError) as refused:
            client.push_weights(nan, version=1)
        assert refused.value.code.name == "INVALID_ARGUMENT"
        assert "model.layers.1.mlp.down_proj.weight" in refused.value.details
        assert "NaN or infinite" in refused.value.details and "version 0 still serves" in refused.value.details
        assert client.info().weight_version == 0
        assert answers(client.generate(greedy_request())) == reference

        # finite weights whose values overflow: every value is the largest float32 (a run gone wild)
        overflow = dict(good)
        overflow["model.layers.0.self_attn.v_proj.weight"] = torch.full_like(
            good["model.layers.0.self_attn.v_proj.weight"], 3e38
        )
        client.push_weights(overflow, version=2)
        with caplog.at_level(logging.WARNING, logger="sidecar.client.fleet"), Fleet([address]) as fleet:
            result = fleet.generate(greedy_request())
        assert result.nonfinite == len(PROMPTS)
        assert f"{address} (weight versions [2])" in caplog.text and "NaN or infinite log-probs" in caplog.text
        stats = client.stats()
        assert {v.weight_version: v.samples_nonfinite for v in stats.versions}[2] == len(PROMPTS)
        assert {v.weight_version: v.samples_nonfinite for v in stats.versions}[0] == 0
        assert prometheus(metrics_port, "specrl_samples_nonfinite_total") == len(PROMPTS)

        client.push_weights(good, version=3)
        assert answers(client.generate(greedy_request())) == reference  # the first generation after it
        assert answers(client.generate(greedy_request())) == reference
