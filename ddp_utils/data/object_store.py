"""Shards in an S3-compatible object store (``--data-dir s3://BUCKET/PREFIX``): the requests.

The bucket holds what ``write_shards.py`` wrote (``PREFIX/train/index.json``, ...), copied as it
is (``aws s3 sync DST s3://BUCKET/PREFIX``). Access goes through boto3, the AWS SDK, which reads
the endpoint and the credentials from the standard variables and files (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ...): nothing here stores
them, and no message repeats one (``runtime.logs.masked``).

Requests a store can serve: a shard is one GET (:func:`fetch`; the index knows its size, so no
HEAD, and no ranged parts: several shards download at once instead, ``shard_cache.ReadAhead``),
pinned to the version the pre-flight listed (``If-Match`` on its ETag); a transfer cut short is
continued with a ranged GET of the rest. botocore's adaptive retry mode sends a request that met
throttling (503 SlowDown) or a transient error once more and slows the client down on
throttling; a fault that outlasts it is waited out here (:class:`Patience`, which logs how long),
with backoff, for up to ``--store-timeout`` seconds. Then it is reported as one line:
:class:`StoreUnavailable` (exit 75, worth a restart) or :class:`ShardChanged` (exit 2: the data
changed under the run).
"""
from __future__ import annotations

import importlib.util
import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from ..config import UsageError
from ..runtime.logs import masked
from ..runtime.stopping import EXIT_STORE, EXIT_USAGE

SCHEME = "s3://"
T = TypeVar("T")
log = logging.getLogger("train")

# botocore's own tries of one request (the first included), adaptive mode: a retry for a passing
# fault; longer ones are Patience's, which says how long it waited
BOTOCORE_ATTEMPTS = 2
CONNECT_TIMEOUT_S = 5.0   # s: connecting to the endpoint
READ_TIMEOUT_S = 20.0     # s: a response, or the next bytes of a body, that does not come is a transient fault
CHUNK = 1 << 16           # bytes read and written at a time: what a transfer cut short keeps
BACKOFF_S = (0.2, 5.0)    # s: the first wait after a failure, doubling up to the second, each drawn at random below it
# What a request that failed this way may get if it is sent again: throttling and server-side faults
RETRYABLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                   "InternalError", "ServiceUnavailable", "503", "500", "502", "504", "ExpiredToken",
                   "RequestLimitExceeded", "TooManyRequests", "429"}


def is_object_store(location: str) -> bool:
    return location.startswith(SCHEME)


def split_address(address: str) -> tuple[str, str]:
    """``s3://BUCKET/PREFIX`` -> (BUCKET, PREFIX without its slashes at either end)."""
    bucket, _, prefix = address[len(SCHEME):].partition("/")
    return bucket, prefix.strip("/")


def endpoint() -> str:
    """The endpoint requests go to, as a message may name it (masked)."""
    return masked(os.environ.get("AWS_ENDPOINT_URL", "AWS's own"))


def check_address(address: str, named: str = "--data-dir") -> str | None:
    """A one-line description of what is wrong with an ``s3://`` address itself, or with reading
    it here (boto3 missing), or None."""
    shown, first = masked(address), address[len(SCHEME):].split("/", 1)[0]
    if importlib.util.find_spec("boto3") is None:
        return (f"{named} {shown}: reading an object store needs boto3, which is not installed; "
                f"pip install -r requirements-shards.txt")
    if "@" in first or (":" in first and "@" in address):  # a secret may hold "/": its "@" then comes later
        return (f"{named} {shown}: credentials do not belong in the address; set AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) instead")
    if not first:
        return f"{named} {shown}: no bucket; write s3://BUCKET/PREFIX"
    if ":" in first:
        return f"{named} {shown}: a bucket's name has no ':'; write s3://BUCKET/PREFIX (the endpoint goes in AWS_ENDPOINT_URL)"
    return None


_clients: dict[int, object] = {}
_making = threading.Lock()  # boto3's default session does not make clients safely from several threads at once


def client():
    """This process's S3 client (a forked process makes its own: clients are not fork-safe).
    Its connection pool holds a connection for each download at once (``--shard-downloads``, at most 32)."""
    with _making:
        made = _clients.get(os.getpid())
        if made is None:
            made = _clients[os.getpid()] = _new_client()
        return made


