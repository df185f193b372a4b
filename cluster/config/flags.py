"""Command-line flags generated from ServeConfig's fields (one flag per key).

Every key `section.name` becomes `--name-with-hyphens` in an argparse group named after
the section; booleans get `--x/--no-x`; optional values accept `none`. Flags default to
"not given" (argparse.SUPPRESS), so `config_from_args` can overlay exactly the flags the
user typed on top of the `--config` YAML file. Choices and their help are read from the
registries when the parser is built, so a part registered before that is a valid flag value.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from dataclasses import Field, fields
from typing import Any

from cluster.config.fields import choices_of, describe_choices, field_default, field_type
from cluster.config.serve import SECTIONS, ServeConfig

# Extra spellings; the canonical flag is always the hyphenated key.
ALIASES = {"model.path": ("--model",)}


def iter_keys() -> Iterator[tuple[str, Field]]:
    """('section.key', field) for every config key, in YAML order."""
    for name, cls in SECTIONS.items():
        for f in fields(cls):
            yield f"{name}.{f.name}", f


def _section(dotted: str) -> type:
    return SECTIONS[dotted.partition(".")[0]]


def flag_name(dotted: str) -> str:
    return "--" + dotted.partition(".")[2].replace("_", "-")


def _optional(convert):
    def parse(text: str):
        return None if text.strip().lower() in ("none", "null", "") else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def _weights(text: str) -> dict[str, float]:
    """'gold=4,free=1' -> {'gold': 4.0, 'free': 1.0}."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected NAME=WEIGHT, got {item!r}")
        out[name.strip()] = float(value)
    return out


def _describe(dotted: str, f: Field) -> str:
    default = field_default(f)
    shown = "none" if default is None else (
        ",".join(f"{k}={v}" for k, v in default.items()) or "{}"
        if isinstance(default, dict) else default)
    choices = describe_choices(f)
    text = f"{f.metadata['help']}: {choices}" if choices else f.metadata["help"]
    return f"{text} [{dotted}; default: {shown}]".replace("%", "%%")


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """Add --config and one flag per ServeConfig key, grouped by section."""
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="YAML file of {section: {key: value}}; flags override it")
    groups: dict[str, Any] = {}
    for dotted, f in iter_keys():
        section = dotted.partition(".")[0]
        if section not in groups:
            groups[section] = parser.add_argument_group(f"{section} (YAML section '{section}')")
        kind = field_type(_section(dotted), f)
        names = (flag_name(dotted), *ALIASES.get(dotted, ()))
        kw: dict[str, Any] = {"dest": dotted, "default": argparse.SUPPRESS,
                              "help": _describe(dotted, f)}
        if kind.base is bool:
            groups[section].add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
            continue
        convert = _weights if kind.base is Mapping else kind.base
        kw["type"] = _optional(convert) if kind.optional else convert
        choices = choices_of(f)
        if choices:
            kw["choices"] = choices
        kw["metavar"] = None if choices else f.name.upper()
        groups[section].add_argument(*names, **kw)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """{'section.key': value} for the config flags present on the command line."""
    given = vars(args)
    return {dotted: given[dotted] for dotted, _ in iter_keys() if dotted in given}


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """`--config` file (if any), then the flags given; ValueError names a bad key."""
    path = getattr(args, "config", None)
    base = ServeConfig.from_yaml(path) if path else ServeConfig()
    overrides = overrides_from_args(args)
    return base.with_values(overrides) if overrides else base


def keys_epilog() -> str:
    """A help paragraph naming every key (for `pdserve --help`)."""
    lines = ["configuration keys (YAML 'section.key'; each is also a `serve` flag):"]
    for name, cls in SECTIONS.items():
        keys = ", ".join(f.name for f in fields(cls))
        lines.append(f"  {name}: {keys}")
    return "\n".join(lines)
