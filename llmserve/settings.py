"""Settings declared once.

Each service has one frozen dataclass of settings (nested dataclasses for groups that
several services share). Every field declared with `setting(...)` is at once:

    a flag            --kv-cache-memory 2GiB          (--help shows its default)
    an env variable   LLMSERVE_KV_CACHE_MEMORY=2GiB
    a config-file key kv-cache-memory: 2GiB           (YAML or TOML, `--config FILE`)

and the service receives the dataclass, never an argparse namespace. Precedence:
command line > environment > config file > the declared default. A nested dataclass
field is a group: its settings are flags of the outer command, without a prefix.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

ENV_PREFIX = "LLMSERVE_"
_SIZE_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30}


class SettingsError(ValueError):
    """A value from the environment or a config file that does not parse."""


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, '1000' -> 1000."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 2GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def format_bytes(value: int) -> str:
    """2147483648 -> '2GiB', 1000 -> '1000B': what parse_bytes reads back."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value and value % size == 0:
            return f"{value // size}{unit}"
    return f"{value}B"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def setting(default: Any = dataclasses.MISSING, *, help: str, flag: str | None = None,
            parse: Callable[[str], Any] | None = None, choices: Iterable[Any] | None = None,
            show: Callable[[Any], str] = str, unset: str = "off") -> Any:
    """A dataclass field that is also a flag, an env variable and a config-file key.

    `flag`: the name users see (default: the field's name with dashes); `parse` turns a
    string into the value (default: from the annotation); `show` turns a value back
    into a string that `parse` reads (to pass a setting on to a child process); `unset`
    says what a None default means."""
    metadata = {"help": help, "flag": flag, "parse": parse, "choices": tuple(choices) if choices else None,
                "show": show, "unset": unset}
    return dataclasses.field(default=default, metadata={"setting": metadata})


def group(default_factory: Callable[[], Any], skip: Iterable[str] = ()) -> Any:
    """A nested settings dataclass: its settings become flags of the outer command, but
    for `skip` (flag names the outer command sets itself)."""
    return dataclasses.field(default_factory=default_factory, metadata={"skip": tuple(skip)})


@dataclasses.dataclass(frozen=True)
class Option:
    """One setting as users see it."""

    name: str  # Flag name without dashes: "kv-cache-memory".
    # Field names from the outer config down to the setting; several when groups of the
    # command declare a setting of the same name (`up`: --model feeds router and worker).
    paths: tuple[tuple[str, ...], ...]
    parse: Callable[[str], Any]
    default: Any
    help: str
    choices: tuple | None
    is_bool: bool
    show: Callable[[Any], str]
    unset: str  # What a None default means.

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.replace("-", "_").upper()

    @property
    def shown_default(self) -> str:
        if self.is_bool and self.default is not None:
            return "on" if self.default else "off"
        return self.unset if self.default is None else self.show(self.default)

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    def from_text(self, text: Any, where: str) -> Any:
        """A value from the environment or a file (a string, or YAML/TOML's own types)."""
        if self.is_bool:
            if isinstance(text, bool):
                return text
            if str(text).lower() in ("1", "true", "yes", "on"):
                return True
            if str(text).lower() in ("0", "false", "no", "off"):
                return False
            raise SettingsError(f"{where}: expected true or false, got {text!r}")
        if text is None:
            return None
        try:
            value = self.parse(str(text))
        except (TypeError, ValueError, argparse.ArgumentTypeError) as err:
            raise SettingsError(f"{where}: {err}") from err
        if self.choices is not None and value not in self.choices:
            raise SettingsError(f"{where}: {value!r} is not one of {', '.join(map(str, self.choices))}")
        return value


def _parser_for(annotation: Any) -> Callable[[str], Any]:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if annotation in (int, float, str, Path):
        return annotation
    raise TypeError(f"no parser for {annotation!r}: pass parse=")


def options(config_cls: type, skip: Iterable[str] = ()) -> list[Option]:
    """Every setting of a config class, nested groups flattened, minus `skip` (flag names).
    Settings of the same name in several groups become one option."""
    merged: dict[str, Option] = {}
    for opt in _walk(config_cls, _default_instance(config_cls), set(skip)):
        first = merged.get(opt.name)
        if first is None:
            merged[opt.name] = opt
        elif first.default != opt.default:
            raise TypeError(f"{config_cls.__name__}: --{opt.name} has two defaults, {first.default!r}"
                            f" and {opt.default!r}")
        else:
            merged[opt.name] = dataclasses.replace(first, paths=first.paths + opt.paths)
    return list(merged.values())


def _default_instance(config_cls: type) -> Any:
    try:
        return config_cls()
    except TypeError:  # A field without default: no instance, declared defaults only.
        return None


def _walk(cls: type, defaults: Any, skip: set[str]) -> Iterable[Option]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = getattr(defaults, f.name) if defaults is not None else f.default
        meta = f.metadata.get("setting")
        if meta is None:
            if dataclasses.is_dataclass(hints[f.name]):
                inner_skip = skip | set(f.metadata.get("skip", ()))
                for inner in _walk(hints[f.name], default, inner_skip):
                    yield dataclasses.replace(inner, paths=tuple((f.name, *p) for p in inner.paths))
            continue
        name = meta["flag"] or f.name.replace("_", "-")
        if name in skip:
            continue
        # `bool | None`: an on/off flag whose None default is decided later (its `unset` says how).
        is_bool = hints[f.name] in (bool, bool | None)
        yield Option(name=name, paths=((f.name,),), default=default, help=meta["help"], choices=meta["choices"],
                     parse=meta["parse"] or (bool if is_bool else _parser_for(hints[f.name])),
                     is_bool=is_bool, show=meta["show"], unset=meta["unset"])


