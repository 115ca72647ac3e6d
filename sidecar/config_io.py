"""Reading run configurations: YAML or TOML files mapped onto typed config dataclasses.

A run is described by a root config dataclass (each component owns a small nested one, see
STYLE.md). Files and command-line overrides only *select and override* values: every key must
name an existing field, every value must fit the field's type, and the message of any
mismatch names the dotted key and what was expected. The resolved config is written back to
the run directory, so a run can be reproduced from it alone.

It lives in `sidecar` because both the trainer's run config and `specrl serve`'s `ServeConfig`
are read through it, and the sidecar package must not depend on the trainer.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 core-schema scalars, as users write them.

    PyYAML resolves plain scalars by YAML 1.1 rules: `3e-4` (no dot) stays a string, `1:30` is
    the base-60 integer 90, `010` is octal 8 and `on`/`no` are booleans. A config user writes
    `lr: 3e-4` and means a number; YAML 1.2 (and TOML, and JSON) agree with them.
    """


_YAML11_SCALARS = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _YAML11_SCALARS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)


def _yaml12_bool(loader: yaml.SafeLoader, node: yaml.Node) -> bool:
    return str(loader.construct_scalar(node)).lower() == "true"


def _yaml12_int(loader: yaml.SafeLoader, node: yaml.Node) -> int:
    text = str(loader.construct_scalar(node))
    if text.startswith(("0o", "0x")):
        return int(text, 0)
    return int(text, 10)


def _yaml12_float(loader: yaml.SafeLoader, node: yaml.Node) -> float:
    text = str(loader.construct_scalar(node)).lower()
    return float(text.replace(".inf", "inf").replace(".nan", "nan"))


_Yaml12Loader.add_constructor("tag:yaml.org,2002:bool", _yaml12_bool)
_Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _yaml12_int)
_Yaml12Loader.add_constructor("tag:yaml.org,2002:float", _yaml12_float)


def yaml_load(text: str) -> Any:
    """Parse YAML text with YAML 1.2 core-schema scalars (`3e-4` is a float, `on` a string)."""
    return yaml.load(text, Loader=_Yaml12Loader)


class ConfigError(ValueError):
    """A configuration file or override that does not fit the config dataclasses."""


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a `.yaml`/`.yml` or `.toml` file into a mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            data = yaml_load(text) or {}
        elif path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise ConfigError(f"config file {path} must end in .yaml, .yml or .toml")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot parse {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping at the top level, not {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """`"a.b.c=value"` -> (["a", "b", "c"], value parsed as YAML 1.2: numbers, bools, lists...)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} must look like section.field=value")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def merge_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted overrides on top of a mapping (returns a new mapping)."""
    out = json.loads(json.dumps(data, default=str)) if data else {}
    for text in overrides:
        keys, value = parse_override(text)
        node = out
        for k in keys[:-1]:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {k!r} is a value, not a section")
            node = child
        node[keys[-1]] = value
    return out


def from_mapping(cls: type[T], data: Mapping[str, Any], *, path: str = "") -> T:
    """Build dataclass `cls` from `data`, recursively; unknown keys and bad types are errors."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls} is not a dataclass")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path.rstrip('.') or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    _refuse_retired(cls, data, path)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = path.rstrip(".") or cls.__name__
        raise ConfigError(f"unknown key(s) {unknown} in {where}; known keys: {sorted(fields)}")
    kwargs = {
        name: _coerce(hints[name], _onto_default(fields[name], data[name]), f"{path}{name}")
        for name in fields
        if name in data
    }
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path.rstrip('.') or cls.__name__}: {e}") from None


def _refuse_retired(cls: type, data: Mapping[str, Any], path: str) -> None:
    """A key `cls.RETIRED_KEYS` says moved (old key -> new dotted key, relative to `cls`) is an
    error naming its new place, where it is absent from `cls` or holds a plain value where `cls`
    now has a section: a config written for the old layout must not silently change meaning."""
    retired: Mapping[str, str] = getattr(cls, "RETIRED_KEYS", {})
    names = {f.name for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key in retired and (key not in names or not isinstance(value, Mapping)):
            raise ConfigError(
                f"{path}{key} is now {path}{retired[key]}: write {path}{retired[key]}={value!r} "
                f"(in a file, under the {path}{retired[key].rsplit('.', 1)[0]} section)"
                if "." in retired[key]
                else f"{path}{key} is now {path}{retired[key]}"
            )


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass `cls`'s field `name`: where another config's field defaults to
    the same setting, it reads it from here instead of writing the value a second time."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    if f.default is dataclasses.MISSING:
        raise ValueError(f"{cls.__name__}.{name} has no default")
    return f.default


def retired_option(old: str, new: str) -> Callable[[F], F]:
    """A hidden click option `old` that refuses to run, naming `new`: a renamed flag in a user's
    script fails with its new name instead of changing meaning or vanishing into a generic error."""
    import click

    def refuse(ctx: click.Context, param: click.Parameter, value: object) -> None:
        if value is not None:
            raise click.UsageError(f"{old} is now {new}: use {new}", ctx=ctx)

    return click.option(old, hidden=True, expose_value=False, callback=refuse, help=f"renamed: {new}")


def _onto_default(f: dataclasses.Field[Any], value: Any) -> Any:
    """A partial section overrides the field's *default* section, not a bare one.

    `RLConfig.optimizer` defaults to lr=1e-5; `optimizer: {weight_decay: 0}` must keep that lr
    rather than fall back to the class's own default (3e-4): what the user did not write keeps
    the value `--print-config` showed them.
    """
    if not isinstance(value, Mapping) or f.default_factory is dataclasses.MISSING:
        return value
    default = f.default_factory()
    if not dataclasses.is_dataclass(default) or isinstance(default, type):
        return value
    try:
        bare = to_mapping(type(default)())
    except (TypeError, ValueError):  # a section class without a bare default
        return value
    ours = to_mapping(default)
    return _deep_merge(_differences(ours, bare), value)


def _differences(ours: dict[str, Any], bare: dict[str, Any]) -> dict[str, Any]:
    """The keys where the field's default section differs from its class's bare default."""
    out: dict[str, Any] = {}
    for key, value in ours.items():
        if isinstance(value, dict) and isinstance(bare.get(key), dict):
            if sub := _differences(value, bare[key]):
                out[key] = sub
        elif bare.get(key) != value:
            out[key] = value
    return out


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = (
            _deep_merge(out[key], value) if isinstance(out.get(key), dict) and isinstance(value, Mapping) else value
        )
    return out


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of `cls` (a string right after its annotation), on
    one line: the configuration reference's column and `specrl serve`'s option help."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def to_mapping(config: Any) -> Any:
    """A dataclass config as plain data (for writing the resolved config)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: to_mapping(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, enum.Enum):
        return config.value
    if isinstance(config, Path):
        return str(config)
    if isinstance(config, list | tuple):
        return [to_mapping(v) for v in config]
    if isinstance(config, dict):
        return {str(k): to_mapping(v) for k, v in config.items()}
    return config


def write_yaml(config: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_mapping(config), sort_keys=False))


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {value!r} fits none of {hint}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{key} must be one of {list(args)}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        return from_mapping(hint, value, path=f"{key}.")  # type: ignore[arg-type]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise ConfigError(f"{key} must be one of {[m.value for m in hint]}, got {value!r}") from None
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} must be a string, got {value!r}")
    if hint is Path:
        if isinstance(value, str | Path):
            return Path(value)
        raise ConfigError(f"{key} must be a path, got {value!r}")
    return value
