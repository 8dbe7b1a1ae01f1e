"""The docs are generated where they can be and cannot drift: docs/flags.md lists every flag,
docs/bad-input.md every bad input the tests try, docs/accumulation.md shows the classifier's
training loop as it is, the README the exit codes and every test file;
the README stays short, every relative link in it and in docs/ resolves, and each entry script
opens with its copy-paste commands."""
from __future__ import annotations

import ast
import inspect
import os
import re
import sys
import textwrap

import pytest
from helpers import REPO
from test_cli_errors import CASES, readme_rows

import train_classifier
import train_moco
import write_shards
from ddp_utils.config import markdown_flag_table

SCRIPTS = {"train_classifier.py": train_classifier.ClassifierConfig, "train_moco.py": train_moco.MocoConfig}
FLAG_TABLES = {script: markdown_flag_table(cls) for script, cls in SCRIPTS.items()} | {
    "write_shards.py": markdown_flag_table(write_shards.ShardsConfig, config_file=False)}  # no --config FILE
README = (REPO / "README.md").read_text()
README_MAX_LINES = 360
REGENERATE = "out of date: `PYTHONPATH=. python tests/test_docs.py` rewrites the generated tables in docs/"


def _section(title: str, doc: str = "README.md") -> str:
    """The text under the heading "## TITLE" of ``doc`` (a path from the repository root), up to
    the next "## " heading."""
    text = (REPO / doc).read_text()
    assert f"## {title}" in text, f"{doc} has no section '## {title}'"
    return text.split(f"## {title}")[1].split("\n## ")[0]


@pytest.mark.parametrize("script", sorted(FLAG_TABLES))
def test_flag_table_is_the_configs(script):
    """docs/flags.md, generated from the config dataclass (ddp_utils.config.markdown_flag_table):
    every flag, its default and its help, in --help's order."""
    assert FLAG_TABLES[script] in _section(f"Every flag of {script}", "docs/flags.md"), REGENERATE


def test_bad_input_table_lists_every_tested_mistake():
    assert len(CASES) >= 30
    assert "\n".join(readme_rows()) in _section("Bad input", "docs/bad-input.md"), REGENERATE


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
    assert "softmax temperature; --preset v1: 0.07 (default: 0.2)" in options and "(default: None)" not in options
    assert "(default: v2)" in options


def exit_code_table() -> str:
    """The README's exit-code table, from ddp_utils.runtime.stopping.EXIT_CODES."""
    from ddp_utils.runtime.stopping import EXIT_CODES

    rows = ["| code | when | what is on disk |", "| --- | --- | --- |"]
    rows += [f"| {code} | {when} | {disk} |" for code, (when, disk) in EXIT_CODES.items()]
    return "\n".join(rows)


def test_readme_exit_codes_are_the_codes_table():
    assert exit_code_table() in _section("Run folders, resume and exit codes")


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_the_help_names_every_exit_code(script):
    """--help's "Exit codes:" paragraph names each code of EXIT_CODES (it had left out 75)."""
    from ddp_utils.runtime.stopping import EXIT_CODES

    doc = " ".join((REPO / script).read_text().split('"""')[1].split())
    said = doc.split("Exit codes: ", 1)[1].split(". ")[0]
    assert [int(code) for code in re.findall(r"\b(\d+) ", said)] == list(EXIT_CODES)


def test_readme_stays_short():
    """Reference material lives in docs/; the README is the way in."""
    lines = README.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference material to docs/"


# ----------------------------------------------------------------------------- links between the docs
_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def _without_code(text: str) -> str:
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: its text (links as their text), lowercase, every character
    but letters, digits, spaces, '-' and '_' dropped, spaces made '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path) -> set[str]:
    """Every heading anchor of a markdown file; a repeated one also as -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
        anchor = github_anchor(heading)
        found.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
        seen[anchor] = seen.get(anchor, 0) + 1
    return found


def relative_links(path) -> list[str]:
    """The targets of the markdown links and images in ``path`` that stay inside the repository."""
    return [target for target in _LINK.findall(_without_code(path.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.I)]


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_github_anchor_rules():
    assert github_anchor("What a run writes (`--out DIR`)") == "what-a-run-writes---out-dir"
    assert github_anchor("How a run ends: exit codes") == "how-a-run-ends-exit-codes"
    assert github_anchor("Every flag of train_moco.py") == "every-flag-of-train_mocopy"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc):
    """Each relative link names a file that exists and, with a #anchor, a heading in it."""
    links = relative_links(doc)
    assert links or doc.name != "README.md"
    broken = []
    for target in links:
        file_part, _, anchor = target.partition("#")
        linked = (doc.parent / file_part).resolve() if file_part else doc
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked)):
            broken.append(f"{target}: no heading with anchor #{anchor} in {linked.name}")
    assert not broken, f"{doc.name}: " + "; ".join(broken)


def test_readme_links_to_every_doc():
    linked = {(REPO / target.partition("#")[0]).resolve() for target in relative_links(REPO / "README.md")}
    assert not [doc.name for doc in DOCS[1:] if doc.resolve() not in linked]


def test_the_tests_table_lists_every_test_file():
    """One row per tests/test_*.py, none for a file that is gone."""
    rows = re.findall(r"^\| `(test_\w+\.py)` \|", _section("Test files", "docs/tests.md"), re.M)
    assert len(rows) == len(set(rows)), "a test file has two rows"
    assert sorted(rows) == sorted(p.name for p in (REPO / "tests").glob("test_*.py"))


