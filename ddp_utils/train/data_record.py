"""Whether a run continues on the data it read: the one check a later attempt (a torchrun restart, a
requeue, ``--resume``) passes before it reads anything, in the pre-flight and in ``--check`` alike.
It compares the checkpoint's data fingerprint with this run's and, from an object store, this
attempt's listing with the record its run folder holds (:data:`LISTED`); what the run itself named
unreadable, removed, fixed or put back, is the same data. Anything else that changed is refused in
one line, unless ``--allow-changes``, which records it (``ResolvedSettings.data_changes``). The
rules, case by case: docs/data.md, "The data a run read, pinned across attempts".
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from ..config import UsageError, write_json
from ..data.image_files import IN_SHARD, FolderListing, data_fingerprint
from ..data.object_store import Listed, is_object_store
from ..data.shards import INDEX, RECORDS, ShardIndex
from .checkpoint import Resume

LISTED = "data_listed.json"  # in the run folder: what the object store's listing gave, per split and object
SPLITS = ("train", "val")
Listings = tuple[FolderListing, FolderListing] | tuple[ShardIndex, ShardIndex]


def write_listing_record(out: str, listings: Listings | None) -> None:
    """Rank 0, at every start of a run from an object store: what this attempt's listing gave
    for each object it reads, the pins a later attempt is held to."""
    if listings is None or not is_object_store(listings[0].root):
        return
    write_json(Path(out) / LISTED, {split: {"root": index.root, "objects": {
        name: dataclasses.astuple(listed) for name, listed in index.listed.items()}}
        for split, index in zip(SPLITS, listings)})


def recorded_listing(folder: Path) -> dict[str, dict[str, Listed]] | None:
    """{split: {name: Listed}} as a start of the run in ``folder`` recorded it; None without a record."""
    try:
        record = json.loads((folder / LISTED).read_text())
    except FileNotFoundError:
        return None
    return {split: {name: Listed(*entry) for name, entry in record[split]["objects"].items()} for split in SPLITS}


def check_same_data(resume: Resume | None, listings: Listings | None, named: list[str], allow_changes: bool
                    ) -> tuple[Listings | None, tuple[str, ...]]:
    """A run that continues ``resume``'s checkpoint (None: a fresh start, nothing to compare) on
    ``listings``, after its run named ``named`` (``unreadable_files.named_by_the_run``): bad input
    when the data changed otherwise than the stop line prescribed, unless ``allow_changes``.
    Returns the listings to read (a shard put back pinned by its content) and what changed and
    was accepted, each in words."""
    if resume is None or listings is None:
        return listings, ()
    accepted: list[str] = []
    if is_object_store(listings[0].root):
        listings, accepted = _check_listing(resume, listings, named, allow_changes)
    saved = resume.checkpoint.get("resolved", {}).get("data_fingerprint")
    now = data_fingerprint(*listings)
    if saved and saved != now:
        removed = {split.root: _gone(split, named) for split in listings if isinstance(split, FolderListing)}
        if any(removed.values()) and data_fingerprint(*(split.with_files(removed[split.root])
                                                        for split in listings)) == saved:
            accepted += [f"{os.path.join(root, path)} removed (the run named it as unreadable)"
                         for root, paths in removed.items() for path in paths]
        elif allow_changes:
            accepted.append(f"data fingerprint {saved} -> {now} (--allow-changes)")
        else:
            raise UsageError(f"--resume {resume.path}: its run read other image files (data fingerprint {saved}, "
                             f"now {now}: a listing or a shards' index changed); resume on the data it read, add "
                             f"--allow-changes to continue on this data (recorded in config.json), or start a new "
                             f"run in another --out")
    accepted += [f"{name} fixed in place (the run named it as unreadable)" for name in named
                 if os.path.isfile(name)]
    return listings, tuple(accepted)


def _gone(listing: FolderListing, named: list[str]) -> list[str]:
    """The files of ``named`` below ``listing``'s class folders that the listing no longer holds,
    as paths below its root."""
    head, present = os.path.join(listing.root, ""), set(listing.paths.split("\0"))
    below = (name[len(head):] for name in named if name.startswith(head))
    return [path for path in below if path.split("/", 1)[0] in listing.classes and path not in present]


def _check_listing(resume: Resume, listings: tuple[ShardIndex, ShardIndex], named: list[str],
                   allow_changes: bool) -> tuple[tuple[ShardIndex, ShardIndex], list[str]]:
    """The store's listing now against the record of the checkpoint's run folder (none: nothing
    to compare). A shard whose listing changed but whose index entry did not is read pinned by
    its content (the index's sha256); without ``allow_changes`` only the shards the run named
    may have changed so."""
    record = recorded_listing(resume.path.parent)
    if record is None:
        return listings, []
    named_shards = {name.rsplit(IN_SHARD, 1)[-1] for name in named}
    changed, refused, by_content = [], [], []
    for split, index in zip(SPLITS, listings):
        then, now = record[split], index.listed
        for name in sorted(then.keys() | now.keys()):
            what = _change(then.get(name), now.get(name))
            if what is None:
                continue
            address = f"{index.root}/{name}"
            changed.append(f"{address} {what}")
            same_index = name not in (INDEX, RECORDS) and name in then and name in now and \
                then.get(INDEX) == now.get(INDEX) and then.get(RECORDS) == now.get(RECORDS)
            if same_index:
                by_content.append((split, name))
            if address in named_shards and same_index:
                changed[-1] += " (the run named it: read pinned by its index's sha256)"
            elif not allow_changes:
                refused.append(f"{address} {what}")
    if refused:
        shown = "; ".join(refused[:3]) + (f"; and {len(refused) - 3} more" if len(refused) > 3 else "")
        raise UsageError(f"--resume {resume.path}: the object store's data changed since its run listed it ({shown}); "
                         f"put the listed versions back, add --allow-changes to continue on the data as it is now "
                         f"(a changed shard is then read only if its bytes are the index's; recorded in "
                         f"config.json), or start a new run in another --out")
    train, val = (dataclasses.replace(index, by_content=frozenset(name for s, name in by_content if s == split))
                  for split, index in zip(SPLITS, listings))
    return (train, val), changed


def _change(then: Listed | None, now: Listed | None) -> str | None:
    """What differs between an object's listing then and now, in words; None when nothing does."""
    if then is None:
        return "is new"
    if now is None:
        return "was removed"
    if then.version and now.version and then.version != now.version:
        return f"changed (VersionId {then.version} -> {now.version})"
    if then.etag != now.etag:
        multipart = " (a multipart upload's ETag changes with its part size, even for the same bytes)" \
            if "-" in then.etag and "-" in now.etag and then.size == now.size else ""
        return f"changed (ETag {then.etag} -> {now.etag}{multipart})"
    if then.size != now.size:
        return f"changed ({then.size:,} -> {now.size:,} bytes)"
    return None
