"""A one-page report of a training run: its curves, final numbers and config, from the run folder.

    python report.py runs/digits                          # runs/digits/report.md + report.png
    python report.py runs/moco_digits runs/digits         # overlay both, in reports/moco_digits_vs_digits/
    python report.py runs/a runs/b --labels base,lr2 --out reports/ab   # into reports/ab/

A run folder is the ``--out`` of train_classifier.py or train_moco.py. The report reads its
``config.json`` and the TensorBoard events in ``tb/`` (with tensorboard's own reader); it reads
no checkpoint.

report.png holds the curves against optimizer steps: training loss, learning rate, MoCo momentum
(MoCo runs), images/s, and validation top-1/top-5 or kNN top-1 accuracy. Several run folders
share the panels, one colour each, with a legend (the folder names, or ``--labels``).
report.md gives, per run: the last and best value of each accuracy series, the final training
loss, the steps, the wall time as logged, the git revision, the config and its history (what each
resume changed), and embeds the picture; for several runs, the config entries that differ with
their values. A panel whose every curve is flat (a momentum that is not scheduled) is left out
and its value said in report.md instead. One run's report goes into its folder; a comparison
into reports/A_vs_B/ (or --out), so no run's own report is overwritten.

Exit codes: 0 when report.md is written. That includes a missing matplotlib (it is a development
tool, requirements-dev.txt, not needed to train): the text report is still useful, so it is
written without the picture, says so, and one line tells how to install matplotlib. 2 for bad
input (a folder that is not a run, a typo, a wrong --labels): one line names the problem and the
fix, and nothing is written.
"""
from __future__ import annotations

import argparse
import difflib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

TB_DIR = "tb"  # where the training scripts write their events (ddp_utils/train/run_folder.py)
ACCURACY = ("val/acc1", "val/acc5", "knn/acc1")
# (panel title, series drawn in it); a panel no run has a point for is left out
PANELS = (("training loss", ("train/loss",)), ("learning rate", ("train/lr",)),
          ("MoCo momentum", ("train/moco_m",)), ("images/s", ("train/images_per_sec",)),
          ("waiting for data (% of time)", ("train/data_wait_percent",)), ("accuracy (%)", ACCURACY))
INSTALL_HINT = ("report.py: matplotlib is not installed, so report.md has no curves; "
                "add them with: pip install matplotlib (or pip install -r requirements-dev.txt)")


class BadInput(Exception):
    """One line naming the problem and its fix; exit code 2."""


@dataclass
class Run:
    folder: Path
    label: str
    meta: dict  # config.json: {"config": {...}, "git_revision": ..., "world_size": ..., "command": [...]}
    series: dict[str, list[tuple[int, float]]]  # tag -> (step, value), as the events hold them
    first_time: float  # wall_time of the first event and of the last scalar, in seconds
    last_time: float

    @property
    def steps(self) -> int:
        return max(step for points in self.series.values() for step, _ in points)


def _not_a_folder(path: Path) -> BadInput:
    """A file inside a run folder points at that folder; a typo at the nearest folder name."""
    if path.exists():
        near = [path.parent.name] if (path.parent / "config.json").is_file() else []
        what, parent = "is a file, not a run folder", path.parent.parent
    else:
        siblings = [p.name for p in path.parent.glob("*") if p.is_dir()]
        near = difflib.get_close_matches(path.name, siblings, n=1)
        what, parent = "does not exist", path.parent
    hint = f"did you mean {parent / near[0]}?" if near else "give the --out folder of a training run"
    return BadInput(f"{path} {what}: {hint}")


