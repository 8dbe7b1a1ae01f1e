"""Config dataclasses and the command line generated from them.

Every field carries its help text (unit and meaning) in ``metadata``, with its bounds and where it
applies (``opt``); :func:`parse_config` turns the fields into ``--kebab-case`` flags, so the
dataclass is the single source of truth for defaults, the ``--help`` table, ``config.json``, the
config stored in checkpoints and the one-line errors of a value out of bounds or where it does
nothing.

Where a value comes from, lowest first: the field's default; the class's preset (``PRESETS``,
chosen by a ``preset`` field); the data set's own defaults (``DATASET_DEFAULTS``, chosen by the
``dataset`` field); those a flag given brings (``FLAG_DEFAULTS``: torchvision's ``--data-path``
brings its train.py's); ``--config FILE`` (JSON: a recipe, or a run's own ``config.json``); the
command line. ``--help`` shows the defaults that result.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")


class UsageError(Exception):
    """Bad input: reported as one line (by rank 0 only), exit code 2, before any work is done.
    ``said``: an earlier attempt of this job printed it already (a restarted attempt then exits 2
    without repeating it). ``exit_code``: 2, unless the one line reports a fault outside the input
    that a later attempt may not meet (an object store that did not answer: 75)."""

    def __init__(self, message: str, said: bool = False, exit_code: int = 2):
        super().__init__(message)
        self.said, self.exit_code = said, exit_code


# What a resume may do with a flag (``opt(on_resume=...)``):
#   "fixed"      it shapes the model: a checkpoint that differs cannot be resumed;
#   "experiment" another value makes another experiment: refused unless --allow-changes;
#   "free"       how long and how a run goes, not what it learns: changed without a word but a log line;
#   "invocation" this command's own choice (--out, --resume, ...): not compared at all.
ON_RESUME = ("fixed", "experiment", "free", "invocation")


@dataclasses.dataclass(frozen=True)
class AppliesTo:
    """Where a flag does something (``opt(applies_to=...)``): ``where``, in words (--help adds
    "applies to: WHERE"); ``holds(cfg)``, true where it does; ``refusal(flag, cfg)``, the one line
    that refuses a value other than the default where it does not (:func:`check_applies`)."""

    where: str
    holds: Callable[[Any], bool]
    refusal: Callable[[str, Any], str]


def opt(default: Any, help: str, choices: Sequence[Any] | None = None, *, group: str | None = None,
        on_resume: str = "experiment", from_file: bool = True, at_least: float | None = None,
        above: float | None = None, below: float | None = None, at_most: float | None = None,
        applies_to: AppliesTo | None = None, value_applies: dict[Any, AppliesTo] | None = None,
        spellings: tuple[str, ...] = (), bare: Any = None,
        switch: tuple[str, Any] | None = None, per_sample: bool = False,
        names_file: bool | Callable[[Any], bool] = False) -> Any:
    """A config field: its default, help text (unit and meaning) and allowed values; the --help
    section it is listed in (``group``; None: at the top, with --config); what a resume may do
    with it (``on_resume``, one of ON_RESUME); whether ``--config FILE`` may set it; the bounds of
    a number (``at_least``/``above`` below it, ``below``/``at_most`` above it), which
    :func:`check_bounds` enforces whatever set the value; where it does something
    (``applies_to``) and where each value that applies only somewhere does (``value_applies``:
    {value: AppliesTo}), which :func:`check_applies` enforces; ``spellings``: other flags that set
    it (another project's name for it, as ``--model`` for ``--arch``), also keys of a config file;
    ``bare``: the value of the flag given without one (torchvision's ``--amp``); ``switch``:
    (FLAG, VALUE), a flag without a value that sets the field to VALUE where it is still at its
    default (torchvision's ``--ra-sampler``: ``--ra-reps`` 3 unless given); ``per_sample``: given
    (not at its default), the flag asks for a step only the DataLoader workers run, per sample
    (:func:`per_sample_flags`); ``names_file``: a value given names a file or folder that must
    exist, or does where ``names_file(value)`` holds (:func:`named_files`)."""
    if on_resume not in ON_RESUME:
        raise ValueError(f"opt: on_resume must be one of {', '.join(ON_RESUME)}, got {on_resume!r}")
    if at_least is not None and above is not None or below is not None and at_most is not None:
        raise ValueError("opt: give at most one lower bound (at_least, above) and one upper (below, at_most)")
    bounds = {"at_least": at_least, "above": above, "below": below, "at_most": at_most}
    return dataclasses.field(default=default, metadata={
        "help": help, "choices": choices, "group": group, "on_resume": on_resume, "from_file": from_file,
        "bounds": {k: v for k, v in bounds.items() if v is not None}, "applies_to": applies_to,
        "value_applies": value_applies or {},
        "spellings": spellings, "bare": bare, "switch": switch, "per_sample": per_sample, "names_file": names_file})


def restated(cls: type, name: str, *spellings: str, applies_to: AppliesTo | None = None) -> Any:
    """``cls``'s field ``name`` again, for a subclass that gives a shared flag ``spellings`` of
    its own (``-b`` for ``--batch-size`` where it means what torchvision's does), or a rule of
    where it applies (``applies_to``: the classifier's ``--momentum``, which AdamW ignores)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    meta = {**f.metadata, "spellings": (*f.metadata.get("spellings", ()), *spellings)}
    if applies_to is not None:
        meta["applies_to"] = applies_to
    return dataclasses.field(default=f.default, metadata=meta)


def positional(help: str) -> Any:
    """A config field the command line gives by its place, not as a flag: a string, required, in
    the order the fields are declared (declare them first: they have no default)."""
    return dataclasses.field(metadata={"help": help, "choices": None, "group": None, "on_resume": "invocation",
                                       "from_file": False, "bounds": {}, "applies_to": None, "positional": True})


def bounds_text(bounds: dict[str, float]) -> str:
    """"positive", ">= 0", "in [0, 1)", ... for a field's ``opt`` bounds."""
    low = ("[", bounds["at_least"]) if "at_least" in bounds else ("(", bounds["above"]) if "above" in bounds else None
    high = (bounds["below"], ")") if "below" in bounds else (bounds["at_most"], "]") if "at_most" in bounds else None
    if low and high:
        return f"in {low[0]}{low[1]:g}, {high[0]:g}{high[1]}"
    if low:
        return "positive" if low == ("(", 0) else f"{'>=' if low[0] == '[' else '>'} {low[1]:g}"
    return f"{'<' if high[1] == ')' else '<='} {high[0]:g}"


def within_bounds(value: float, bounds: dict[str, float]) -> bool:
    return (value >= bounds.get("at_least", -math.inf) and value > bounds.get("above", -math.inf)
            and value < bounds.get("below", math.inf) and value <= bounds.get("at_most", math.inf))


def check_bounds(cfg: Any) -> None:
    """Raise UsageError for the first field of ``cfg`` outside its ``opt`` bounds:
    "--lr must be positive, got 0"."""
    for f in dataclasses.fields(cfg):
        bounds, value = f.metadata.get("bounds"), getattr(cfg, f.name)
        if bounds and not within_bounds(value, bounds):
            raise UsageError(f"{flag_name(f.name)} must be {bounds_text(bounds)}, got {value}")


def check_applies(cfg: Any) -> None:
    """Raise UsageError (the rule's refusal) for the first field of ``cfg`` given a value other
    than its default where it does nothing (``applies_to``), or a value where that value does not
    apply (``value_applies``)."""
    for f in dataclasses.fields(cfg):
        value, applies_to = getattr(cfg, f.name), f.metadata.get("applies_to")
        if applies_to is not None and value != f.default and not applies_to.holds(cfg):
            raise UsageError(applies_to.refusal(flag_name(f.name), cfg))
        rule = f.metadata.get("value_applies", {}).get(value)
        if rule is not None and not rule.holds(cfg):
            raise UsageError(rule.refusal(flag_name(f.name), cfg))


def per_sample_flags(cfg: Any) -> list[str]:
    """The flags given (not at their default) that ask for a step only the DataLoader workers run,
    per sample (``opt(per_sample=True)``)."""
    return [flag_name(f.name) for f in dataclasses.fields(cfg)
            if f.metadata.get("per_sample") and getattr(cfg, f.name) != f.default]


def named_files(cfg: Any) -> dict[str, str]:
    """{flag: path} of the files and folders ``cfg`` names that must exist (``opt(names_file=...)``)."""
    named = {}
    for f in dataclasses.fields(cfg):
        rule, value = f.metadata.get("names_file"), getattr(cfg, f.name)
        if rule and value and (rule is True or rule(value)):
            named[flag_name(f.name)] = value
    return named


def fields_on_resume(cls: type, *kinds: str) -> tuple[str, ...]:
    """The names of ``cls``'s fields whose ``on_resume`` is one of ``kinds``, in field order."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("on_resume", "experiment") in kinds)


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


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, "PROG: error: ... (see --help)", exit 2, with
    a "did you mean" for a mistyped flag."""

    def __init__(self, *args, quiet: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.quiet = quiet  # other ranks of a multi-process launch: exit 2 without a word

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, None if self.quiet else f"{self.prog}: error: {message}{self._suggestion(message)} "
                                             f"(see --help)\n")

    def _suggestion(self, message: str) -> str:
        """"; did you mean --epochs?" for the first unknown flag that resembles a real one."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
        for word in message.split(":", 1)[1].split():
            close = difflib.get_close_matches(word.split("=")[0], known, n=1) if word.startswith("--") else []
            if close:
                return f"; did you mean {close[0]}?"
        return ""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)", except where there is no default to show; the epilog (the script's
    launch examples) as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default == "":
            return action.help or ""
        return super()._get_help_string(action)


CONFIG_HELP = ("read flags from this JSON file first: a recipe (recipes/*.json) or a run's own config.json, "
               "which repeats that run; flags on the command line override it; --resume, --overwrite, "
               "--allow-changes, --check and --check-data are never taken from a file; keys starting with _ "
               "are notes")


def field_type(kind: Any) -> Any:
    """A field's type, ``X`` for ``X | None`` (None: a value set by the preset)."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if len(args) == 1 and type(None) in typing.get_args(kind) else kind


def ordered_fields(cls: type) -> list[dataclasses.Field]:
    """The config's fields, those in no --help section first (e.g. a preset, before the flags it
    sets), the rest in declaration order."""
    fields = dataclasses.fields(cls)
    return [f for f in fields if f.metadata.get("group") is None] + \
        [f for f in fields if f.metadata.get("group") is not None]


def flag_groups(cls: type) -> dict[str, list[str]]:
    """``--help``'s sections (title -> field names in declaration order), in the order of
    ``cls.SECTIONS``; a field in no section is listed at the top, with --config."""
    order = list(getattr(cls, "SECTIONS", ()))
    groups: dict[str, list[str]] = {title: [] for title in order}
    for f in dataclasses.fields(cls):
        title = f.metadata.get("group")
        if title is not None and title not in groups:
            raise TypeError(f"{cls.__name__}.{f.name}: section {title!r} is not in {cls.__name__}.SECTIONS")
        if title is not None:
            groups[title].append(f.name)
    return {title: members for title, members in groups.items() if members}


def not_from_file(cls: type) -> tuple[str, ...]:
    """Decisions about this invocation, not about what to train (``opt(from_file=False)``): a
    file never makes a run resume or delete another one."""
    return tuple(f.name for f in dataclasses.fields(cls) if not f.metadata.get("from_file", True))


def build_parser(cls: type, doc: str = "", quiet: bool = False, prog: str | None = None,
                 config_file: bool = True) -> argparse.ArgumentParser:
    """The command line of ``cls``: its positional arguments (:func:`positional`), then
    ``--config FILE`` (unless ``config_file`` is false) and one flag per other field, in its
    section (:func:`flag_groups`); ``doc``'s first line is the description, the rest (the launch
    examples) the epilog; ``prog``: the program's name (None: this process's)."""
    description, _, epilog = doc.strip().partition("\n")
    # No abbreviated flags: "--lr-s" silently meaning --lr-schedule hides typos in recipes and scripts.
    parser = OneLineErrorParser(prog=prog, description=description, epilog=epilog.strip("\n") or None,
                                 formatter_class=_HelpFormatter, quiet=quiet, allow_abbrev=False)
    for f in dataclasses.fields(cls):
        if f.metadata.get("positional"):
            parser.add_argument(f.name, help=f.metadata["help"], metavar=f.name.upper())
    if config_file:
        parser.add_argument("--config", metavar="FILE", default=None, help=CONFIG_HELP)
    groups = flag_groups(cls)
    sections = {}
    for title, members in groups.items():
        section = parser.add_argument_group(title)
        sections.update(dict.fromkeys(members, section))
    hints = typing.get_type_hints(cls)
    for f in sorted(ordered_fields(cls), key=lambda f: _group_position(groups, f.name)):
        if f.metadata.get("positional"):
            continue
        flag, where = flag_name(f.name), sections.get(f.name, parser)
        kind = field_type(hints[f.name])  # `float | None`: None = "set by the preset"
        meta = f.metadata
        flags = (flag, *meta.get("spellings", ()))
        if kind is bool:
            where.add_argument(*flags, dest=f.name, default=f.default, help=help_text(cls, f),
                               action=argparse.BooleanOptionalAction)
            continue
        if kind not in (int, float, str):
            raise TypeError(f"config field {f.name} has unsupported type {kind}")
        bare = {} if meta.get("bare") is None else {"nargs": "?", "const": meta["bare"]}
        where.add_argument(*flags, dest=f.name, type=finite_float if kind is float else kind,
                           default=f.default, help=help_text(cls, f), choices=meta.get("choices"),
                           metavar=None if meta.get("choices") else f.name.upper(), **bare)
        if meta.get("switch"):
            switch, value = meta["switch"]
            where.add_argument(switch, dest=_switched(f.name), action="store_true",
                               help=f"{flag} {value} unless {flag} is given (another project's spelling)")
    return parser


def _switched(name: str) -> str:
    return f"switched_{name}"


def _group_position(groups: dict[str, list[str]], name: str) -> tuple[int, int]:
    for i, members in enumerate(groups.values()):
        if name in members:
            return i + 1, members.index(name)
    return 0, 0  # ungrouped: first, in ordered_fields' order (sorted() is stable)


def parse_config(cls: type[T], argv: Sequence[str] | None = None, doc: str = "",
                 quiet: bool = False, prog: str | None = None, config_file: bool = True) -> T:
    """Parse the command line into ``cls`` over the preset and ``--config FILE`` (a command
    without ``config_file`` has no such flag); argparse errors exit 2 with one line (none if
    quiet), a bad file raises :class:`UsageError`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(cls, doc, quiet, prog, config_file)
    given = _pre_parsed(argv)
    from_file = read_config_file(cls, given.config) if config_file and given.config else {}
    presets = getattr(cls, "PRESETS", None) or {}
    chosen = given.preset if given.preset in presets else None  # an unknown name: argparse says so below
    brought = flag_defaults(cls, argv)
    dataset = given.dataset or from_file.get("dataset") or brought.get("dataset") or _default(cls, "dataset")
    parser.set_defaults(**{**preset_values(cls, chosen or from_file.get("preset")),
                           **dataset_values(cls, dataset), **brought, **from_file})
    args = vars(parser.parse_args(argv))
    args.pop("config", None)
    for f in dataclasses.fields(cls):
        if args.pop(_switched(f.name), False) and args[f.name] == f.default:
            args[f.name] = f.metadata["switch"][1]
    cfg = cls(**args)
    # a brought default where its field does nothing (torchvision's constant warm-up without a
    # warm-up) is the field's own again: check_applies refuses only what the user gave
    idle = {f.name: f.default for f in dataclasses.fields(cls) if f.name in brought
            and getattr(cfg, f.name) == brought[f.name] and f.metadata.get("applies_to") is not None
            and not f.metadata["applies_to"].holds(cfg)}
    return dataclasses.replace(cfg, **idle) if idle else cfg


def flag_defaults(cls: type, argv: Sequence[str]) -> dict[str, Any]:
    """The defaults a flag on the command line brings (``cls.FLAG_DEFAULTS``: {flag: {field:
    value}}; torchvision's ``--data-path`` brings its train.py's), below a file's and the command
    line's own values; empty when no such flag is given."""
    values: dict[str, Any] = {}
    for flag, defaults in (getattr(cls, "FLAG_DEFAULTS", None) or {}).items():
        if any(arg == flag or arg.startswith(flag + "=") for arg in argv):
            values.update(defaults)
    return values


def preset_values(cls: type, name: str | None) -> dict[str, Any]:
    """The values ``cls.PRESETS[name]`` sets (the ``preset`` field's default when ``name`` is
    None), the preset's own name included; empty for a class without presets."""
    presets = getattr(cls, "PRESETS", None)
    if not presets:
        return {}
    name = name or next(f.default for f in dataclasses.fields(cls) if f.name == "preset")
    if name not in presets:  # from a file: the command line's choices check never saw it
        raise UsageError(f"preset {name!r}: choose one of {', '.join(presets)}")
    return {"preset": name, **presets[name]}


def dataset_values(cls: type, dataset: str | None) -> dict[str, Any]:
    """The defaults ``cls.DATASET_DEFAULTS`` gives ``dataset`` (empty for a data set it names not)."""
    return dict((getattr(cls, "DATASET_DEFAULTS", None) or {}).get(dataset, {}))


def _default(cls: type, name: str) -> Any:
    return next((f.default for f in dataclasses.fields(cls) if f.name == name), None)


def help_text(cls: type, field: dataclasses.Field) -> str:
    """A field's help, followed by the values the presets other than its default give it, the
    data sets' own defaults of it and where it applies: "...; --preset v1: 0.07", "...; --dataset
    digits: 128", "...; applies to: cifar10"."""
    name = field.name
    own = [f"--preset {preset}: {_shown(values[name])}" for preset, values in
           (getattr(cls, "PRESETS", None) or {}).items() if name in values and values[name] != field.default]
    own += [f"--dataset {dataset}: {_shown(values[name])}" for dataset, values in
            (getattr(cls, "DATASET_DEFAULTS", None) or {}).items() if name in values]
    applies_to = field.metadata.get("applies_to")
    return (field.metadata["help"] + (f"; {', '.join(own)}" if own else "")
            + (f"; applies to: {applies_to.where}".replace("%", "%%") if applies_to else ""))


def _shown(value: Any) -> str:
    """A value as --help shows it (argparse %-formats help text: a % is written %%)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value).replace("%", "%%") if value != "" else "empty"


def read_config_file(cls: type, path: str) -> dict[str, Any]:
    """The flags of a JSON config file, checked like the command line's: every key a flag of
    ``cls`` (a run's ``config.json`` holds them under "config"), every value of the flag's type
    and among its choices."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise UsageError(f"--config {path}: cannot read it ({err.strerror or err})") from None
    except json.JSONDecodeError as err:
        raise UsageError(f"--config {path}: not valid JSON (line {err.lineno}: {err.msg})") from None
    if isinstance(data, dict) and isinstance(data.get("config"), dict):
        data = data["config"]  # a run's config.json: the flags, beside facts such as the world size
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a JSON object of flag names and values")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    spelled = {spelling.lstrip("-").replace("-", "_"): f.name for f in fields.values()
               for spelling in f.metadata.get("spellings", ())}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in data.items():
        if key.startswith("_"):  # a note for the reader ("_source": ...), not a flag
            continue
        name = key.lstrip("-").replace("-", "_")
        name = spelled.get(name, name)
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f"; did you mean {flag_name(close[0])}?" if close else ""
            raise UsageError(f"--config {path}: unknown key {key!r}: not a flag of this script{hint}")
        if name in not_from_file(cls):
            continue
        values[name] = _checked_value(path, key, value, field_type(hints[name]), fields[name])
    return values


def _pre_parsed(argv: Sequence[str]) -> argparse.Namespace:
    """``--config``, ``--preset`` and ``--dataset`` alone, read before the full parse (they set
    its defaults)."""
    first = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--config", "--preset", "--dataset"):
        first.add_argument(flag, default=None)
    return first.parse_known_args(argv)[0]


def recorded_run(argv: Sequence[str]) -> tuple[str, dict[str, Any]] | None:
    """(path, contents) when ``--config`` names a run's own config.json (it records the world size
    beside the flags); None for a recipe or no --config."""
    path = _pre_parsed(argv).config
    if not path:
        return None
    data = json.loads(Path(path).read_text())  # parse_config has read it already
    return (path, data) if isinstance(data, dict) and "world_size" in data and "config" in data else None


def _checked_value(path: str, key: str, value: Any, kind: type, field: dataclasses.Field) -> Any:
    ok = (isinstance(value, bool) if kind is bool else
          isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          if kind is float else
          isinstance(value, int) and not isinstance(value, bool) if kind is int else isinstance(value, str))
    if not ok:
        raise UsageError(f"--config {path}: {key!r} must be {kind.__name__}, got {value!r}")
    choices = field.metadata.get("choices")
    if choices and value not in choices:
        raise UsageError(f"--config {path}: {key!r} is {value!r}; choose one of {', '.join(map(str, choices))}")
    return float(value) if kind is float else value


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


def command_line() -> list[str]:
    """This process's command: the script's name and its arguments."""
    return [Path(sys.argv[0]).name, *sys.argv[1:]]


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Replace ``path`` atomically: a crash leaves the old file or the new one, never half of one."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def save_config(cfg: Any, out_dir: str | os.PathLike, extra: dict[str, Any] | None = None) -> Path:
    """Write the config, the flags as asked (plus run facts such as world size), to ``out_dir/config.json``."""
    path = Path(out_dir) / "config.json"
    write_json(path, {"config": config_dict(cfg), "git_revision": git_revision(), "command": command_line(),
                      **(extra or {})})
    return path


def markdown_flag_table(cls: type, config_file: bool = True) -> str:
    """docs/flags.md's table for ``cls`` (tests/test_docs.py keeps the page equal to it): its
    positional arguments, ``--config FILE`` (unless ``config_file`` is false), every flag."""
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{f.name.upper()}` | required | {f.metadata['help']} |" for f in dataclasses.fields(cls)
             if f.metadata.get("positional")]
    rows += [f"| `--config FILE` | none | {CONFIG_HELP} |"] if config_file else []
    hints = typing.get_type_hints(cls)
    for f in ordered_fields(cls):
        flag, meta = flag_name(f.name), f.metadata
        if meta.get("positional"):
            continue
        if field_type(hints[f.name]) is bool:
            flag = f"{flag} / --no-{flag[2:]}"
        flag = "` / `".join((flag, *meta.get("spellings", ()), *(meta["switch"][:1] if meta.get("switch") else ())))
        if f.default is None:
            default = "preset"
        elif isinstance(f.default, bool):
            default = "on" if f.default else "off"
        elif f.default == "":
            default = "empty"
        else:
            default = f"`{f.default}`"
        meaning = help_text(cls, f).replace("%%", "%")
        choices = [str(c) for c in meta.get("choices") or ()]
        if choices and not all(c in meaning for c in choices):
            meaning += "; one of " + ", ".join(choices)
        rows.append(f"| `{flag}` | {default} | {meaning} |")
    return "\n".join(rows)
