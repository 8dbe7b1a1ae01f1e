"""Config dataclasses and the command line generated from them.

Every field carries its help text (unit and meaning) in ``metadata``; :func:`parse_config` turns
the fields into ``--kebab-case`` flags, so the dataclass is the single source of truth for
defaults, the ``--help`` table, ``config.json`` and the config stored in checkpoints.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any, Sequence, TypeVar

T = TypeVar("T")


class UsageError(Exception):
    """Bad input: reported as one line (by rank 0 only), exit code 2, before any work is done."""


def opt(default: Any, help: str, choices: Sequence[Any] | None = None) -> Any:
    """A config field with its help text (and optional allowed values)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def finite_float(text: str) -> float:
    """argparse type for every float flag: nan and inf are refused at parse time."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


class _OneLineErrorParser(argparse.ArgumentParser):
    def __init__(self, *args, quiet: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.quiet = quiet  # other ranks of a multi-process launch: exit 2 without a word

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, None if self.quiet else f"{self.prog}: error: {message} (see --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)", except for preset-controlled flags (default None), whose help says
    "(preset: ...)" instead."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


def _unwrap_optional(kind: Any) -> Any:
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if len(args) == 1 and type(None) in typing.get_args(kind) else kind


def ordered_fields(cls: type) -> list[dataclasses.Field]:
    """The config's fields, those named in ``cls.FIRST_FLAGS`` first (e.g. a preset before the
    flags it sets), the rest in declaration order."""
    first = getattr(cls, "FIRST_FLAGS", ())
    fields = dataclasses.fields(cls)
    return [f for name in first for f in fields if f.name == name] + [f for f in fields if f.name not in first]


def build_parser(cls: type, description: str = "", quiet: bool = False) -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(description=description, formatter_class=_HelpFormatter, quiet=quiet)
    hints = typing.get_type_hints(cls)
    for f in ordered_fields(cls):
        flag = flag_name(f.name)
        kind = _unwrap_optional(hints[f.name])  # `float | None`: None = "set by the preset"
        meta = f.metadata
        if kind is bool:
            parser.add_argument(flag, dest=f.name, default=f.default, help=meta["help"],
                                action=argparse.BooleanOptionalAction)
            continue
        if kind not in (int, float, str):
            raise TypeError(f"config field {f.name} has unsupported type {kind}")
        parser.add_argument(flag, dest=f.name, type=finite_float if kind is float else kind,
                            default=f.default, help=meta["help"], choices=meta.get("choices"),
                            metavar=None if meta.get("choices") else f.name.upper())
    return parser


def parse_config(cls: type[T], argv: Sequence[str] | None = None, description: str = "",
                 quiet: bool = False) -> T:
    """Parse the command line into ``cls``; argparse errors exit 2 with one line (none if quiet)."""
    args = build_parser(cls, description, quiet).parse_args(argv)
    return cls(**vars(args))


def git_revision() -> str | None:
    """The checkout's commit, recorded with each run so results can be traced to code."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def config_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, out_dir: str | os.PathLike, extra: dict[str, Any] | None = None) -> Path:
    """Write the resolved config (plus run facts such as world size) to ``out_dir/config.json``."""
    path = Path(out_dir) / "config.json"
    payload = {"config": config_dict(cfg), "git_revision": git_revision(),
               "command": [Path(sys.argv[0]).name, *sys.argv[1:]], **(extra or {})}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def markdown_flag_table(cls: type) -> str:
    """The README's flag table for ``cls`` (tests/test_docs.py keeps the README equal to it)."""
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    hints = typing.get_type_hints(cls)
    for f in ordered_fields(cls):
        flag, meta = flag_name(f.name), f.metadata
        if _unwrap_optional(hints[f.name]) is bool:
            flag = f"{flag} / --no-{flag[2:]}"
        if f.default is None:
            default = "preset"
        elif isinstance(f.default, bool):
            default = "on" if f.default else "off"
        elif f.default == "":
            default = "empty"
        else:
            default = f"`{f.default}`"
        meaning = meta["help"].replace("%%", "%")
        choices = [str(c) for c in meta.get("choices") or ()]
        if choices and not all(c in meaning for c in choices):
            meaning += "; one of " + ", ".join(choices)
        rows.append(f"| `{flag}` | {default} | {meaning} |")
    return "\n".join(rows)