def _new_client():
    import boto3  # an optional requirement (requirements-shards.txt): imported only for s3:// data
    from botocore.config import Config

    for name in ("boto3", "botocore", "s3transfer", "urllib3"):  # their INFO lines are not the run's
        logging.getLogger(name).setLevel(logging.WARNING)
    return boto3.client("s3", config=Config(retries={"max_attempts": BOTOCORE_ATTEMPTS, "mode": "adaptive"},
                                            connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                                            max_pool_connections=32))


@dataclass(frozen=True)
class Listed:
    """An object as its listing gave it: what pins the version a run reads."""

    size: int          # bytes
    etag: str = ""     # the store's ETag ("" where it gave none, and on a file system)
    version: str = ""  # the VersionId, where the bucket keeps versions ("" otherwise)


@dataclass(frozen=True)
class ShardRef:
    """A shard as a run reads it: its address, its size (the index's), what the listing gave
    (``etag``, ``version``) and the index's ``sha256`` of its bytes ("": unknown)."""

    address: str
    size: int
    etag: str = ""
    version: str = ""
    sha256: str = ""


# ----------------------------------------------------------------------------- faults
class StoreError(UsageError):
    """A shard (or index) the store did not give: one line naming the store, the object and the
    reason, said by every rank together; its exit code is the kind's."""

    exit_code_of_kind = EXIT_USAGE

    def __init__(self, address: str, reason: str, said: bool = False):
        self.address, self.reason = masked(address), masked(reason)
        super().__init__(self.describe(), said, self.exit_code_of_kind)

    def describe(self) -> str:
        return f"{self.address}: {self.reason}"

    def __reduce__(self):  # pickled whole (a worker's error, a rank's registry): its own arguments
        return type(self), (self.address, self.reason, self.said)


class StoreUnavailable(StoreError):
    """The store did not answer (unreachable, throttling, timeouts, server errors) for longer than
    the run's patience, or the local cache could not be written: worth a restart (exit 75).
    ``last_fault``: the request's last exception, where one came."""

    exit_code_of_kind = EXIT_STORE
    last_fault: Exception | None = None

    def describe(self) -> str:
        return (f"{self.address}: the object store did not answer ({self.reason}; endpoint {endpoint()}); the run "
                f"stops to be started again once it answers (exit {EXIT_STORE})")


class ShardChanged(StoreError):
    """The object is not the version the run listed at its start (its ETag differs): the data
    changed under the run (exit 2)."""

    def describe(self) -> str:
        return (f"{self.address}: not the version this run listed at its start ({self.reason}); the data changed "
                f"under the run: put the listed version back, or start a new run on the new data")


def failure_code(err: Exception) -> str:
    """The store's error code of a failed request (``SlowDown``, ``NoSuchKey``, ...), or the
    exception's class name for a fault below HTTP (``EndpointConnectionError``, ...)."""
    response = getattr(err, "response", None) or {}
    return str(response.get("Error", {}).get("Code") or type(err).__name__)


def is_transient(err: Exception) -> bool:
    """Whether the same request may succeed later: the store or the network, not the address."""
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(err, ClientError):
        return failure_code(err) in RETRYABLE_CODES
    return isinstance(err, (BotoCoreError, ConnectionError, TimeoutError)) or type(err).__module__.startswith(
        "urllib3")


def describe_failure(address: str, err: Exception) -> str:
    """One line for a request that failed for good (a missing bucket, refused credentials, an
    unreachable endpoint at a first start): what failed and where to look, never a credential."""
    return masked(f"{address}: the object store refused or could not be reached ({failure_code(err)}; endpoint "
                  f"{endpoint()}); check the address, AWS_ENDPOINT_URL and the credentials (AWS_ACCESS_KEY_ID, "
                  f"AWS_SECRET_ACCESS_KEY or AWS_PROFILE)")


@dataclass
class Patience:
    """How long a request may keep failing with transient faults before the fault is reported:
    ``seconds`` from its first failure, the request sent again after a jittered, doubling wait
    (``BACKOFF_S``). ``on_recovered(address, waited seconds, reason)`` is told when a request
    succeeds after failing."""

    seconds: float
    on_recovered: Callable[[str, float, str], None] | None = None

    def call(self, address: str, request: Callable[[], T]) -> T:
        """``request()``, sent again while it fails transiently and patience lasts; raises
        :class:`StoreUnavailable` after that, and whatever else it raises at once."""
        first_failure, tries, reason = None, 0, ""
        while True:
            try:
                result = request()
            except Exception as err:
                if not is_transient(err):
                    raise
                now = time.monotonic()
                first_failure = now if first_failure is None else first_failure
                waited, reason = now - first_failure, failure_code(err)
                if waited >= self.seconds:
                    unavailable = StoreUnavailable(address, f"{reason}, for {waited:.0f} s")
                    unavailable.last_fault = err
                    raise unavailable from None
                low, high = BACKOFF_S
                time.sleep(min(random.uniform(0, min(high, low * 2 ** tries)), self.seconds - waited))
                tries += 1
                continue
            if first_failure is not None and self.on_recovered is not None:
                self.on_recovered(address, time.monotonic() - first_failure, reason)
            return result


