"""A config file for `llmserve up --config cluster.yaml` (YAML or TOML).

Keys are the flags of `llmserve up`, with dashes or underscores (`kv-cache-memory: 2GiB`,
`no_prefix_caching: true`). Precedence: command line > LLMSERVE_<FLAG> environment
variable > config file > built-in default.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    pass


def load_mapping(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    elif path.suffix == ".toml":
        import tomllib

        data = tomllib.loads(text)
    else:
        raise ConfigError(f"{path}: use a .yaml, .yml or .toml file")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of flag names to values")
    return data


def _convert(action: argparse.Action, value: Any, key: str) -> Any:
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        return [str(v) for v in (value if isinstance(value, list) else [value])]
    if value is None:
        return None
    if action.type is not None:
        try:
            value = action.type(value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as err:
            raise ConfigError(f"{key}: {err}") from err
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{key}: {value!r} is not one of {sorted(action.choices)}")
    return value


def apply_config_file(subparser: argparse.ArgumentParser, path: Path) -> list[str]:
    """Makes the file's values the defaults of `subparser`'s flags, unless an environment
    variable already sets that flag. Returns the keys applied."""
    by_dest = {a.dest: a for a in subparser._actions if a.option_strings and a.dest not in ("help", "config")}
    applied = []
    for key, value in load_mapping(path).items():
        dest = str(key).replace("-", "_")
        action = by_dest.get(dest)
        if action is None:
            known = ", ".join(sorted(d.replace("_", "-") for d in by_dest))
            raise ConfigError(f"{path}: unknown option {key!r} (known: {known})")
        if f"LLMSERVE_{dest.upper()}" in os.environ:
            continue
        action.default = _convert(action, value, f"{path}: {key}")
        applied.append(dest)
    return applied
