"""Config dataclasses and the command line generated from them.

Every field carries its help text (unit and meaning) in ``metadata``; :func:`parse_config` turns
the fields into ``--kebab-case`` flags, so the dataclass is the single source of truth for
defaults, the ``--help`` table, ``config.json`` and the config stored in checkpoints.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any, Sequence, TypeVar

T = TypeVar("T")


class UsageError(Exception):
    """Bad input found before training starts: reported as one line, exit code 2."""


def opt(default: Any, help: str, choices: Sequence[Any] | None = None) -> Any:
    """A config field with its help text (and optional allowed values)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


class _OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _unwrap_optional(kind: Any) -> Any:
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if len(args) == 1 and type(None) in typing.get_args(kind) else kind


def build_parser(cls: type, description: str = "") -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(description=description,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        kind = _unwrap_optional(hints[f.name])  # `float | None`: None = "decided later" (a preset)
        meta = f.metadata
        if kind is bool:
            parser.add_argument(flag, dest=f.name, default=f.default, help=meta["help"],
                                action=argparse.BooleanOptionalAction)
            continue
        if kind not in (int, float, str):
            raise TypeError(f"config field {f.name} has unsupported type {kind}")
        parser.add_argument(flag, dest=f.name, type=kind, default=f.default, help=meta["help"],
                            choices=meta.get("choices"),
                            metavar=None if meta.get("choices") else f.name.upper())
    return parser


def parse_config(cls: type[T], argv: Sequence[str] | None = None, description: str = "") -> T:
    """Parse the command line into ``cls``; argparse errors exit 2 with one line."""
    args = build_parser(cls, description).parse_args(argv)
    return cls(**vars(args))


def usage_error_exit(prog: str, err: UsageError) -> int:
    """Report bad input as one line on stderr; 2 is the conventional exit code for usage errors."""
    print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
    return 2


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
