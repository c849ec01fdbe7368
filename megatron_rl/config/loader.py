"""YAML + dotted ``key=value`` overrides -> the :class:`Config` tree (each section checks its
own fields; :func:`megatron_rl.from_config.checks.validate` checks the run as a whole).

Everything here is cheap (no torch, no Megatron import) so that a bad key fails in well
under two seconds, before any process group exists.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import yaml

from megatron_rl.config.schema import Config, ConfigError
from megatron_rl.parallel.config import LayoutError, ParallelConfig


def _fields(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _section(tp: Any) -> Optional[type]:
    """The dataclass a field holds (also inside Optional[...]), or None for a plain value."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        return _section(options[0]) if len(options) == 1 else None
    return tp if dataclasses.is_dataclass(tp) else None


def _entries(tp: Any) -> Optional[type]:
    """The dataclass of a ``dict[str, <dataclass>]`` field (named entries, e.g. eval sets), or None."""
    if typing.get_origin(tp) is not dict:
        return None
    value_type = typing.get_args(tp)[1]
    return value_type if dataclasses.is_dataclass(value_type) else None


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML/CLI value to the field's type, or raise naming the key."""
    origin = typing.get_origin(tp)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} must be a list, e.g. [1, 4]")
        (item,) = typing.get_args(tp)
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if origin in (Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(key, value, options[0])
    if origin is tuple:  # tuple[X, ...]: a YAML list, or one comma-separated string on the command line
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} must be a list")
        (item,) = {a for a in typing.get_args(tp) if a is not Ellipsis}
        return tuple(_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value))
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.lower() in ("true", "1", "yes")
            raise ValueError
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is str:
            if not isinstance(value, (str, int, float)):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r} is not a valid {getattr(tp, '__name__', tp)}") from None
    return value


def _build(cls, data: dict, prefix: str):
    fields = _fields(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"unknown config key '{where}{unknown[0]}'; allowed in {prefix or 'the top level'}: {sorted(fields)}"
        )
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = fields[name]
        section = _section(tp)
        if section is not None:
            optional = section is not tp
            if optional and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
                kwargs[name] = None
                continue
            if not isinstance(value, dict):
                allowed = "a mapping of its keys" + (" or null" if optional else "")
                raise ConfigError(f"{key} must be {allowed}, got {value!r}")
            try:
                kwargs[name] = _build(section, value, key)
            except (ConfigError, LayoutError):
                raise
            except ValueError as err:  # a section of another package (the sandbox's) names its field alone
                raise ConfigError(f"{key}.{err}") from None
        elif _entries(tp) is not None:
            kwargs[name] = _build_entries(_entries(tp), value, key)
        else:
            kwargs[name] = _coerce(key, value, tp)
    return cls(**kwargs)


def _build_entries(cls, data: Any, key: str) -> dict:
    """Named entries of one dataclass each; an entry's own errors get its key in front."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{key} must be a mapping of names to {{...}}, got {data!r}")
    entries = {}
    for name, value in data.items():
        if value is None:
            value = {}  # a name alone takes every default
        if not isinstance(value, dict):
            raise ConfigError(f"{key}.{name} must be a mapping of its keys, got {value!r}")
        where = f"{key}.{name}"
        try:
            entries[str(name)] = _build(cls, value, where)
        except ConfigError as err:  # the entry's own checks name the field alone
            message = str(err)
            raise ConfigError(message if where in message else f"{where}.{message}") from None
    return entries


def _set_dotted(tree: dict, dotted: str, value: str) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError as err:  # e.g. a flow mapping the shell split at a space
        reason = " ".join(str(err).split())
        raise ConfigError(f"override {dotted}={value!r} is not valid YAML (quote it whole): {reason}") from None


def load_config(path: Optional[str | Path] = None, overrides: Iterable[str] = ()) -> Config:
    """Read YAML (optional), apply ``key=value`` overrides, build and validate the tree."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. trainer.max_steps=3)")
        key, value = item.split("=", 1)
        _set_dotted(data, key.strip(), value)
    try:
        return _build(Config, data, "")
    except LayoutError as err:
        raise ConfigError(f"parallel: {err}") from None
    except (TypeError, ValueError) as err:  # a dataclass rejected its arguments or values
        raise ConfigError(str(err)) from None


def to_dict(config: Config) -> dict:
    """The config tree of plain mappings, lists and scalars (tuples become lists, as YAML has them)."""
    return dataclasses.asdict(config, dict_factory=lambda items: {k: _plain(v) for k, v in items})


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, (tuple, list)) else value


def dump_yaml(config: Config) -> str:
    """The resolved config, as YAML that load_config reads back to an equal tree."""
    return yaml.safe_dump(to_dict(config), sort_keys=False)


__all__ = ["Config", "ConfigError", "ParallelConfig", "dump_yaml", "load_config", "to_dict"]
