"""The trainer's fleet against real sidecars: caller errors surface without taking the fleet
down, the train loop talks to token- and mTLS-protected sidecars (remote and local), and the
samples of a run do not depend on how many sidecars served it, on the plain-decoding
measurement, or on a resume.

Oracles: the sidecar's own status and message; the samples of the same run on one open
sidecar (each sample is a function of (run seed, step, prompt, sample index) and the weights
only). Tiny model, 1-2 steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from sidecar.client.client import ClientConfig, SidecarCallError
from sidecar.client.fleet import Fleet, FleetConfig, FleetResult, NoLiveSidecarError
from sidecar.model.model import ModelConfig
from sidecar.security import TOKEN_ENV, SecurityConfig
from sidecar.server.process import Sidecar
from sidecar.types import GenerationRequest, SamplingParams
from tests.sidecar_fixtures import start_sidecar
from trainer.rl import loop as rl_loop
from trainer.rl import run_setup
from trainer.rl.config import RLConfig, RolloutConfig, SidecarsConfig, TaskConfig
from trainer.rl.preflight import PreflightError
from trainer.rl.warmup import make_model
from trainer.tokenizer import CharTokenizer

pytestmark = pytest.mark.usefixtures("single_torch_thread")
Code = grpc.StatusCode
SPEC_K = 2
"""The sidecars' maximum draft length (start_sidecar's default)."""
Samples = list[tuple[int, int, tuple[int, ...]]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = ModelConfig.tiny(
        vocab_size=CharTokenizer().vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return make_model(tmp_path_factory.mktemp("rl") / "policy", config, seed=0)


def started(checkpoint: Path, n: int, **config: Any) -> list[Sidecar]:
    return [start_sidecar(checkpoint, **config) for _ in range(n)]


def run_config(
    checkpoint: Path,
    run_dir: Path,
    sidecars: SidecarsConfig,
    *,
    steps: int = 1,
    measure_plain: bool = False,
) -> RLConfig:
    return RLConfig(
        model=checkpoint,
        task=TaskConfig(kind="arithmetic", regime="zero", digits=1),
        rollout=RolloutConfig(
            prompts_per_step=3,
            samples_per_prompt=2,
            temperature=1.0,
            max_new_tokens=8,
            speculation_k=SPEC_K,
            measure_plain=measure_plain,
        ),
        sidecars=sidecars,
        steps=steps,
        eval_every=0,
        checkpoint_every=1,
        seed=3,
        run_dir=run_dir,
    )


# ---- finding 4: caller errors surface, the fleet stays -------------------------------------


def test_a_request_every_sidecar_refuses_surfaces_and_leaves_the_fleet_whole(pair: tuple[Sidecar, Sidecar]) -> None:
    with Fleet([s.address for s in pair]) as fleet:
        bad = GenerationRequest(
            prompts=[[1, 2], [3], [4, 5, 6]],
            sampling=SamplingParams(temperature=0.0, max_new_tokens=4),
            speculation_k=50,  # beyond the engines' max_speculation_k (8): INVALID_ARGUMENT
        )
        for _ in range(2):
            with pytest.raises(SidecarCallError) as err:
                fleet.generate(bad)
            assert err.value.code == Code.INVALID_ARGUMENT and "speculation_k" in err.value.details, err.value
            assert fleet.down() == []
        good = fleet.generate(GenerationRequest(prompts=bad.prompts, sampling=bad.sampling)).samples
        assert [(s.prompt_index, s.sample_index) for s in good] == [(0, 0), (1, 0), (2, 0)]


def test_a_wrong_token_surfaces_as_unauthenticated_not_as_a_dead_fleet(checkpoint: Path) -> None:
    sidecars = started(checkpoint, 2, token="s3cret")
    try:
        request = GenerationRequest(prompts=[[1, 2]], sampling=SamplingParams(temperature=0.0, max_new_tokens=4))
        with Fleet([s.address for s in sidecars], FleetConfig(client=ClientConfig(token="wrong"))) as fleet:
            with pytest.raises(SidecarCallError) as err:
                fleet.generate(request)
            assert err.value.code == Code.UNAUTHENTICATED and "wrong bearer token" in err.value.details
            with pytest.raises(SidecarCallError) as err:
                fleet.push_weights({"x": __import__("torch").zeros(1)}, 1)
            assert err.value.code == Code.UNAUTHENTICATED
            assert fleet.down() == []
    finally:
        for s in sidecars:
            s.stop(0.2)


# ---- finding 5: the train loop against secured sidecars -------------------------------------


def test_train_against_a_token_protected_sidecar(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    (sidecar,) = started(checkpoint, 1, token="s3cret-token")
    try:
        secured = SidecarsConfig(addresses=[sidecar.address], security=SecurityConfig(token_file=token_file))
        history = rl_loop.train(run_config(checkpoint, tmp_path / "run", secured), progress=False)
        assert history[0]["weights/version"] == 2.0
        written = (tmp_path / "run" / "config.yaml").read_text()
        assert "s3cret-token" not in written and str(token_file) in written  # the path, never the token
        # without the token the same run is refused before anything starts (preflight asks the
        # sidecar first), with the sidecar's own status and message
        open_cfg = run_config(checkpoint, tmp_path / "run2", SidecarsConfig(addresses=[sidecar.address]))
        with pytest.raises(PreflightError, match="UNAUTHENTICATED: missing bearer token"):
            rl_loop.train(open_cfg, progress=False)
        assert not (tmp_path / "run2").exists()
    finally:
        sidecar.stop(0.2)


def test_train_against_a_mutual_tls_sidecar(checkpoint: Path, tmp_path: Path, pki: Path) -> None:
    security = SecurityConfig(cert=pki / "server.pem", key=pki / "server.key", peer_ca=pki / "ca.pem")
    (sidecar,) = started(checkpoint, 1, security=security)
    try:
        mtls = SecurityConfig(peer_ca=pki / "ca.pem", cert=pki / "client.pem", key=pki / "client.key")
        cfg = run_config(checkpoint, tmp_path / "run", SidecarsConfig(addresses=[sidecar.address], security=mtls))
        assert rl_loop.train(cfg, progress=False)[0]["weights/version"] == 2.0
    finally:
        sidecar.stop(0.2)


@pytest.mark.slow
def test_train_with_a_local_sidecar_that_inherits_the_token(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$SPECRL_TOKEN in the trainer's environment: the local sidecar requires it, the trainer sends it."""
    monkeypatch.setenv(TOKEN_ENV, "from-the-environment")
    cfg = run_config(checkpoint, tmp_path / "run", SidecarsConfig(local=1))
    assert rl_loop.train(cfg, progress=False)[0]["weights/version"] == 2.0


