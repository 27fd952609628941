"""MkDocs hook: the settings and API reference pages, generated at every build.

- `reference/settings.md` from the config dataclasses: every command registered under the
  entry-point group `llmserve.commands` (whichever distribution registers it), each
  setting as `llmserve.settings.options()` sees it (flag, environment variable, config
  file key, default, help).
- `reference/api.md` from the comments of the .proto files under `protos/`, compiled
  with grpcio-tools' protoc (`--include_source_info`) into a descriptor set.
- `reference/models.md` from the worker's model catalog (models/catalog.py).

Nothing here is written to docs/: the pages exist only in the build.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tempfile
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
COMMAND_GROUP = "llmserve.commands"


def on_files(files, config):
    files.append(File.generated(config, "reference/settings.md", content=settings_page()))
    files.append(File.generated(config, "reference/api.md", content=api_page()))
    files.append(File.generated(config, "reference/models.md", content=models_page()))
    return files


# --- supported models ----------------------------------------------------------------


def models_page() -> str:
    from llmserve.worker.models.catalog import FAMILIES

    yes = lambda flag: "yes" if flag else "no"  # noqa: E731
    lines = [
        "# Supported models",
        "",
        "Generated at build time from the worker's model catalog",
        "(`services/worker/llmserve/worker/models/catalog.py`), which a test keeps equal to the",
        "architectures the worker registers. A model loads when config.json's `architectures`",
        "names one of these; any size of the family works (the examples are shapes we test",
        "against transformers with tiny random weights of the same configuration). See",
        "[Models](../guide/models.md) for loading checkpoints and GGUF files.",
        "",
        "| family | architectures | examples | what it adds | TP | PP | quantization | GGUF |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in FAMILIES:
        lines.append("| " + " | ".join(_cell(c) for c in (
            f.name, ", ".join(f"`{a}`" for a in f.architectures), ", ".join(f.examples), f.features,
            yes(f.tensor_parallel), yes(f.pipeline_parallel), f.quantization, yes(f.gguf))) + " |")
    return "\n".join(lines) + "\n"


# --- settings -----------------------------------------------------------------------


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def settings_page() -> str:
    from llmserve.settings import options

    points = sorted(importlib.metadata.entry_points(group=COMMAND_GROUP), key=lambda p: p.name)
    if not points:
        raise RuntimeError(f"no `{COMMAND_GROUP}` entry points: is llmserve installed in this environment?")
    lines = [
        "# Settings reference",
        "",
        "Generated at build time from the settings each command declares (its config",
        "dataclass, found through the `llmserve.commands` entry points). Every setting is a",
        "flag, an environment variable and a `--config FILE` key (YAML or TOML) at once;",
        "precedence: command line > environment > config file > default. Boolean settings",
        "take `--x` / `--no-x` (and `LLMSERVE_X=false`, `LLMSERVE_NO_X=1`, `no-x: true`).",
        "`llmserve COMMAND --help` prints the same list. See [Configuration](../guide/configuration.md).",
        "",
    ]
    without = []
    for point in points:
        command = point.load()  # An import error fails the build: the reference must be whole.
        if command.config is None:
            without.append(command)
            continue
        lines += [f"## `llmserve {command.name}` {{#llmserve-{command.name}}}", "", _cell(command.help), "",
                  "| flag | environment | config key | default | meaning |", "|---|---|---|---|---|"]
        for opt in options(command.config):
            flag = f"`--{opt.name}` / `--no-{opt.name}`" if opt.is_bool else f"`--{opt.name}`"
            choices = f" (one of: {', '.join(f'`{c}`' for c in opt.choices)})" if opt.choices else ""
            lines.append(f"| {flag} | `{opt.env}` | `{opt.name}` | {_cell(opt.shown_default)} "
                         f"| {_cell(opt.help)}{choices} |")
        lines.append("")
    if without:
        lines += ["## Commands with their own flags", "",
                  "These commands declare their flags themselves (subcommands): `llmserve NAME --help`.", ""]
        lines += [f"- `llmserve {c.name}`: {_cell(c.help)}" for c in without]
        lines.append("")
    return "\n".join(lines)


# --- API ----------------------------------------------------------------------------

# FileDescriptorProto / DescriptorProto / ... field numbers, as SourceCodeInfo paths use them.
MESSAGE, ENUM, SERVICE, SYNTAX = 4, 5, 6, 12
M_FIELD, M_NESTED, M_ENUM = 2, 3, 4
E_VALUE, S_METHOD = 2, 2


def _descriptor_set():
    from google.protobuf import descriptor_pb2

    sources = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.glob("llmserve/**/*.proto"))
    if not sources:
        raise RuntimeError(f"no .proto files under {PROTOS}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "api.binpb"
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"--proto_path={PROTOS}", "--include_source_info",
                        f"--descriptor_set_out={out}", *sources], check=True)
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _comment(comments: dict, path: tuple) -> str:
    location = comments.get(path)
    if location is None:
        return ""
    text = location.leading_comments or location.trailing_comments
    return "\n".join(line[1:] if line.startswith(" ") else line for line in text.strip("\n").split("\n")).strip()


MAP_ENTRIES: dict = {}  # ".pkg.Message.FieldEntry" -> its DescriptorProto, for map<K, V> fields


def _type_name(field) -> str:
    from google.protobuf import descriptor_pb2 as d

    entry = MAP_ENTRIES.get(field.type_name)
    if entry is not None:
        key, value = (_plain_type(f) for f in entry.field)
        return f"`map<{key}, {value}>`"
    name = field.type_name.lstrip(".") if field.type_name else \
        d.FieldDescriptorProto.Type.Name(field.type).removeprefix("TYPE_").lower()
    if field.type_name:
        name = f"[`{name}`](#{_anchor(name)})"
    else:
        name = f"`{name}`"
    return ("repeated " if field.label == d.FieldDescriptorProto.LABEL_REPEATED else "") + name


def _plain_type(field) -> str:
    from google.protobuf import descriptor_pb2 as d

    return field.type_name.lstrip(".") or d.FieldDescriptorProto.Type.Name(field.type).removeprefix("TYPE_").lower()


def _anchor(full_name: str) -> str:
    return full_name.lower().replace(".", "")


def _message(lines, comments, message, path, prefix):
    full = f"{prefix}.{message.name}"
    lines += [f"### `{full}` {{#{_anchor(full)}}}", "", _comment(comments, path), ""]
    if message.field:
        lines += ["| field | number | type | meaning |", "|---|---|---|---|"]
        for i, field in enumerate(message.field):
            meaning = _cell(_comment(comments, (*path, M_FIELD, i)))
            if field.HasField("oneof_index") and not field.proto3_optional:
                meaning = f"(oneof `{message.oneof_decl[field.oneof_index].name}`) {meaning}"
            elif field.proto3_optional:
                meaning = f"(optional) {meaning}"
            lines.append(f"| `{field.name}` | {field.number} | {_type_name(field)} | {meaning} |")
        lines.append("")
    else:
        lines += ["No fields.", ""]
    if message.reserved_range:
        numbers = ", ".join(str(r.start) if r.end - r.start == 1 else f"{r.start}-{r.end - 1}"
                            for r in message.reserved_range)
        lines += [f"Reserved field numbers: {numbers}.", ""]
    for k, enum in enumerate(message.enum_type):
        _enum(lines, comments, enum, (*path, M_ENUM, k), full)
    for k, nested in enumerate(message.nested_type):
        if not nested.options.map_entry:
            _message(lines, comments, nested, (*path, M_NESTED, k), full)


def _enum(lines, comments, enum, path, prefix):
    full = f"{prefix}.{enum.name}"
    lines += [f"### `{full}` {{#{_anchor(full)}}}", "", _comment(comments, path), "",
              "| value | number | meaning |", "|---|---|---|"]
    for i, value in enumerate(enum.value):
        lines.append(f"| `{value.name}` | {value.number} | {_cell(_comment(comments, (*path, E_VALUE, i)))} |")
    lines.append("")


def api_page() -> str:
    files = _descriptor_set().file
    MAP_ENTRIES.clear()

    def collect(prefix, messages):
        for message in messages:
            full = f"{prefix}.{message.name}"
            if message.options.map_entry:
                MAP_ENTRIES[full] = message
            collect(full, message.nested_type)

    for proto in files:
        collect(f".{proto.package}", proto.message_type)
    lines = [
        "# API reference",
        "",
        "Generated at build time from the `.proto` files under `protos/` and their comments",
        "(compiled with grpcio-tools' protoc, `--include_source_info`). `llmserve.v1` is the",
        "public API the router serves; `llmserve.internal.v1` is what the services say to",
        "each other (router → scheduler → worker). How to call it: [gRPC API and",
        "clients](../guide/grpc.md).",
        "",
    ]
    public = sorted((f for f in files if ".internal." not in f.package), key=lambda f: f.name)
    internal = sorted((f for f in files if ".internal." in f.package), key=lambda f: f.name)
    for proto in public + internal:
        comments = {tuple(loc.path): loc for loc in proto.source_code_info.location}
        lines += [f"## `{proto.name}` (package `{proto.package}`)", ""]
        header = _comment(comments, (SYNTAX,))
        if header:
            lines += ["```text", header, "```", ""]
        for s, service in enumerate(proto.service):
            full = f"{proto.package}.{service.name}"
            lines += [f"### service `{full}` {{#{_anchor(full)}}}", "", _comment(comments, (SERVICE, s)), "",
                      "| method | request | response | what it does |", "|---|---|---|---|"]
            for m, method in enumerate(service.method):
                request = ("stream " if method.client_streaming else "") + \
                    f"[`{method.input_type.lstrip('.')}`](#{_anchor(method.input_type.lstrip('.'))})"
                response = ("stream " if method.server_streaming else "") + \
                    f"[`{method.output_type.lstrip('.')}`](#{_anchor(method.output_type.lstrip('.'))})"
                what = _cell(_comment(comments, (SERVICE, s, S_METHOD, m)))
                lines.append(f"| `{method.name}` | {request} | {response} | {what} |")
            lines.append("")
        for e, enum in enumerate(proto.enum_type):
            _enum(lines, comments, enum, (ENUM, e), proto.package)
        for i, message in enumerate(proto.message_type):
            _message(lines, comments, message, (MESSAGE, i), proto.package)
    return "\n".join(lines)