def _get(obj: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        obj = getattr(obj, name)
    return obj


def add_flags(parser: argparse.ArgumentParser, config_cls: type, skip: Iterable[str] = ()) -> None:
    """One flag per setting, with its default and env variable in --help. Unset flags stay
    absent from the parsed namespace, so the environment and files can fill them."""
    for opt in options(config_cls, skip):
        # argparse %-formats help texts: a literal % must be doubled.
        text = f"{opt.help} (default: {opt.shown_default}; env {opt.env})".replace("%", "%%")
        if opt.is_bool:
            parser.add_argument(f"--{opt.name}", dest=opt.dest, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=text)
        else:
            parser.add_argument(f"--{opt.name}", dest=opt.dest, type=opt.parse, choices=opt.choices,
                                default=argparse.SUPPRESS, help=text, metavar=None if opt.choices else opt.dest.upper())


def load_file(path: Path) -> dict[str, Any]:
    """A YAML or TOML mapping of setting names (dashes or underscores) to values."""
    text = Path(path).read_text(encoding="utf-8")
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    elif path.suffix == ".toml":
        import tomllib

        data = tomllib.loads(text)
    else:
        raise SettingsError(f"{path}: use a .yaml, .yml or .toml file")
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: the top level must be a mapping of setting names to values")
    return {str(key).replace("_", "-"): value for key, value in data.items()}


def resolve(config_cls: type, given: Mapping[str, Any] | argparse.Namespace = (),
            environ: Mapping[str, str] | None = None, file: Path | None = None, skip: Iterable[str] = ()) -> Any:
    """The config from the command line (`given`, by dest), the environment, a file and
    the declared defaults, in that order of precedence."""
    given = vars(given) if isinstance(given, argparse.Namespace) else dict(given)
    environ = os.environ if environ is None else environ
    opts = options(config_cls, skip)
    from_file = load_file(file) if file is not None else {}
    known = {o.name for o in opts} | {f"no-{o.name}" for o in opts if o.is_bool}
    unknown = sorted(set(from_file) - known)
    if unknown:
        raise SettingsError(f"{file}: unknown settings {unknown} (known: {', '.join(sorted(o.name for o in opts))})")
    values: dict[tuple[str, ...], Any] = {}
    for opt in opts:
        negated_env = ENV_PREFIX + "NO_" + opt.env[len(ENV_PREFIX):]
        if opt.dest in given:
            value = given[opt.dest]
        elif opt.env in environ:
            value = opt.from_text(environ[opt.env], opt.env)
        elif opt.is_bool and negated_env in environ:  # LLMSERVE_NO_X=1, as the flag --no-x
            value = not opt.from_text(environ[negated_env], negated_env)
        elif opt.name in from_file:
            value = opt.from_text(from_file[opt.name], f"{file}: {opt.name}")
        elif opt.is_bool and f"no-{opt.name}" in from_file:
            value = not opt.from_text(from_file[f"no-{opt.name}"], f"{file}: no-{opt.name}")
        else:
            continue
        values.update(dict.fromkeys(opt.paths, value))
    return _build(config_cls, values)


def _build(cls: type, values: dict[tuple[str, ...], Any], default: Any = None) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if (f.name,) in values:
            kwargs[f.name] = values[(f.name,)]
            continue
        inner = {path[1:]: v for path, v in values.items() if path[0] == f.name and len(path) > 1}
        if inner:
            base = getattr(default, f.name) if default is not None else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            kwargs[f.name] = _build(hints[f.name], inner, base)
        elif default is not None:
            kwargs[f.name] = getattr(default, f.name)
    return cls(**kwargs)


def to_argv(config: Any, skip: Iterable[str] = (), always: Iterable[str] = ()) -> list[str]:
    """Flags that give a child process the same settings: those not at their default, and
    those named in `always` even at their default (a value the parent assigns must not be
    changed by an LLMSERVE_* variable in the child's environment). None is never a flag."""
    argv = []
    always = set(always)
    for opt in options(type(config), skip):
        value = _get(config, opt.paths[0])
        if value is None or (value == opt.default and opt.name not in always):
            continue
        if opt.is_bool:
            argv.append(f"--{opt.name}" if value else f"--no-{opt.name}")
        else:
            argv += [f"--{opt.name}", opt.show(value)]
    return argv


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand of `llmserve`, registered by its distribution under the entry-point
    group `llmserve.commands`: its settings class and what runs it."""

    name: str
    help: str
    config: type | None  # None: `add_arguments` declares the flags (commands with subcommands).
    run: Callable[[Any], int]  # Takes the resolved config (or the namespace); imports lazily.
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    # True: the command logs its own readable start-up summary, and `llmserve` logs the
    # whole resolved config only at DEBUG (else at INFO, as `config: ...`).
    logs_config: bool = False
