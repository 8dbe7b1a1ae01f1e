"""Data a run cannot read (image files that cannot be decoded, shards the object store did not
give): every rank stops after a checkpoint of the last completed step, the files are listed in the
run folder, and a resume starts only once they decode or are gone. The whole story, and the other
files that hold it: docs/data.md, "Files that cannot be decoded".
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..config import UsageError
from ..data.image_files import UnreadableImage
from ..data.object_store import ShardChanged, StoreError
from ..data.unreadable import decode_again, describe_unreadable, fix_hint
from ..runtime.stopping import EXIT_USAGE, STORE_MARKER, RunStopped
from .run import TrainRun, save_checkpoint

if TYPE_CHECKING:
    from .checkpoint import Resume

UNREADABLE_MARKER = "UNREADABLE"  # in the run folder: the image files a run stopped on, one "PATH\treason" per line


def mark_unreadable(out: str, named: list[tuple[str, str]]) -> None:
    """Rank 0, when a run stops on image files it cannot decode or on shards the store did not
    give as listed: list them (name, reason) in the run folder, so that a resume (a torchrun
    restart included) refuses to start until the files decode, and knows what the run named."""
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / UNREADABLE_MARKER).write_text("".join(f"{name}\t{reason}\n" for name, reason in named))


def named_by_the_run(out: str) -> list[str]:
    """What the run in ``out`` stopped on and named: image files, shard records ("PATH in
    SHARD") and shards; [] when it stopped on none."""
    marker = Path(out) / UNREADABLE_MARKER
    return [line.split("\t")[0] for line in marker.read_text().splitlines() if line] if marker.is_file() else []


def still_unreadable(out: str) -> list[UnreadableImage]:
    """The files (or shard records) a run in ``out`` stopped on that still cannot be decoded
    (each is tried again; a removed one no longer counts)."""
    indexes: dict = {}  # shard indexes read so far
    found = (decode_again(name, indexes) for name in named_by_the_run(out))
    return [err for err in found if err is not None]


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


def forget_unreadable(out: str) -> None:
    """Rank 0, once every rank passed :func:`refuse_unfixed_files`: the list goes (its files
    decode now or are gone, or this is a fresh start)."""
    (Path(out) / UNREADABLE_MARKER).unlink(missing_ok=True)
    (Path(out) / STORE_MARKER).unlink(missing_ok=True)  # an earlier attempt's: this one got past the store


def stop_if_files_unreadable(run: TrainRun, where: str) -> None:
    """Every rank calls it (one all_gather_object) after a window that met an image file that
    cannot be decoded or a shard the store did not give, and after each evaluation or kNN pass:
    when any rank met one, the run stops on every rank, naming them, after a checkpoint of the
    last completed step (a no-op when that step is on disk already): exit code 2 for files, the
    store's own (:func:`stop_for_store`) for its faults."""
    files, faults = run.loaders.unreadable.on_every_rank()
    if faults:
        stop_for_store(run, where, faults)
    if not files:
        return
    if run.info.is_main:
        mark_unreadable(run.cfg.out, [(f.path, f.reason) for f in files])
    stop_after_the_last_step(run, f"{where}: {describe_unreadable(files)}; {fix_hint(files)}, then", EXIT_USAGE)


def stop_for_store(run: TrainRun, where: str, faults: list[StoreError]) -> None:
    """Every rank, when a rank met a shard the store did not give: a checkpoint of the last
    completed step, then exit 2 if a shard changed under the run (a restart reads the same
    change), else exit 75 (worth a restart: the launchers start the job again, whose pre-flight
    waits ``--store-timeout`` for the store)."""
    fault = next((f for f in faults if f.exit_code == EXIT_USAGE), faults[0])
    if run.info.is_main and isinstance(fault, ShardChanged):  # what a resume may find put back
        mark_unreadable(run.cfg.out, [(f.address, f.reason) for f in faults if isinstance(f, ShardChanged)])
    stop_after_the_last_step(run, f"{where}: {fault};", fault.exit_code)


def stop_after_the_last_step(run: TrainRun, said: str, code: int) -> None:
    """Every rank: checkpoint the last completed step (nothing when nothing was trained yet) and
    stop with ``code``, ``said`` followed by how to go on."""
    if run.state.step == 0 and run.session.saved.path is None:  # nothing trained yet: nothing to keep
        raise RunStopped(f"{said} start the run again", code)
    save_checkpoint(run)
    raise RunStopped(f"{said} continue with --resume auto; {run.session.saved.describe()}", code)