def test_security_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cert and key go together"):
        SecurityConfig(cert=tmp_path)
    absent = SidecarsConfig(addresses=["127.0.0.1:1"], security=SecurityConfig(token_file=tmp_path / "absent"))
    with pytest.raises(ValueError, match="sidecars.security.token_file: .* is not a readable file"):
        absent.client_config()
    with pytest.raises(ValueError, match="local sidecars serve plaintext"):
        SidecarsConfig(local=1, security=SecurityConfig(tls=True))
    assert "s3cret" not in repr(ClientConfig(token="s3cret"))


# ---- finding 6: samples do not depend on the fleet ------------------------------------------


def recorded_run(
    monkeypatch: pytest.MonkeyPatch, cfg: RLConfig, *, resume: bool = False
) -> dict[int | None, list[Samples]]:
    """Run `cfg`; the samples of every generation, keyed by its speculation k."""
    seen: dict[int | None, list[Samples]] = {}

    class Recording(Fleet):
        def generate(self, request: GenerationRequest, *, rejoin: bool = True) -> FleetResult:
            result = super().generate(request, rejoin=rejoin)
            rows = [(s.prompt_index, s.sample_index, tuple(s.token_ids)) for s in result.samples]
            seen.setdefault(request.speculation_k, []).append(rows)
            return result

    monkeypatch.setattr(run_setup, "Fleet", Recording)
    rl_loop.train(cfg, resume=resume, progress=False)
    return seen


def test_samples_do_not_depend_on_the_fleet_the_plain_pass_or_a_resume(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sidecars = started(checkpoint, 2)
    try:
        one = SidecarsConfig(addresses=[sidecars[0].address])
        two = SidecarsConfig(addresses=[s.address for s in sidecars])
        alone = recorded_run(monkeypatch, run_config(checkpoint, tmp_path / "a", one, steps=2))[SPEC_K]
        # two steps (each may add dynamic-sampling refill rounds), different samples
        assert len(alone) >= 2 and alone[0] != alone[1]
        assert len({t for step in alone for _, _, t in step}) > 3  # really sampled, not one answer
        # two sidecars, with the plain-decoding measurement between the passes
        both = recorded_run(monkeypatch, run_config(checkpoint, tmp_path / "b", two, steps=2, measure_plain=True))
        assert both[SPEC_K] == alone and len(both[0]) == 2
        # interrupted after step 1, resumed on the other fleet
        first = recorded_run(monkeypatch, run_config(checkpoint, tmp_path / "c", two, steps=1))[SPEC_K]
        rest = recorded_run(monkeypatch, run_config(checkpoint, tmp_path / "c", one, steps=2), resume=True)[SPEC_K]
        assert first + rest == alone
    finally:
        for s in sidecars:
            s.stop(0.2)


def test_no_live_sidecar_is_only_said_when_none_is(checkpoint: Path) -> None:
    (sidecar,) = started(checkpoint, 1)
    address = sidecar.address
    sidecar.stop(0.2)
    with (
        Fleet([address], FleetConfig(client=ClientConfig(retries=0, timeout_s=2))) as fleet,
        pytest.raises(NoLiveSidecarError, match="no live sidecar"),
    ):
        fleet.generate(GenerationRequest(prompts=[[1]], sampling=SamplingParams(max_new_tokens=2)))
