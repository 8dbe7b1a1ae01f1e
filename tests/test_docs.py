"""The README documents every flag and every bad input the tests try, and each entry script opens
with its copy-paste commands."""
from __future__ import annotations

import pytest
from helpers import REPO
from test_cli_errors import CASES, readme_rows

import train_classifier
import train_moco
from ddp_utils.config import markdown_flag_table

SCRIPTS = {"train_classifier.py": train_classifier.ClassifierConfig, "train_moco.py": train_moco.MocoConfig}
README = (REPO / "README.md").read_text()


def _section(title: str) -> str:
    return README.split(f"## {title}")[1].split("\n## ")[0]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_readme_flag_table_is_the_configs(script):
    """Generated from the config dataclass (ddp_utils.config.markdown_flag_table): every flag,
    its default and its help, in --help's order."""
    assert markdown_flag_table(SCRIPTS[script]) in _section(f"Every flag of {script}")


def test_readme_bad_input_table_lists_every_tested_mistake():
    assert len(CASES) >= 30
    assert "\n".join(readme_rows()) in _section("Bad input")


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_entry_script_docstring_has_every_launch(script):
    doc = (REPO / script).read_text().split('"""')[1]
    for launch in ("python " + script, "torchrun --standalone", "--nnodes=2", "sbatch"):
        assert launch in doc, launch


def test_moco_help_lists_the_preset_first_and_no_none_defaults():
    from ddp_utils.config import build_parser

    text = " ".join(build_parser(train_moco.MocoConfig).format_help().split())  # unwrapped
    options = text.split("options:")[1]
    assert options.index("--config") < options.index("--preset") < options.index("--dataset") < options.index("--lr LR")
    # a preset is a set of ordinary defaults: the help shows the default preset's, and v1's beside them
    assert "softmax temperature (v1: 0.07) (default: 0.2)" in options and "(default: None)" not in options
    assert "(default: v2)" in options


def exit_code_table() -> str:
    """The README's exit-code table, from ddp_utils.runtime.stopping.EXIT_CODES."""
    from ddp_utils.runtime.stopping import EXIT_CODES

    rows = ["| code | when | what is on disk |", "| --- | --- | --- |"]
    rows += [f"| {code} | {when} | {disk} |" for code, (when, disk) in EXIT_CODES.items()]
    return "\n".join(rows)


def test_readme_exit_codes_are_the_codes_table():
    assert exit_code_table() in README
