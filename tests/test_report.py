"""report.py on real (tiny) runs of both training scripts: the numbers match the events, the
picture is a PNG, runs overlay, a missing matplotlib still gives the text, bad input exits 2."""
from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import pytest
from helpers import assert_ok, read_scalars, run_cli

import report
import train_classifier
import train_moco

TINY = ["--device", "cpu", "--dataset", "synthetic", "--synthetic-samples", "64", "--image-size", "16",
        "--batch-size", "16", "--workers", "0", "--epochs", "2", "--log-every", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One MoCo run (kNN accuracy, momentum) and one classifier run (val accuracy), 8 steps each."""
    root = tmp_path_factory.mktemp("report_runs")
    moco, cls = root / "moco", root / "cls"
    assert train_moco.main(TINY + ["--moco-k", "32", "--knn-every", "1", "--knn-k", "10", "--out", str(moco)]) == 0
    assert train_classifier.main(TINY + ["--out", str(cls)]) == 0
    return {"moco": moco, "cls": cls}


def _row(text: str, tag: str) -> list[str]:
    [line] = [line for line in text.splitlines() if line.startswith(f"| `{tag}` |")]
    return [cell.strip() for cell in line.strip("|").split("|")][1:]


def check_numbers(text: str, run: Path, accuracy_tags: tuple[str, ...]) -> None:
    """Each accuracy's last and best value (and steps) read back exactly as the events hold them."""
    scalars = read_scalars(run / "tb")
    for tag in accuracy_tags:
        final, final_step, best, best_step = _row(text, tag)
        (last_step, last), (top_step, top) = scalars[tag][-1], max(scalars[tag], key=lambda p: p[1])
        assert final == f"{last:.2f}" and int(final_step) == last_step
        assert best == f"{top:.2f}" and int(best_step) == top_step
    steps = max(step for points in scalars.values() for step, _ in points)
    assert steps == 8 and f"- steps: {steps} " in text
    loss_step, loss = scalars["train/loss"][-1]
    assert f"- final training loss: {loss:.4g} at step {loss_step} " in text
    meta = json.loads((run / "config.json").read_text())
    assert meta["git_revision"] and f"`{meta['git_revision']}`" in text
    assert "training time as logged" in text
    for key in ("batch_size", "epochs", "dataset", "world_size"):
        value = meta["world_size"] if key == "world_size" else meta["config"][key]
        assert f"| {key} | {value} |" in text


def check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert 600 <= width <= 3000 and 400 <= height <= 3000 and len(data) > 20_000, (width, height, len(data))


def test_moco_report_in_process(runs, capsys):
    assert report.main([str(runs["moco"])]) == 0
    text = (runs["moco"] / "report.md").read_text()
    check_numbers(text, runs["moco"], ("knn/acc1",))
    assert "![](report.png)" in text and "| moco_k | 32 |" in text
    check_png(runs["moco"] / "report.png")
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {runs['moco'] / 'report.md'} and report.png"


def test_classifier_report_as_a_subprocess(runs):
    proc = run_cli("report.py", [str(runs["cls"])], timeout=120)
    assert_ok(proc)
    text = (runs["cls"] / "report.md").read_text()
    check_numbers(text, runs["cls"], ("val/acc1", "val/acc5"))
    check_png(runs["cls"] / "report.png")


def test_two_runs_overlay_in_one_report(runs, tmp_path):
    out = tmp_path / "both"
    assert report.main([str(runs["moco"]), str(runs["cls"]), "--labels", "pretrain,supervised",
                        "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert text.startswith("# Report: pretrain vs supervised\n") and text.count("![](report.png)") == 1
    assert "## pretrain" in text and "## supervised" in text and "moco_k" in text.split("## pretrain")[0]
    check_numbers(text.split("## supervised")[0], runs["moco"], ("knn/acc1",))
    check_numbers(text.split("## supervised")[1], runs["cls"], ("val/acc1", "val/acc5"))
    check_png(out / "report.png")


def test_a_comparison_goes_to_its_own_folder_with_the_values_that_differ(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    own = {name: sorted(p.name for p in folder.iterdir()) for name, folder in runs.items()}
    assert report.main([str(runs["moco"]), str(runs["cls"])]) == 0
    text = (tmp_path / "reports/moco_vs_cls/report.md").read_text()
    assert {name: sorted(p.name for p in folder.iterdir()) for name, folder in runs.items()} == own
    differ = text.split("Config entries that differ:")[1].split("## moco")[0]
    assert "| entry | moco | cls |" in differ and "| lr | 0.03 | 0.1 |" in differ and "| moco_k | 32 | null |" in differ
    assert "| out |" not in differ


def test_a_flat_curve_gets_a_line_instead_of_a_panel(runs):
    moco = report.load_run(runs["moco"], "moco")
    assert "MoCo momentum" not in [title for title, _ in report.panels_of([moco])]  # --moco-m 0.999, unscheduled
    assert "- MoCo momentum: 0.999 throughout (no panel)" in report.run_section(moco)
    assert "learning rate" in [title for title, _ in report.panels_of([moco])]  # a cosine: not flat


def test_the_report_lists_what_each_resume_changed(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["cls"], run, ignore=shutil.ignore_patterns("*.pt", "report.*"))
    meta = json.loads((run / "config.json").read_text())
    meta["history"] = [{"resumed": "2026-12-01T10:00:00+00:00", "at_step": 8, "world_size": 2,
                        "from": "runs/x/checkpoint_last.pt", "changes": {"--epochs": [2, 3], "--lr": [0.1, 0.05]}}]
    (run / "config.json").write_text(json.dumps(meta))
    text = "\n".join(report.run_section(report.load_run(run, "x")))
    assert ("- 2026-12-01T10:00:00+00:00: resumed at step 8 on 2 rank(s) from `runs/x/checkpoint_last.pt`; "
            "`--epochs` 2 -> 3, `--lr` 0.1 -> 0.05") in text
    assert "History: started once, never resumed." in "\n".join(report.run_section(report.load_run(runs["cls"], "c")))


def test_missing_matplotlib_still_writes_the_text(runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    out = tmp_path / "nompl"
    assert report.main([str(runs["cls"]), "--out", str(out)]) == 0
    [hint] = capsys.readouterr().err.splitlines()
    assert "pip install matplotlib" in hint
    text = (out / "report.md").read_text()
    assert "No curves: matplotlib was not installed" in text and "![](report.png)" not in text
    check_numbers(text, runs["cls"], ("val/acc1", "val/acc5"))
    assert sorted(p.name for p in out.iterdir()) == ["report.md"]


def _bad_cases(run: Path, root: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (argv, words the one error line must hold)."""
    (root / "no_config").mkdir()
    (root / "no_events").mkdir()
    (root / "no_events/config.json").write_text("{}")
    return {"typo": ([str(root / "runn")], f"did you mean {run}?"),
            "no config.json": ([str(root / "no_config")], "has no config.json"),
            "no events": ([str(root / "no_events")], "holds no TensorBoard events"),
            "a file": ([str(run / "config.json")], f"did you mean {run}?"),
            "labels": ([str(run), "--labels", "a,b"], "one per folder"),
            "out is a file": ([str(run), "--out", str(run / "config.json")], "give a folder"),
            "unknown flag": ([str(run), "--lables", "a"], "unrecognized arguments")}


def test_bad_input_exits_2_with_one_line_and_writes_nothing(runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs["cls"], run, ignore=shutil.ignore_patterns("*.pt", "report.*"))
    cases = _bad_cases(run, tmp_path)
    before = sorted(tmp_path.rglob("*"))
    for name, (argv, words) in cases.items():
        try:
            code = report.main(argv)
        except SystemExit as stop:  # argparse's own errors
            code = stop.code
        [line] = capsys.readouterr().err.splitlines()
        assert code == 2 and line.startswith("report.py: error: ") and words in line, (name, line)
    assert sorted(tmp_path.rglob("*")) == before