def load_run(folder: Path, label: str) -> Run:
    """Read config.json and every scalar of ``folder/tb``; BadInput if it is not a run folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not folder.is_dir():
        raise _not_a_folder(folder)
    if not (folder / "config.json").is_file():
        raise BadInput(f"{folder} has no config.json, so it is not a run folder: give the --out folder "
                       f"of train_classifier.py or train_moco.py")
    try:
        meta = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise BadInput(f"{folder / 'config.json'} cannot be read ({err}); the run folder is damaged") from None
    tb = folder / TB_DIR
    if not any(tb.glob("events.out.tfevents.*")):
        raise BadInput(f"{tb} holds no TensorBoard events: the run stopped before it logged anything; "
                       f"train it (again) or give another folder")
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    events = {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}
    if not any(events.values()):
        raise BadInput(f"{tb} holds no scalars yet: the run stopped before its first logged step "
                       f"(--log-every); let it train longer")
    last_time = max(e.wall_time for points in events.values() for e in points)
    series = {tag: [(e.step, e.value) for e in points] for tag, points in events.items()}
    return Run(folder, label, meta, series, acc.FirstEventTimestamp(), last_time)


def plot(runs: list[Run], path: Path) -> bool:
    """Draw the curves into ``path`` (PNG); False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    panels = panels_of(runs)
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(11, 3.2 * rows), squeeze=False)
    styles = {"val/acc5": "--"}
    for ax, (title, tags) in zip(axes.flat, panels):
        for color, run in enumerate(runs):
            for tag in (t for t in tags if t in run.series):
                steps, values = zip(*run.series[tag])
                name = run.label if len(tags) == 1 else f"{run.label} {tag}"
                ax.plot(steps, values, styles.get(tag, "-"), color=f"C{color}", label=name,
                        marker="o" if len(steps) <= 50 else None, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        if len(runs) > 1 or len(tags) > 1:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def panels_of(runs: list[Run]) -> list[tuple[str, tuple[str, ...]]]:
    """The panels with a point in some run and a curve that is not flat."""
    return [(title, tags) for title, tags in PANELS
            if any(tag in r.series for r in runs for tag in tags) and flat(runs, tags) is None]


def flat(runs: list[Run], tags: tuple[str, ...]) -> float | None:
    """The one value every point of ``tags`` has in every run (a constant), else None."""
    values = {value for run in runs for tag in tags for _, value in run.series.get(tag, ())}
    return values.pop() if len(values) == 1 else None


def num(value: float) -> str:
    """A logged value (float32 in the events) to 4 significant digits."""
    return f"{value:.4g}"


def pct(value: float) -> str:
    return f"{value:.2f}"


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def config_table(run: Run, per_row: int = 3) -> list[str]:
    """config.json's "config" entries and world_size as key | value pairs, ``per_row`` to a row."""
    def show(value) -> str:
        return value if isinstance(value, str) and value else json.dumps(value)

    items = [("world_size", run.meta.get("world_size"))] + sorted(run.meta.get("config", {}).items())
    cells = [f"{key} | {show(value)}" for key, value in items]
    cells += [" | "] * (-len(cells) % per_row)
    lines = ["| " + " | ".join(["key | value"] * per_row) + " |", "|" + " --- |" * (2 * per_row)]
    return lines + ["| " + " | ".join(cells[i:i + per_row]) + " |" for i in range(0, len(cells), per_row)]


def run_section(run: Run) -> list[str]:
    revision = run.meta.get("git_revision") or "not recorded (git was not available when it started)"
    lines = [f"## {run.label}", "", f"- folder: `{run.folder}`",
             f"- command: `{' '.join(run.meta.get('command', []))}`",
             f"- git revision: `{revision}` (HEAD when the run last started; uncommitted changes are not recorded)",
             f"- steps: {run.steps} (the last optimizer step in the events)",
             f"- wall time: {duration(run.last_time - run.first_time)}, training time as logged: first to last "
             f"TensorBoard event (evaluation, checkpoints and any pause before a --resume count; start-up "
             f"before the first event does not)"]
    if "train/loss" in run.series:
        step, value = run.series["train/loss"][-1]
        lines.append(f"- final training loss: {num(value)} at step {step} (mean over the last logged steps)")
    lines += ["", "| accuracy (%) | final | at step | best | at step |", "| --- | --- | --- | --- | --- |"]
    for tag in (t for t in ACCURACY if t in run.series):
        best_step, best = max(run.series[tag], key=lambda point: point[1])  # first of equal maxima
        step, value = run.series[tag][-1]
        lines.append(f"| `{tag}` | {pct(value)} | {step} | {pct(best)} | {best_step} |")
    if not any(t in run.series for t in ACCURACY):
        lines[-2:] = ["- accuracy: none logged yet (no evaluation has run)"]
    for title, tags in PANELS:
        constant = flat([run], tags)
        if constant is not None and sum(len(run.series.get(tag, ())) for tag in tags) > 1:
            lines.append(f"- {title}: {num(constant)} throughout (no panel)")
    return lines + ["", "Config (config.json):", "", *config_table(run), "", *history(run)]


def history(run: Run) -> list[str]:
    """config.json's "history": each resume, when, at which step, and what it changed."""
    entries = run.meta.get("history") or []
    if not entries:
        return ["History: started once, never resumed.", ""]
    lines = ["History (config.json keeps the settings the run started with; each resume is listed):", ""]
    for entry in entries:
        changes = ", ".join(f"`{flag}` {json.dumps(old)} -> {json.dumps(new)}"
                            for flag, (old, new) in entry.get("changes", {}).items()) or "no setting changed"
        lines.append(f"- {entry.get('resumed', '?')}: resumed at step {entry.get('at_step', '?')} on "
                     f"{entry.get('world_size', '?')} rank(s) from `{entry.get('from', '?')}`; {changes}")
    return lines + [""]


def differing(runs: list[Run]) -> list[str]:
    """A table of the config entries (and world_size) that are not the same in every run, one
    column per run; ``out`` always differs and is left out."""
    entries = [{**r.meta.get("config", {}), "world_size": r.meta.get("world_size")} for r in runs]
    keys = sorted(set().union(*entries) - {"out"})
    keys = [k for k in keys if len({json.dumps(e.get(k)) for e in entries}) > 1]
    if not keys:
        return ["Config entries that differ: none.", ""]
    rows = ["Config entries that differ:", "", "| entry | " + " | ".join(r.label for r in runs) + " |",
            "| --- |" + " --- |" * len(runs)]
    rows += [f"| {k} | " + " | ".join(json.dumps(e.get(k)) for e in entries) + " |" for k in keys]
    return rows + [""]


def markdown(runs: list[Run], picture: bool) -> str:
    lines = [f"# Report: {' vs '.join(r.label for r in runs)}", ""]
    if picture:
        lines += ["![](report.png)", ""]
    else:
        lines += ["*No curves: matplotlib was not installed when this report was written "
                  "(`pip install matplotlib`, then run report.py again).*", ""]
    if len(runs) > 1:
        lines += differing(runs)
    for run in runs:
        lines += run_section(run)
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="report.py", description=__doc__, allow_abbrev=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run folders (the --out of a training run)")
    parser.add_argument("--out", type=Path, metavar="DIR", help="folder for report.md and report.png (default: "
                        "the RUN_DIR itself for one run, reports/A_vs_B for several)")
    parser.add_argument("--labels", metavar="A,B", help="comma-separated legend labels, one per RUN_DIR (default: folder names)")
    args = parser.parse_args(argv)
    try:
        labels = args.labels.split(",") if args.labels else [p.resolve().name for p in args.runs]
        out = args.out or (args.runs[0] if len(args.runs) == 1 else Path("reports") / "_vs_".join(labels))
        if len(labels) != len(args.runs):
            raise BadInput(f"--labels has {len(labels)} label(s) for {len(args.runs)} run folder(s): "
                           f"give one per folder, separated by commas")
        runs = [load_run(folder, label) for folder, label in zip(args.runs, labels)]
        if out.exists() and not out.is_dir():
            raise BadInput(f"--out {out} is a file: give a folder for report.md and report.png")
    except BadInput as err:
        print(f"report.py: error: {err}", file=sys.stderr)
        return 2
    try:
        out.mkdir(parents=True, exist_ok=True)
        picture = plot(runs, out / "report.png")
        if not picture:
            (out / "report.png").unlink(missing_ok=True)  # an older picture would not match this report
            print(INSTALL_HINT, file=sys.stderr)
        (out / "report.md").write_text(markdown(runs, picture))
    except OSError as err:
        print(f"report.py: error: cannot write in {out} ({err.strerror}): choose a folder you can "
              f"write to with --out", file=sys.stderr)
        return 2
    print(f"wrote {out / 'report.md'}" + (" and report.png" if picture else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
