"""Image files that cannot be decoded, on the training side: the whole of what a run does about them.

The data side (``data.image_files``) gives such a file a placeholder target (``-1 - index``) in
its worker, records it on its rank when the batch is made, and names it. Here, in order:

1. each window keeps, as it begins, what it changes besides the gradients
   (``accumulation.WindowStart``), so that a window that met such a file can be undone exactly
   (``run.TrainingBatches``, which also counts the files met in the batches it handed out);
2. the ranks' agreement at the window's end carries a flag for it (``runtime.stopping``), and the
   training loop, seeing it, zeroes the gradients, undoes the window and calls
   :func:`stop_if_files_unreadable` (as evaluation and the kNN monitor do after their pass): the
   last completed step is checkpointed, the files are listed in the run folder
   (:func:`mark_unreadable`) and every rank exits 2;
3. a resume, or a restarted attempt, refuses to start while a listed file still fails to decode
   (:func:`refuse_unfixed_files`); once every one decodes or is gone, the run continues exactly
   where the undone window began, and the list is removed as the run folder opens.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..config import UsageError
from ..data.image_files import UnreadableImage, decode_rgb, describe_unreadable, fix_hint
from ..runtime.stopping import EXIT_USAGE, RunStopped
from .run_folder import UNREADABLE_MARKER
from .step_policy import save_checkpoint

if TYPE_CHECKING:
    from .checkpoint import Resume
    from .run import TrainRun

def mark_unreadable(out: str, files: list[UnreadableImage]) -> None:
    """Rank 0, when a run stops on image files it cannot decode: list them in the run folder, so
    that a resume (a torchrun restart included) refuses to start until they decode."""
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / UNREADABLE_MARKER).write_text("".join(f"{f.path}\t{f.reason}\n" for f in files))


def still_unreadable(out: str) -> list[UnreadableImage]:
    """The files a run in ``out`` stopped on that still cannot be decoded (each is tried again;
    a removed file no longer counts)."""
    marker = Path(out) / UNREADABLE_MARKER
    if not marker.is_file():
        return []
    unfixed = []
    for line in marker.read_text().splitlines():
        path = line.split("\t")[0]
        if path and Path(path).exists():
            try:
                decode_rgb(path)
            except UnreadableImage as err:
                unfixed.append(err)
    return unfixed


def refuse_unfixed_files(out: str, resume: Resume | None, restarted: bool) -> None:
    """A run continued in ``out`` after it stopped on image files that could not be decoded (a
    restarted attempt of it, or a resume of its checkpoint) starts only once they decode or are
    gone; a restarted attempt (torchrun, a requeue) exits 2 without repeating the line its first
    attempt printed."""
    continues = resume is not None and Path(resume.path).parent.resolve() == Path(out).resolve()
    if not (continues or restarted):
        return
    unfixed = still_unreadable(out)
    if unfixed:
        raise UsageError(f"{describe_unreadable(unfixed)}: the run in {out} stopped there; {fix_hint(unfixed)}, then continue "
                         f"with --resume auto", said=restarted)


def stop_if_files_unreadable(run: TrainRun, where: str) -> None:
    """Every rank calls it (one all_gather_object) after a window that met an image file that
    cannot be decoded, and after each evaluation or kNN pass: when any rank met one, the run
    stops on every rank with exit code 2, naming the files, after a checkpoint of the last
    completed step (a no-op when that step is on disk already)."""
    files = run.loaders.unreadable.on_every_rank()
    if not files:
        return
    if run.info.is_main:
        mark_unreadable(run.cfg.out, files)
    if run.state.step == 0 and run.session.saved.path is None:  # nothing trained yet: nothing to keep
        raise RunStopped(f"{where}: {describe_unreadable(files)}; {fix_hint(files)}, then start the run again", EXIT_USAGE)
    save_checkpoint(run)
    raise RunStopped(f"{where}: {describe_unreadable(files)}; {fix_hint(files)}, then continue with --resume auto; "
                     f"{run.session.saved.describe()}", EXIT_USAGE)
