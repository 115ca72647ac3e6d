"""`specrl verify` against a real in-process sidecar: it passes on the embedded engine and fails
on each deliberately broken deployment.

The model is the engine harness's (tests/sidecar/engine/test_speculative_distribution.py): vocabulary 8,
a partly aligned MTP draft (acceptance 0.4-0.6, so both the accept and the residual paths carry
mass). The broken deployments are injected with `wrong_rules.with_acceptance_rule`
(the wrong rules of `sidecar.losslessness.wrong_rules`), a sidecar whose reported log-probs are
off by 1e-3, and a sidecar that serves other weights than the verifier's checkpoint. Seeds are
fixed, so every outcome is deterministic.

`specrl verify` is `sidecar/losslessness/cli.py`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from sidecar.client.client import SidecarClient
from sidecar.engine.sampling import AcceptanceRule
from sidecar.engine.torch_engine import TorchEngine
from sidecar.losslessness.certificate import Certificate, Verdict, VerifyConfig, verify_sidecar
from sidecar.losslessness.exact_target import draw_prompts
from sidecar.losslessness.report import certificate_to_json, format_certificate
from sidecar.losslessness.wrong_rules import POWER_RULES, WRONG_RULES, in_fraction_of_rounds, with_acceptance_rule
from sidecar.model.checkpoint import model_state_dict, save_checkpoint
from sidecar.model.model import ModelConfig, Qwen3WithMTP
from sidecar.server.grpc_server import ServerConfig
from sidecar.server.process import Sidecar, SidecarConfig
from sidecar.types import Sample, WeightSelector
from sidecar.weight_transport.tensors import tensor_crc32
from tests.sidecar.engine_fixtures import aligned_draft_model, aligned_eagle3, eagle3_target
from trainer.cli.main import main

pytestmark = pytest.mark.usefixtures("single_torch_thread")

FAST = dict(num_prompts=4, samples_per_prompt=150, power_fractions=(1.0,), power_runs=1, greedy_new_tokens=16)


@pytest.fixture(scope="module")
def model() -> Qwen3WithMTP:
    return aligned_draft_model(ModelConfig.tiny(vocab_size=8), seed=11, eps=0.1)


class PerturbedLogprobs(TorchEngine):
    """A sidecar engine that reports every log-prob off by `delta` (tokens are right)."""

    delta = 1e-3

    def step(self) -> list[Sample]:
        out = super().step()
        for s in out:
            s.logprobs = [lp + self.delta for lp in s.logprobs]
        return out


@contextmanager
def serving(engine: TorchEngine) -> Iterator[SidecarClient]:
    with Sidecar(engine, SidecarConfig(server=ServerConfig(port=0))) as sidecar, SidecarClient(sidecar.address) as c:
        yield c


def certify(model: Qwen3WithMTP, engine: TorchEngine, **config: object) -> Certificate:
    with serving(engine) as client:
        return verify_sidecar(client, model, VerifyConfig(**(FAST | config)))  # type: ignore[arg-type]


def verdicts(cert: Certificate) -> dict[str, Verdict]:
    return {c.name: c.verdict for c in cert.checks}


@pytest.mark.slow
def test_the_embedded_engine_is_certified_at_k_1_and_3_greedy_and_sampled_with_top_p(model: Qwen3WithMTP) -> None:
    engine = TorchEngine(model, speculation_k=3, max_batch_size=300)
    # 300 samples a prompt: at 150, resample-from-target at k = 1, T = 1 (TV ~0.06) sits at the edge
    # of detection, and whether one simulated run detects it depends on the draw
    cert = certify(model, engine, ks=(1, 3), temperatures=(0.0, 0.7, 1.0), top_p=0.9, samples_per_prompt=300)
    assert verdicts(cert) == {
        "weights": Verdict.PASS,
        "greedy k=1": Verdict.PASS,
        "greedy k=3": Verdict.PASS,
        "distribution k=1 T=0.7": Verdict.PASS,
        "distribution k=1 T=1.0": Verdict.PASS,
        "distribution k=3 T=0.7": Verdict.PASS,
        "distribution k=3 T=1.0": Verdict.PASS,
        "logprobs": Verdict.PASS,
    }, format_certificate(cert)
    assert cert.verdict == Verdict.PASS and cert.exit_status == 0
    print(format_certificate(cert))
    for check in cert.checks:
        if check.name.startswith("distribution"):
            # the power statement: both wrong rules were simulated and detected at this sample size
            assert {p["rule"] for p in check.details["power"] if p["detected"] and p["fraction"] == 1} == set(
                POWER_RULES
            )
            assert 0.3 < check.details["acceptance_rate"] < 0.9  # speculation really was exercised
            assert check.details["impossible_tokens"] == 0
    assert cert.checksums and all(v != "00000000" for v in cert.checksums.values())
    report = certificate_to_json(cert)
    assert json.loads(json.dumps(report))["verdict"] == "pass"


@pytest.mark.slow
@pytest.mark.parametrize(
    "rule",
    [
        WRONG_RULES["accept_every_draft"],
        WRONG_RULES["resample_from_target"],
        WRONG_RULES["greedy_verification"],
        in_fraction_of_rounds(WRONG_RULES["accept_every_draft"], 0.5, seed=3),
    ],
    ids=["accept_every_draft", "resample_from_target", "greedy_verification", "accept_every_draft_in_half_the_rounds"],
)
def test_a_wrong_acceptance_rule_in_the_engine_fails_the_certificate(model: Qwen3WithMTP, rule: AcceptanceRule) -> None:
    engine = with_acceptance_rule(TorchEngine(model, speculation_k=3, max_batch_size=300), rule)
    cert = certify(model, engine, ks=(3,), temperatures=(1.0,), top_p=0.9, wrong_rules=())  # no power simulation
    assert verdicts(cert)["distribution k=3 T=1.0"] == Verdict.FAIL, format_certificate(cert)
    assert cert.verdict == Verdict.FAIL and cert.exit_status == 1


def test_a_wrong_rule_at_temperature_zero_is_still_greedy_exact(model: Qwen3WithMTP) -> None:
    """At temperature 0 p and q are one-hot, so resampling from p equals the residual and greedy
    verification is exact: the greedy check must not cry wolf (a broken accept-all rule, in
    contrast, emits the draft's argmax)."""
    for harmless in ("resample_from_target", "greedy_verification"):
        exact = certify(
            model, with_acceptance_rule(TorchEngine(model), WRONG_RULES[harmless]), ks=(3,), temperatures=(0.0,)
        )
        assert verdicts(exact)["greedy k=3"] == Verdict.PASS, format_certificate(exact)
    broken = certify(
        model, with_acceptance_rule(TorchEngine(model), WRONG_RULES["accept_every_draft"]), ks=(3,), temperatures=(0.0,)
    )
    assert verdicts(broken)["greedy k=3"] == Verdict.FAIL, format_certificate(broken)


def test_log_probs_perturbed_by_1e_3_fail_the_certificate(model: Qwen3WithMTP) -> None:
    cert = certify(model, PerturbedLogprobs(model, speculation_k=3), ks=(3,), temperatures=(0.0,))
    checks = {c.name: c for c in cert.checks}
    assert checks["logprobs"].verdict == Verdict.FAIL, format_certificate(cert)
    assert checks["logprobs"].details["max_abs_diff"] == pytest.approx(1e-3, abs=1e-5)
    assert checks["greedy k=3"].verdict == Verdict.PASS  # the tokens themselves are right
    assert cert.exit_status == 1


def test_other_weights_than_the_verifiers_are_refused(model: Qwen3WithMTP) -> None:
    served = aligned_draft_model(ModelConfig.tiny(vocab_size=8), seed=11, eps=0.1)
    with torch.no_grad():
        served.model.norm.weight[0] += 1e-3  # one element of one tensor
    cert = certify(model, TorchEngine(served), ks=(3,), temperatures=(0.0, 1.0))
    checks = {c.name: c for c in cert.checks}
    assert checks["weights"].verdict == Verdict.FAIL
    assert "model.norm.weight" in checks["weights"].summary
    assert "refused" in checks["logprobs"].summary and checks["logprobs"].verdict == Verdict.UNDERPOWERED
    assert "refused" in checks["distribution k=3 T=1.0"].summary
    assert cert.exit_status == 1


def test_without_a_model_only_greedy_runs_and_the_certificate_is_underpowered(model: Qwen3WithMTP) -> None:
    with serving(TorchEngine(model, speculation_k=2)) as client:
        cert = verify_sidecar(
            client, None, VerifyConfig(**(FAST | {"temperatures": (0.0, 1.0), "samples_per_prompt": 20}))
        )  # type: ignore[arg-type]
    v = verdicts(cert)
    assert v["greedy k=2"] == Verdict.PASS  # the sidecar's current k
    assert v["weights"] == v["logprobs"] == v["distribution k=2 T=1.0"] == Verdict.UNDERPOWERED
    assert cert.exit_status == 3


def test_the_cli_prints_the_certificate_writes_json_and_exits_with_the_verdict(
    model: Qwen3WithMTP, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, model.config, model_state_dict(model))
    out = tmp_path / "cert.json"
    with serving(TorchEngine(model, speculation_k=3)) as client:
        args = ["verify", "--sidecar", client.address, "--model", str(ckpt), "--k", "3", "--temperature", "0"]
        result = CliRunner().invoke(main, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output and "greedy k=3" in result.output
    cert = json.loads(out.read_text())
    assert cert["verdict"] == "pass" and cert["weight_version"] == 0 and cert["prompts"]
    with serving(PerturbedLogprobs(model, speculation_k=3)) as client:
        args = ["verify", "--sidecar", client.address, "--model", str(ckpt), "--k", "3", "--temperature", "0"]
        assert CliRunner().invoke(main, args).exit_code == 1
    bad = CliRunner().invoke(main, ["verify", "--sidecar", "127.0.0.1:1", "--temperature", "x"])
    assert bad.exit_code == 2 and "comma-separated" in bad.output
    gone = CliRunner().invoke(main, ["verify", "--sidecar", "127.0.0.1:1", "--temperature", "0"])
    assert gone.exit_code == 4 and "UNAVAILABLE" in gone.output  # not 1: no certificate was made


def test_describe_weights_checksums_are_those_of_the_served_tensors_before_and_after_a_push(
    model: Qwen3WithMTP,
) -> None:
    other = {n: t + 0.5 for n, t in model_state_dict(model).items()}
    with serving(TorchEngine(aligned_draft_model(ModelConfig.tiny(vocab_size=8), seed=11, eps=0.1))) as client:
        layout, version = client.describe_weights()
        assert version == 0 and all(s.crc32 == 0 for s in layout)  # the layout only, as before
        specs, version = client.describe_weights(include_checksums=True)
        assert version == 0 and {s.name: s.crc32 for s in specs} == {
            n: tensor_crc32(t) for n, t in model_state_dict(model).items()
        }
        client.push_weights(other, version=1)
        specs, version = client.describe_weights(include_checksums=True)
        assert version == 1 and {s.name: s.crc32 for s in specs} == {n: tensor_crc32(t) for n, t in other.items()}


class NoChecksums(TorchEngine):
    """An engine that cannot read its weights back (as SGLang's adapter today)."""

    def weight_checksums(self, selector: WeightSelector) -> None:
        return None


def test_a_sidecar_without_checksums_is_checked_but_the_certificate_stays_underpowered(model: Qwen3WithMTP) -> None:
    cert = certify(model, NoChecksums(model, speculation_k=3), ks=(3,), temperatures=(0.0,))
    v = verdicts(cert)
    assert v["weights"] == Verdict.UNDERPOWERED and "no checksums" in cert.checks[0].summary
    assert v["greedy k=3"] == v["logprobs"] == Verdict.PASS  # still checked against the unproven model
    assert cert.exit_status == 3


def test_drawn_prompts_start_with_the_given_token_and_are_reproducible(model: Qwen3WithMTP) -> None:
    prompts = draw_prompts(model, 3, 5, seed=4, first_token=1)
    assert [len(p) for p in prompts] == [5, 5, 5] and all(p[0] == 1 for p in prompts)
    assert draw_prompts(model, 3, 5, seed=4, first_token=1) == prompts


@pytest.mark.slow
def test_a_sidecar_with_an_eagle3_draft_is_certified_with_the_drafts_power_and_underpowered_without_it() -> None:
    target = eagle3_target(8, eps=0.1)
    draft = aligned_eagle3(target)
    with serving(TorchEngine(target, speculation_k=3, max_batch_size=300, draft=draft)) as client:
        config = VerifyConfig(**(FAST | {"ks": (3,), "temperatures": (1.0,)}))  # type: ignore[arg-type]
        cert = verify_sidecar(client, target, config, draft=draft)
        without = verify_sidecar(client, target, config)
    assert cert.engine["speculation_method"] == "eagle3"
    assert verdicts(cert) == {"weights": Verdict.PASS, "distribution k=3 T=1.0": Verdict.PASS, "logprobs": Verdict.PASS}
    check = cert.checks[1]
    assert {p["rule"] for p in check.details["power"] if p["detected"]} == set(POWER_RULES)
    assert 0.2 < check.details["acceptance_rate"] < 0.9
    assert verdicts(without)["distribution k=3 T=1.0"] == Verdict.UNDERPOWERED  # no power statement without it
    assert "--draft" in without.checks[1].summary + str(without.checks[1].details.get("why", ""))
