"""The README documents every flag, and each entry script opens with its copy-paste commands."""
from __future__ import annotations

import dataclasses
import re

import pytest
from helpers import REPO

import train_classifier
import train_moco

SCRIPTS = {"train_classifier.py": train_classifier.ClassifierConfig, "train_moco.py": train_moco.MocoConfig}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_readme_lists_every_flag(script):
    readme = (REPO / "README.md").read_text()
    section = readme.split(f"## Every flag of {script}")[1].split("\n## ")[0]
    documented = set(re.findall(r"^\| `(--[a-z0-9-]+)", section, flags=re.M))
    flags = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(SCRIPTS[script])}
    assert documented == flags


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_entry_script_docstring_has_every_launch(script):
    doc = (REPO / script).read_text().split('"""')[1]
    for launch in ("python " + script, "torchrun --standalone", "--nnodes=2", "sbatch"):
        assert launch in doc, launch
