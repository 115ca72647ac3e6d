"""Config files and overrides map onto typed dataclasses, and every mismatch names its key."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from sidecar.config_io import ConfigError, from_mapping, load_file, merge_overrides, to_mapping, write_yaml


@dataclass(kw_only=True, slots=True)
class Rollout:
    samples_per_prompt: int = 4
    temperature: float = 1.0
    speculation_k: int | None = 3

    def __post_init__(self) -> None:
        if self.samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {self.samples_per_prompt}")


@dataclass(kw_only=True, slots=True)
class Run:
    name: str = "run"
    out: Path = Path("runs")
    regime: Literal["zero", "think"] = "zero"
    sidecars: list[str] = field(default_factory=list)
    rollout: Rollout = field(default_factory=Rollout)


def test_yaml_and_toml_give_the_same_config(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(
        "name: x\nrollout:\n  temperature: 0\n  speculation_k: null\nsidecars: [h:1, h:2]\n"
    )
    (tmp_path / "a.toml").write_text('name = "x"\nsidecars = ["h:1", "h:2"]\n[rollout]\ntemperature = 0\n')
    a = from_mapping(Run, load_file(tmp_path / "a.yaml"))
    b = from_mapping(Run, merge_overrides(load_file(tmp_path / "a.toml"), ["rollout.speculation_k=null"]))
    assert a == b == Run(name="x", sidecars=["h:1", "h:2"], rollout=Rollout(temperature=0.0, speculation_k=None))


def test_overrides_parse_values_and_round_trip_through_the_resolved_file(tmp_path: Path) -> None:
    cfg = from_mapping(Run, merge_overrides({}, ["rollout.samples_per_prompt=8", "regime=think", "out=/tmp/r"]))
    assert cfg.rollout.samples_per_prompt == 8 and cfg.regime == "think" and cfg.out == Path("/tmp/r")
    write_yaml(cfg, tmp_path / "resolved.yaml")
    assert from_mapping(Run, load_file(tmp_path / "resolved.yaml")) == cfg
    assert to_mapping(cfg)["out"] == "/tmp/r"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"rollout": {"temprature": 1}}, r"unknown key\(s\) \['temprature'\] in rollout"),
        ({"rollout": {"samples_per_prompt": "4"}}, "rollout.samples_per_prompt must be an integer"),
        ({"rollout": {"samples_per_prompt": 0}}, "samples_per_prompt must be >= 1"),
        ({"regime": "hard"}, r"regime must be one of \['zero', 'think'\]"),
        ({"rollout": 3}, "rollout must be a mapping"),
        ({"sidecars": "h:1"}, "sidecars must be a list"),
    ],
)
def test_mismatches_name_the_key(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_mapping(Run, data)


def test_bad_files_and_overrides(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_file(tmp_path / "nope.yaml")
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"must end in \.yaml, \.yml or \.toml"):
        load_file(tmp_path / "c.json")
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_file(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="section.field=value"):
        merge_overrides({}, ["novalue"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        merge_overrides({"name": "x"}, ["name.sub=1"])
