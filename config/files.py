"""Loads a service's pydantic config from a YAML file plus command-line overrides.

    values = YAML file (optional)  <-  overrides {"engine.cache.block_size": 8, ...}
    model_cls.model_validate(values)   -> a frozen config, or one ConfigError line naming the field

Overrides whose value is None (a flag not given) are skipped, so a CLI can pass every flag.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config that does not load; the message is one line and names the field."""


def _set_dotted(values: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = values
    for key in parents:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: cannot override inside {key}, which is not a section")
        node = child
    node[leaf] = value


def format_validation_error(exc: ValidationError, source: str = "config") -> str:
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(root)"
        if err["type"] == "missing":
            parts.append(f"{field}: required, not given")
            continue
        got = repr(err.get("input"))
        msg = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:  # a rule across fields: its message names them; the input is all
            parts.append(msg)
            continue
        parts.append(f"{field}: {msg} (got {got if len(got) <= 60 else got[:57] + '...'})")
    return f"invalid {source}: " + "; ".join(parts)


def read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"config file {path} is not valid YAML: {' '.join(str(exc).split())}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping at the top, not {type(data).__name__}"
        )
    return data


def load_config(
    model_cls: type[M], path: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> M:
    values = read_yaml(path) if path else {}
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(values, dotted, value)
    try:
        return model_cls.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(
            format_validation_error(exc, f"config{f' ({path})' if path else ''}")
        ) from None