# ----------------------------------------------------------------------------- requests
class StorePrefix:
    """The objects below one ``s3://BUCKET/PREFIX``, read as a folder's files are. A transient
    fault is waited out for ``patience`` seconds (0: reported at once, after botocore's retries,
    as bad input naming what to check)."""

    def __init__(self, address: str, patience: float = 0.0):
        self.address = address.rstrip("/")
        self.bucket, self.prefix = split_address(address)
        self.patience = Patience(patience, on_recovered=say_recovered)

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def read(self, name: str) -> bytes | None:
        """The whole object ``PREFIX/name``; None if there is none."""
        from botocore.exceptions import ClientError

        address = f"{self.address}/{name}"
        try:
            return self._patiently(address, lambda: client().get_object(Bucket=self.bucket, Key=self.key(name))[
                "Body"].read())
        except ClientError:  # the one kind _patiently lets through: no such object
            return None

    def objects(self) -> dict[str, Listed]:
        """{name: what the listing gave} of every object directly below the prefix (one listing, paged)."""
        start = f"{self.prefix}/" if self.prefix else ""

        def listing() -> dict[str, Listed]:
            found = {}
            for page in client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start):
                for entry in page.get("Contents", []):
                    found[entry["Key"][len(start):]] = Listed(entry["Size"], entry["ETag"])
            return found

        return self._patiently(self.address, listing)

    def _patiently(self, address: str, request: Callable[[], T]) -> T:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self.patience.call(address, request)
        except StoreUnavailable as err:
            if self.patience.seconds > 0:
                raise
            raise UsageError(describe_failure(address, err.last_fault)) from None
        except (BotoCoreError, ClientError) as err:
            if isinstance(err, ClientError) and failure_code(err) in ("NoSuchKey", "404"):
                raise
            raise UsageError(describe_failure(address, err)) from None


def say_recovered(address: str, waited: float, reason: str) -> None:
    log.warning("%s: the object store did not answer for %.1f s (%s); it answers again and the run goes on",
                masked(address), waited, reason)


def fetch(ref: ShardRef, to: str, patience: Patience, if_match: bool = True) -> int:
    """The object at ``ref.address`` into the local file ``to`` with one GET (pinned to
    ``ref.etag``, the version the run listed, with If-Match unless ``if_match`` is off; "" pins
    nothing), its ``ref.size`` bytes checked. A transfer cut short
    is continued where it stopped (a ranged GET of the rest) once the store answers again
    (``patience``). Returns the GETs sent (botocore's own retries of one are not counted). Raises
    :class:`ShardChanged` if the store holds another version (or an object of another size than
    the index says), :class:`StoreUnavailable` when patience runs out or the file cannot be
    written."""
    address, size, etag = ref.address, ref.size, ref.etag
    bucket, key = split_address(address)
    gets = 0
    with open(to, "wb"):  # a file of its own, empty
        pass

    def request() -> int:
        nonlocal gets
        gets += 1
        have = os.path.getsize(to)  # what earlier tries brought: asked for no more
        extra = {"IfMatch": etag} if etag and if_match else {}
        if have:
            extra["Range"] = f"bytes={have}-"
        try:
            response = client().get_object(Bucket=bucket, Key=key, **extra)
        except Exception as err:
            if failure_code(err) in ("PreconditionFailed", "412"):
                raise ShardChanged(address, f"ETag {etag} listed, another one now") from None
            raise
        body = response["Body"]
        if have and not response.get("ContentRange"):  # the whole object came: start over
            have = 0
        written = have
        try:
            with open(to, "r+b") as out:
                out.seek(have)
                out.truncate()
                for block in body.iter_chunks(CHUNK):
                    out.write(block)
                    written += len(block)
        except OSError as err:  # the cache's disk: full, or gone
            raise StoreUnavailable(address, f"the local cache could not be written: {err.strerror or err}") from None
        finally:
            body.close()
        if written != size:  # botocore raises on a body cut short: this object is not the one indexed
            raise ShardChanged(address, f"{written:,} bytes arrived, the index says {size:,}")
        return gets

    return patience.call(address, request)