LOOP_PAGE, LOOP_INTRO = "docs/accumulation.md", "`train_classifier.py`'s reads:\n\n```python\n"


def classifier_loop() -> str:
    """train_classifier.py's training loop, the ``for micro ...`` statement of train_one_epoch, dedented."""
    lines = inspect.getsource(train_classifier.train_one_epoch).split("\n")
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("for micro, "))
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    return textwrap.dedent("\n".join(lines[start:end])).strip("\n")


def test_the_accumulation_page_shows_the_classifiers_loop():
    page = (REPO / LOOP_PAGE).read_text()
    assert LOOP_INTRO in page
    assert page.split(LOOP_INTRO, 1)[1].split("\n```", 1)[0] == classifier_loop(), REGENERATE


# ----------------------------------------------------------------------------- regenerating the tables
def _replace_table(doc: str, heading: str, table: str) -> None:
    """Put ``table`` in place of the first table under ``heading`` in ``doc``."""
    path = REPO / doc
    head, rest = path.read_text().split(heading + "\n", 1)
    lines = rest.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("| "))
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    lines[start:end] = table.split("\n")
    path.write_text(head + heading + "\n" + "\n".join(lines))


def regenerate() -> None:
    """Rewrite what is generated: the flags (docs/flags.md), the bad inputs (docs/bad-input.md) and
    the classifier's loop (docs/accumulation.md)."""
    for script, table in FLAG_TABLES.items():
        _replace_table("docs/flags.md", f"## Every flag of {script}", table)
    _replace_table("docs/bad-input.md", "## Bad input", "\n".join(readme_rows()))
    page = (REPO / LOOP_PAGE).read_text()
    head, rest = page.split(LOOP_INTRO, 1)
    (REPO / LOOP_PAGE).write_text(head + LOOP_INTRO + classifier_loop() + "\n```" + rest.split("\n```", 1)[1])


if __name__ == "__main__":  # PYTHONPATH=. python tests/test_docs.py
    regenerate()


def claimed_pythons() -> dict[str, set[str]]:
    """The Python versions each place names: the README's "Supported" line, the interpreters
    .ci/run builds its environments from, and pyproject.toml's requires-python range."""
    readme = re.search(r"Python (3\.\d+) and (3\.\d+), both tested", README)
    ci = set(re.findall(r"^PYTHON_\w+=\$\(pyenv_python (3\.\d+)\)$", (REPO / ".ci/run").read_text(), re.M))
    low, high = re.search(r'requires-python = ">=3\.(\d+),<3\.(\d+)"', (REPO / "pyproject.toml").read_text()).groups()
    return {"README": set(readme.groups()) if readme else set(), ".ci/run": ci,
            "pyproject.toml": {f"3.{minor}" for minor in range(int(low), int(high))}}


def test_the_readme_claims_the_pythons_ci_tests():
    """The README claims exactly the Python versions `.ci/run` makes its environments from (and
    pyproject.toml's range); under CI the suite itself runs on one of them."""
    claims = claimed_pythons()
    assert claims["README"] == claims[".ci/run"] == claims["pyproject.toml"] == {"3.12", "3.13"}, claims
    if os.environ.get("CI") == "true":
        assert f"{sys.version_info.major}.{sys.version_info.minor}" in claims["README"]


AUTOGRAD_ERRORS = ("modified by an inplace operation", "backward through the graph a second time")


def _tests_with_marks(path) -> dict[str, tuple[set[str], str]]:
    """{test function of ``path``: (the ``pytest.mark`` names on it, its parameters and its module,
    its source)}."""
    source = path.read_text()
    tree = ast.parse(source)
    module = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            module = set(re.findall(r"pytest\.mark\.(\w+)", ast.unparse(node.value)))
    return {node.name: (module | set(re.findall(r"pytest\.mark\.(\w+)", " ".join(map(ast.unparse, node.decorator_list)))),
                        ast.get_source_segment(source, node))
            for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_the_oldest_torch_pair_runs_every_test_of_what_differs_between_releases():
    """.ci/run's oldest pair runs `-m "not slow or torch_versions"`; each test naming one of the
    seed's two autograd errors runs there (fast, or slow and marked); a marked test is a slow one,
    and docs/tests.md's "On both torch pairs" names its file."""
    ci = (REPO / ".ci/run").read_text()
    assert re.search(r'^"\$OLDEST_VENV/bin/python" -m pytest -m "not slow or torch_versions"$', ci, re.M), ci
    section = _section("On both torch pairs", "docs/tests.md")
    naming, marked = {}, {}
    for path in sorted((REPO / "tests").glob("test_*.py")):
        for name, (marks, source) in _tests_with_marks(path).items():
            if any(error in source for error in AUTOGRAD_ERRORS):
                naming[f"{path.name}::{name}"] = marks
            if "torch_versions" in marks:
                marked[f"{path.name}::{name}"] = marks
    assert len(naming) >= 2, naming  # test_symmetric.py's and test_moco.py's at least
    assert all("slow" not in marks or "torch_versions" in marks for marks in naming.values()), naming
    assert marked and all("slow" in marks for marks in marked.values()), marked
    assert all(f"`{test.split('::')[0]}`" in section for test in marked), marked
