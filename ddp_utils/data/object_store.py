"""Shards in an S3-compatible object store: ``--data-dir s3://BUCKET/PREFIX``.

The bucket holds what ``write_shards.py`` wrote (``PREFIX/train/index.json``, ...), copied as it
is (``aws s3 sync DST s3://BUCKET/PREFIX``). Access goes through boto3, the AWS SDK, which reads
the endpoint and the credentials from the standard variables and files (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ...): nothing here reads,
logs or stores them, and a run's config holds only the ``s3://`` address.

A rank never reads an image by itself from the store: it downloads whole shards into a local
cache (:class:`ShardCache`) bounded in bytes, and reads them there. The order that makes this
cheap (each rank reads whole shards, in turn) is ``shard_order``'s.
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..config import UsageError

SCHEME = "s3://"
DEFAULT_CACHE_GB = 8.0  # a rank's cache of shards, unless --shard-cache-gb says otherwise


def is_object_store(location: str) -> bool:
    return location.startswith(SCHEME)


def split_address(address: str) -> tuple[str, str]:
    """``s3://BUCKET/PREFIX`` -> (BUCKET, PREFIX without its slashes at either end)."""
    bucket, _, prefix = address[len(SCHEME):].partition("/")
    return bucket, prefix.strip("/")


def check_address(address: str, named: str = "--data-dir") -> str | None:
    """A one-line description of what is wrong with an ``s3://`` address itself, or None."""
    bucket, _ = split_address(address)
    if not bucket:
        return f"{named} {address}: no bucket; write s3://BUCKET/PREFIX"
    if "@" in bucket or ":" in bucket:
        return (f"{named} {address}: credentials do not belong in the address; set AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) instead")
    return None


_clients: dict[int, object] = {}


def client():
    """This process's S3 client (a forked worker makes its own: clients are not fork-safe)."""
    made = _clients.get(os.getpid())
    if made is None:
        import boto3  # an optional requirement (requirements-shards.txt): imported only for s3:// data
        from botocore.config import Config

        for name in ("boto3", "botocore", "s3transfer", "urllib3"):  # their INFO lines are not the run's
            logging.getLogger(name).setLevel(logging.WARNING)

        made = _clients[os.getpid()] = boto3.client(
            "s3", config=Config(retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=5, read_timeout=60))
    return made


def describe_failure(address: str, err: Exception) -> str:
    """One line for a failed request: what failed and where to look, never a credential."""
    code = getattr(err, "response", {}).get("Error", {}).get("Code", type(err).__name__)
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "AWS's own")
    return (f"{address}: the object store refused or could not be reached ({code}; endpoint {endpoint}); check the "
            f"address, AWS_ENDPOINT_URL and the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or AWS_PROFILE)")


class StorePrefix:
    """The objects below one ``s3://BUCKET/PREFIX``, read as a folder's files are."""

    def __init__(self, address: str):
        self.address = address.rstrip("/")
        self.bucket, self.prefix = split_address(address)

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def read(self, name: str) -> bytes | None:
        """The whole object ``PREFIX/name``; None if there is none. Bad input if the store fails."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return client().get_object(Bucket=self.bucket, Key=self.key(name))["Body"].read()
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise UsageError(describe_failure(f"{self.address}/{name}", err)) from None
        except BotoCoreError as err:
            raise UsageError(describe_failure(f"{self.address}/{name}", err)) from None

    def sizes(self) -> dict[str, int]:
        """{name: bytes} of every object directly below the prefix (one listing, paged)."""
        from botocore.exceptions import BotoCoreError, ClientError

        found, start = {}, f"{self.prefix}/" if self.prefix else ""
        try:
            for page in client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
                for entry in page.get("Contents", []):
                    found[entry["Key"][len(start):]] = entry["Size"]
        except (BotoCoreError, ClientError) as err:
            raise UsageError(describe_failure(self.address, err)) from None
        return found



@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def download(address: str, to: str) -> None:
    """The object at ``address`` into the local file ``to`` (boto3's managed transfer: ranged
    parts in parallel, each retried)."""
    bucket, key = split_address(address)
    client().download_file(bucket, key, to)


class ShardCache:
    """Shards downloaded whole into ``folder`` (one rank's), at most
    ``capacity_bytes`` of them at once: the least recently read are deleted to make room (a
    process still reading one keeps it through its open file, and another fetches it again).
    The processes of one rank (its DataLoader workers) share the folder; a lock per shard makes
    one of them download it while the others wait. Each download is appended to ``DOWNLOADS``
    (name and bytes, one line), which the training process counts."""

    DOWNLOADS = "downloads.txt"

    def __init__(self, folder: str, capacity_bytes: int):
        self.folder, self.capacity = Path(folder), capacity_bytes

    def start_empty(self) -> ShardCache:
        """Delete whatever an earlier attempt left (a preempted job's shards and part files)."""
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True)
        return self

    def open(self, address: str, size: int) -> int:
        """A read-only descriptor of the local copy of the shard at ``address`` (``size``
        bytes), downloaded first if it is not here. Once open, the copy stays readable through it
        even if the cache deletes it."""
        for _ in range(3):  # another process may delete the copy between our look and our open
            try:
                return os.open(self._local_copy(address, size), os.O_RDONLY)
            except FileNotFoundError:
                continue
        raise OSError(f"{address}: deleted from the cache {self.folder} as soon as fetched; raise --shard-cache-gb")

    def _local_copy(self, address: str, size: int) -> str:
        final = self.folder / address[len(SCHEME):].replace("/", "--")
        try:
            os.utime(final)  # read now: the last to be evicted
            return str(final)
        except FileNotFoundError:
            pass
        self.folder.mkdir(parents=True, exist_ok=True)
        with _locked(self.folder / f"{final.name}.lock"):
            if final.exists():  # another process of this rank fetched it meanwhile
                return str(final)
            part = self.folder / f"{final.name}.part-{os.getpid()}"
            try:
                download(address, str(part))
                if part.stat().st_size != size:
                    raise OSError(f"{address}: {part.stat().st_size} bytes arrived, the index says {size}")
                with _locked(self.folder / ".lock"):
                    self._make_room(size)
                    os.replace(part, final)
                    with open(self.folder / self.DOWNLOADS, "a") as log:
                        log.write(f"{address} {size}\n")
            finally:
                part.unlink(missing_ok=True)
        return str(final)

    def _make_room(self, size: int) -> None:
        shards = sorted((entry.stat().st_mtime, entry) for entry in self.folder.iterdir()
                        if entry.is_file() and entry.suffix == ".tar")
        used = sum(entry.stat().st_size for _, entry in shards)
        for _, entry in shards:
            if used + size <= self.capacity:
                break
            used -= entry.stat().st_size
            entry.unlink(missing_ok=True)

    def downloads(self) -> list[tuple[str, int]]:
        """(address, bytes) of every shard downloaded since :meth:`start_empty`, in order."""
        log = self.folder / self.DOWNLOADS
        if not log.exists():
            return []
        return [(name, int(size)) for name, size in (line.split() for line in log.read_text().splitlines())]
