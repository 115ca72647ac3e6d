"""The verl plugin's start-up checks, without verl (`sidecar.integrations.verl_config` imports none
of it): each wrong setting fails with one message naming the setting and what to do. A real
sidecar (the module's tiny checkpoint) is the other side; the oracle is the checkpoint itself
(the same one attaches, a changed one is refused). verl's own machinery: tests/with_verl."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sidecar.integrations.verl_config import SpecrlConfigError, SpecrlRolloutOptions, attach
from sidecar.server.process import Sidecar
from tests.sidecar_fixtures import make_checkpoint


def options(sidecar: Sidecar, **kw: object) -> SpecrlRolloutOptions:
    return SpecrlRolloutOptions.from_mapping({"sidecars": [sidecar.address], "connect_timeout_s": 5.0, **kw})


def test_the_served_model_and_its_draft_attach(sidecar: Sidecar, checkpoint: Path) -> None:
    info = attach(sidecar.address, options(sidecar, draft_checkpoint=str(checkpoint)), checkpoint)
    assert info.engine.model.num_layers == json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]


def test_unknown_options_and_bad_values_are_named(sidecar: Sidecar) -> None:
    with pytest.raises(SpecrlConfigError, match=r"unknown option\(s\) \['speculaton_k'\]; known: "):
        options(sidecar, speculaton_k=3)
    with pytest.raises(SpecrlConfigError, match="speculation_k must be >= 0"):
        options(sidecar, speculation_k=-1)
    with pytest.raises(SpecrlConfigError, match="sidecars is empty"):
        SpecrlRolloutOptions.from_mapping({"sidecars": []})
    with pytest.raises(SpecrlConfigError, match="verl makes 2 rollout replica"):
        options(sidecar).sidecar_for(0, replicas=2)


def test_security_options_are_the_shared_security_config(sidecar: Sidecar, tmp_path: Path) -> None:
    """`security.*` is the trainer's and the sidecar's `SecurityConfig`: same keys, same checks,
    and each wrong one named under the plugin's key."""
    key = "actor_rollout_ref.rollout.engine_kwargs.specrl.security"
    with pytest.raises(SpecrlConfigError, match=rf"unknown key\(s\) \['ca'\] in {key}"):
        options(sidecar, security={"ca": "ca.pem"})
    with pytest.raises(SpecrlConfigError, match=f"{key}: cert and key go together"):
        options(sidecar, security={"cert": "client.pem"})
    with pytest.raises(SpecrlConfigError, match=f"{key}.token_file: .* is not a readable file"):
        options(sidecar, security={"token_file": str(tmp_path / "absent")}).client_config()
    (tmp_path / "token").write_text("s3cret\n")
    config = options(sidecar, security={"token_file": str(tmp_path / "token"), "tls": True}).client_config()
    assert config.token == "s3cret" and config.security.client_uses_tls and "s3cret" not in repr(config)


def test_an_unreachable_sidecar_is_named(sidecar: Sidecar) -> None:
    opts = SpecrlRolloutOptions.from_mapping({"sidecars": ["127.0.0.1:1"], "connect_timeout_s": 2.0})
    with pytest.raises(SpecrlConfigError, match="cannot reach the specrl sidecar at 127.0.0.1:1"):
        attach("127.0.0.1:1", opts, None)


def test_another_model_is_refused(sidecar: Sidecar, checkpoint: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        SpecrlConfigError, match="serves .* but verl trains .*start the sidecar with the model verl trains"
    ):
        attach(sidecar.address, options(sidecar), other)


def test_a_draft_that_does_not_match_the_served_one_is_refused(
    sidecar: Sidecar, checkpoint: Path, tmp_path: Path
) -> None:
    no_draft = make_checkpoint(tmp_path / "nodraft")  # the same trunk; its config has no MTP layer
    config = json.loads((no_draft / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (no_draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecrlConfigError, match=r"draft_checkpoint .* do not match .* \(0 tensors against [1-9]"):
        attach(sidecar.address, options(sidecar, draft_checkpoint=str(no_draft)), checkpoint)
    with pytest.raises(SpecrlConfigError, match="cannot be read"):
        attach(sidecar.address, options(sidecar, draft_checkpoint=str(tmp_path / "missing")), checkpoint)
