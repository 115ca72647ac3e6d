"""`tools/soak` (tools/bench/soak.py): its short mode end to end (real `specrl serve` processes, pushes, a kill), and
its checks shown to fire: a sample from a version never pushed, a stream that ends short, a
sidecar serving other weights than the push, a request that ran into its full deadline (a hang),
an error nothing explains."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from sidecar.client.client import SidecarCallError, SidecarClient
from sidecar.server.process import Sidecar
from sidecar.types import FinishReason, GenerationRequest, Sample
from tests.sidecar_fixtures import weights
from tools.bench import soak

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_short_soak_passes_and_reports_what_it_checked() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tools.bench", "soak", "--short"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "violations 0" in out and ("kills 1" in out or "kills 2" in out), out
    for needed in ("requests", "complete", "disconnected", "shm", "grpc", "delta", "GetStats: n", "p99", "RSS"):
        assert needed in out, (needed, out)


def _soak(tmp_path: Path) -> soak.Soak:
    """A soak that has started nothing: its checks, called directly."""
    args = argparse.Namespace(short=True, seed=0, minutes=1.0, sidecars=2, push_every_s=1.0, kill_every_s=10.0)
    return soak.Soak(soak.settings(args), tmp_path)


def _sample(version: int, last: int | None = None) -> Sample:
    return Sample(
        request_id="r",
        prompt_index=0,
        sample_index=0,
        token_ids=[1, 2],
        logprobs=[-0.1, -0.2],
        finish_reason=FinishReason.LENGTH,
        weight_version=version,
        last_weight_version=version if last is None else last,
    )


def test_the_sample_checks_fire_on_versions_never_committed_and_on_lost_samples(tmp_path: Path) -> None:
    s = _soak(tmp_path)
    state = soak.SidecarState(index=0, address="unused", committed={0, 1, 2}, begun=3)
    request = GenerationRequest(prompts=[[1, 2]], samples_per_prompt=1, request_id="r")
    assert s._judge_samples(state, 0, 2, request, [_sample(2, 3)], "full") == "complete"
    assert s.violations == []
    s._judge_samples(state, 0, 2, request, [_sample(1)], "full")  # older than the request demanded
    s._judge_samples(state, 0, 2, request, [_sample(2, 5)], "full")  # newer than any push begun
    s._judge_samples(state, 0, 2, request, [], "full")  # a stream that ended short without an error
    assert len(s.violations) == 3, s.violations
    assert s._judge_samples(state, 1, 2, request, [], "full") == "lost_to_kill"  # killed meanwhile: fine
    assert len(s.violations) == 3


def test_a_worker_thread_that_dies_is_a_violation(tmp_path: Path) -> None:
    """A restart that fails (e.g. a sidecar refusing its command line) raised in the killer thread,
    which died quietly while the soak ran on with fewer sidecars and no more kills: now counted."""
    s = _soak(tmp_path)

    def killer() -> None:
        raise RuntimeError("local sidecar exited with code 2 before serving")

    s.guarded(killer)()
    assert len(s.violations) == 1 and "died: RuntimeError: local sidecar exited" in s.violations[0], s.violations


def test_an_error_is_accepted_only_where_the_situation_explains_it(tmp_path: Path) -> None:
    s = _soak(tmp_path)
    state = soak.SidecarState(index=0, address="unused")

    def err(code: grpc.StatusCode) -> SidecarCallError:
        return SidecarCallError("a", "Generate", code, "x")

    assert s._judge_error(state, 0, err(grpc.StatusCode.DEADLINE_EXCEEDED), "short_deadline") == "deadline_exceeded"
    assert s._judge_error(state, 0, err(grpc.StatusCode.CANCELLED), "abort") == "aborted/CANCELLED"
    assert s._judge_error(state, 1, err(grpc.StatusCode.UNAVAILABLE), "full") == "killed/UNAVAILABLE"
    assert s.violations == []
    s._judge_error(state, 0, err(grpc.StatusCode.DEADLINE_EXCEEDED), "full")  # a hang at the full deadline
    s._judge_error(state, 0, err(grpc.StatusCode.UNAVAILABLE), "full")  # unavailable, nobody killed it
    s._judge_error(state, 0, err(grpc.StatusCode.INTERNAL), "abort")
    assert len(s.violations) == 3, s.violations


def test_the_served_weights_check_fires_when_a_sidecar_serves_other_weights(
    tmp_path: Path, sidecar: Sidecar, client: SidecarClient
) -> None:
    s = _soak(tmp_path)
    state = soak.SidecarState(index=0, address=sidecar.address)
    pushed = weights(0)
    specs, version = client.describe_weights()
    client.push_weights([(sp.name, pushed[sp.name]) for sp in specs], version + 1, specs=specs)
    s._check_served(state, client, version + 1, pushed, 0)
    assert s.violations == []  # the oracle agrees with a sidecar that serves the push
    other = dict(pushed)
    name = specs[0].name
    other[name] = pushed[name] + torch.ones_like(pushed[name])
    s._check_served(state, client, version + 1, other, 0)  # what the soak thinks it pushed differs
    s._check_served(state, client, version + 2, pushed, 0)  # a version it does not serve
    assert len(s.violations) == 2, s.violations
    assert name in s.violations[0] and "serves version" in s.violations[1]
