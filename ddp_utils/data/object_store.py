"""Shards in an S3-compatible object store (``--data-dir s3://BUCKET/PREFIX``): the requests,
through boto3, which reads the endpoint and the credentials from the standard AWS variables and
files (nothing here stores them; messages mask them: ``runtime.logs.masked``).

A shard is one GET (:func:`fetch`) pinned to the version the pre-flight listed (its VersionId, else
If-Match on its ETag, else the index's sha256), continued with a ranged GET when cut short. A fault
that outlasts botocore's retries is waited out (:class:`Patience`) until ``--store-timeout`` from
the request's start, then raised as one line whose class (:data:`STORE_FAULTS`) names what the user
does: :class:`StoreUnavailable` exits 75 (worth a restart), every other exits 2. Why, and store by
store: docs/data.md, "Shards in an object store (S3)" and "What pins a shard, store by store".
"""
from __future__ import annotations

import email.utils
import hashlib
import importlib.util
import io
import logging
import math
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
# s: a response, or the next bytes of a body, that do not come within it: a transient fault. A
# request under way at its deadline ends at most BOTOCORE_ATTEMPTS x (connect + read timeout) later
READ_TIMEOUT_S = 10.0
CHUNK = 1 << 16           # bytes: the most one read of a body returns (it returns what has arrived)
BACKOFF_S = (0.2, 5.0)    # s: the first wait after a failure, doubling up to the second, each drawn at random below it
# The store's error codes (or bare HTTP statuses) by what they mean
RETRYABLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                   "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests", "429", "408"}
ACCESS_REFUSED_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
                        "InvalidToken", "AccountProblem", "Forbidden", "403"}
EXPIRED_CODES = {"ExpiredToken", "ExpiredTokenException", "TokenRefreshRequired"}
MISSING_CODES = {"NoSuchKey", "NoSuchVersion", "404"}
PRECONDITION_CODES = {"PreconditionFailed", "412"}
RANGE_REFUSED_CODES = {"InvalidRange", "416"}


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
    it here (boto3 missing, or a urllib3 older than 2.2.1, whose responses cannot return what has
    arrived), or None."""
    shown, first = masked(address), address[len(SCHEME):].split("/", 1)[0]
    if importlib.util.find_spec("boto3") is None:
        return (f"{named} {shown}: reading an object store needs boto3, which is not installed; "
                f"pip install -r requirements-shards.txt")
    from urllib3.response import HTTPResponse

    if not hasattr(HTTPResponse, "read1"):
        return (f"{named} {shown}: reading an object store needs urllib3 2.2.1 or newer; "
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
_making = threading.Lock()  # boto3 does not make sessions and clients safely from several threads at once


def client():
    """This process's S3 client (a forked process makes its own: clients are not fork-safe).
    Its connection pool holds a connection for each download at once (``--shard-downloads``, at most 32)."""
    with _making:
        made = _clients.get(os.getpid())
        if made is None:
            made = _clients[os.getpid()] = _new_client()
        return made


def forget_client() -> None:
    """Drop this process's client: the next request makes a new one, which reads the endpoint and
    the credentials again (refreshed variables, profile files or role)."""
    with _making:
        _clients.pop(os.getpid(), None)


def _new_client():
    import boto3  # an optional requirement (requirements-shards.txt): imported only for s3:// data
    from botocore.config import Config

    for name in ("boto3", "botocore", "s3transfer", "urllib3"):  # their INFO lines are not the run's
        logging.getLogger(name).setLevel(logging.WARNING)
    # a session of its own: boto3's default one keeps the credentials it resolved first
    return boto3.session.Session().client("s3", config=Config(
        retries={"total_max_attempts": BOTOCORE_ATTEMPTS, "mode": "adaptive"}, connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=READ_TIMEOUT_S, max_pool_connections=32))


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
    """A shard (or index) the store did not give: one line naming the store, the object, the
    reason and what to fix, said by every rank together; its exit code is its class's. This
    class itself: a request the store refused for another reason (exit 2). ``last_fault``: the
    request's last exception, where one came."""

    exit_code_of_kind = EXIT_USAGE
    last_fault: Exception | None = None

    def __init__(self, address: str, reason: str, said: bool = False):
        self.address, self.reason = masked(address), masked(reason)
        super().__init__(self.describe(), said, self.exit_code_of_kind)

    def describe(self) -> str:
        return f"{self.address}: {self.reason}"

    def __reduce__(self):  # pickled whole (a worker's error, a rank's registry): its own arguments
        return type(self), (self.address, self.reason, self.said)


class StoreUnavailable(StoreError):
    """The store did not answer (unreachable, throttling, timeouts, server errors), or a shard
    did not arrive, within the run's patience: worth a restart (exit 75)."""

    exit_code_of_kind = EXIT_STORE

    def describe(self) -> str:
        return (f"{self.address}: the object store did not answer ({self.reason}; endpoint {endpoint()}); the run "
                f"stops to be started again once it answers (exit {EXIT_STORE})")


class AccessRefused(StoreError):
    """The store refused the credentials or the access (AccessDenied, a bad key or signature, a
    bare 403), or there were none (exit 2)."""

    def describe(self) -> str:
        return (f"{self.address}: the object store refused access ({self.reason}; endpoint {endpoint()}); check the "
                f"credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the machine's role) and "
                f"the bucket's policy")


class BucketMissing(StoreError):
    """The endpoint has no such bucket (exit 2)."""

    def describe(self) -> str:
        return (f"{self.address}: no such bucket at this endpoint ({self.reason}; endpoint {endpoint()}); check the "
                f"bucket's name in the address, and AWS_ENDPOINT_URL")


class ShardChanged(StoreError):
    """The object is not the version the run listed at its start (its ETag, size or bytes
    differ): the data changed under the run (exit 2)."""

    def describe(self) -> str:
        return (f"{self.address}: not the version this run listed at its start ({self.reason}); the data changed "
                f"under the run: put the listed version back, or start a new run on the new data")


class ShardMissing(ShardChanged):
    """The object (or the listed version of it) is gone from the store (exit 2)."""

    def describe(self) -> str:
        return (f"{self.address}: removed from the store since this run listed it ({self.reason}); the data changed "
                f"under the run: put it back, or start a new run on the new data")


class PinningRejected(StoreError):
    """The store answers 412 to If-Match with the very ETag it lists for the object (exit 2)."""

    def describe(self) -> str:
        return (f"{self.address}: the object store rejects If-Match ({self.reason}); add --no-store-if-match (each "
                f"shard is then checked against the ETag its answer carries)")


class CredentialsExpired(StoreError):
    """The credentials stayed expired, read again before every try, for the run's patience (exit 2)."""

    def describe(self) -> str:
        return (f"{self.address}: the credentials expired ({self.reason}, read again before each try; endpoint "
                f"{endpoint()}); refresh them (the AWS_* variables, the profile's files or the role)")


STORE_FAULTS = (StoreError, StoreUnavailable, AccessRefused, BucketMissing, ShardChanged, ShardMissing,
                PinningRejected, CredentialsExpired)


def failure_code(err: Exception) -> str:
    """The store's error code of a failed request (``SlowDown``, ``NoSuchKey``, a bare HTTP
    status, ...), or the exception's class name for a fault below HTTP (``EndpointConnectionError``, ...)."""
    response = getattr(err, "response", None) or {}
    return str(response.get("Error", {}).get("Code") or type(err).__name__)


def _status(err: Exception) -> int:
    return int((getattr(err, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def is_transient(err: Exception) -> bool:
    """Whether the same request may succeed later: the store or the network, not the address,
    the credentials or the data. (Expired credentials are not: they are read again first.)"""
    from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError
    from botocore.exceptions import ConnectionError as BotocoreConnectionError

    if isinstance(err, ClientError):
        code, status = failure_code(err), _status(err)
        if code in RETRYABLE_CODES:
            return True
        known = ACCESS_REFUSED_CODES | EXPIRED_CODES | MISSING_CODES | PRECONDITION_CODES | {"NoSuchBucket"}
        # another store's own code for a server fault or throttling (501: the store lacks the operation)
        return code not in known and (status in (408, 429) or (status >= 500 and status != 501))
    return isinstance(err, (BotocoreConnectionError, HTTPClientError, IncompleteReadError, ConnectionError,
                            TimeoutError)) or type(err).__module__.startswith("urllib3")


def store_fault(address: str, err: Exception) -> StoreError | None:
    """The fault a request that failed for good (not :func:`is_transient`) reports, or None
    for an error that is not the store's (the local disk, a bug): raised as it is."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

    code = failure_code(err)
    if code in ACCESS_REFUSED_CODES or isinstance(err, (NoCredentialsError, PartialCredentialsError)):
        return AccessRefused(address, code)
    if code == "NoSuchBucket":
        return BucketMissing(address, code)
    if code in MISSING_CODES:
        return ShardMissing(address, code)
    if isinstance(err, ClientError):
        said = str(err.response.get("Error", {}).get("Message") or "").splitlines()[:1]
        return StoreError(address, f"the object store refused the request ({code}{': ' + said[0][:200] if said else ''}; "
                                   f"endpoint {endpoint()}); check the address and AWS_ENDPOINT_URL")
    if isinstance(err, BotoCoreError):
        return StoreError(address, f"the request could not be made ({code}: {str(err)[:200]}); check the address, "
                                   f"AWS_ENDPOINT_URL and the AWS_* settings")
    return None


def describe_failure(address: str, err: Exception) -> str:
    """One line for a store that could not be reached at a first start (likely a wrong address
    or endpoint), never a credential."""
    return masked(f"{address}: the object store could not be reached ({failure_code(err)}; endpoint {endpoint()}); "
                  f"check the address and AWS_ENDPOINT_URL")


def retry_after(err: Exception) -> float:
    """Seconds the store asked to wait before the next request (its Retry-After header), or 0."""
    headers = (getattr(err, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPHeaders", {})
    value = str(headers.get("retry-after", "")).strip()
    if not value:
        return 0.0
    try:
        return max(0.0, float(value))
    except ValueError:
        try:  # an HTTP date
            return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return 0.0


@dataclass
class Patience:
    """How long a request may take, its faults and tries included, before it is reported:
    ``seconds`` from its start. A transient fault is met with the request again after a
    jittered, doubling wait (``BACKOFF_S``, or the store's Retry-After when longer), expired
    credentials by reading them again (a new client) first; a body must have arrived by then
    too. 0: the first fault is reported at once, and a transfer is bounded by ``READ_TIMEOUT_S``
    per read only. ``on_recovered(address, waited seconds, reason)`` is told when a request
    succeeds after failing."""

    seconds: float
    on_recovered: Callable[[str, float, str], None] | None = None

    def call(self, address: str, request: Callable[[float], T]) -> T:
        """``request(deadline)`` (the ``time.monotonic()`` by which what it asked for must have
        arrived; inf for none), sent again while it fails transiently and the time lasts. Raises
        the fault's :class:`StoreError` (:func:`store_fault`); any other error (the local disk's
        OSError) as it is."""
        started = time.monotonic()
        deadline = started + self.seconds if self.seconds > 0 else math.inf
        first_failure, tries, reason = None, 0, ""
        while True:
            try:
                result = request(deadline)
            except Exception as err:
                reason, expired = failure_code(err), failure_code(err) in EXPIRED_CODES
                if not (expired or is_transient(err)):
                    fault = store_fault(address, err)
                    if fault is None:
                        raise
                    raise fault from None
                if expired:
                    forget_client()
                now = time.monotonic()
                first_failure = now if first_failure is None else first_failure
                if now >= started + self.seconds:
                    fault = (CredentialsExpired if expired else StoreUnavailable)(
                        address, f"{reason}, for {now - started:.0f} s")
                    fault.last_fault = err
                    raise fault from None
                low, high = BACKOFF_S
                pause = max(random.uniform(0, min(high, low * 2 ** tries)), retry_after(err))
                time.sleep(min(pause, started + self.seconds - now))
                tries += 1
                continue
            if first_failure is not None and self.on_recovered is not None:
                self.on_recovered(address, time.monotonic() - first_failure, reason)
            return result


def _receive(response: dict, write: Callable[[bytes], object], deadline: float) -> bool:
    """Hands a GET's body to ``write`` as its bytes arrive; False when ``deadline`` passed before
    all of them came. Each read returns what has arrived (urllib3's ``read1``, on the response
    botocore's body wraps), so a body that trickles is seen at the deadline rather than after
    CHUNK bytes."""
    left = response.get("ContentLength", -1)  # what the store said it sends
    with response["Body"] as raw:  # botocore's StreamingBody gives its urllib3 response this way
        while block := raw.read1(CHUNK):
            write(block)
            left -= len(block)
            if left and time.monotonic() >= deadline:
                return False
    return True


def _amount(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.{2 if n < 10 * scale else 1}f} {unit}"
    return f"{n:.0f} B"


def too_slow(address: str, came: int, size: int, seconds: float, elapsed: float) -> StoreUnavailable:
    """The fault of an object that kept arriving but not in time."""
    return StoreUnavailable(address, f"not all of it within {seconds:g} s: {_amount(came)} of {_amount(size)} came, "
                                     f"at {_amount(came / max(elapsed, 1e-9))}/s")


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

        def request(deadline: float) -> bytes | None:
            started = time.monotonic()
            try:
                response = client().get_object(Bucket=self.bucket, Key=self.key(name))
            except ClientError as err:
                if failure_code(err) in ("NoSuchKey", "404"):
                    return None
                raise
            data = io.BytesIO()
            if not _receive(response, data.write, deadline):
                raise too_slow(address, data.tell(), response.get("ContentLength", 0), self.patience.seconds,
                               time.monotonic() - started)
            return data.getvalue()

        return self._patiently(address, request)

    def objects(self) -> dict[str, Listed]:
        """{name: what the listing gave} of every object below the prefix (one listing, paged):
        of each object's current version where the bucket keeps versions."""
        start = f"{self.prefix}/" if self.prefix else ""

        def listing(deadline: float) -> dict[str, Listed]:
            if self._keeps_versions():
                pages = client().get_paginator("list_object_versions").paginate(Bucket=self.bucket, Prefix=start)
                entries = (v for page in pages for v in page.get("Versions", []) if v.get("IsLatest"))
            else:
                pages = client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=start)
                entries = (entry for page in pages for entry in page.get("Contents", []))
            return {entry["Key"][len(start):]: Listed(entry["Size"], entry.get("ETag", ""),
                                                      entry.get("VersionId", ""))
                    for entry in entries}

        return self._patiently(self.address, listing)

    def _keeps_versions(self) -> bool:
        """Whether the bucket keeps versions (versioning Enabled or Suspended). A store that
        refuses to say (AccessDenied: a role without s3:GetBucketVersioning; NotImplemented) is
        taken for one that does not."""
        from botocore.exceptions import ClientError

        try:
            status = client().get_bucket_versioning(Bucket=self.bucket).get("Status", "")
        except ClientError as err:
            if is_transient(err):
                raise
            return False
        return status in ("Enabled", "Suspended")

    def _patiently(self, address: str, request: Callable[[float], T]) -> T:
        try:
            return self.patience.call(address, request)
        except StoreUnavailable as err:
            if self.patience.seconds > 0:
                raise
            raise UsageError(describe_failure(address, err.last_fault)) from None


def say_recovered(address: str, waited: float, reason: str) -> None:
    log.warning("%s: the object store did not answer for %.1f s (%s); it answers again and the run goes on",
                masked(address), waited, reason)


def _bare(etag: str) -> str:
    """An ETag as compared: without the quotes and the weak marker stores differ on."""
    return etag.strip().removeprefix("W/").strip('"')


def fetch(ref: ShardRef, to: str, patience: Patience, if_match: bool = True) -> int:
    """The object at ``ref.address`` into the local file ``to`` with one GET, its ``ref.size``
    bytes checked, pinned to the version the run listed: ``ref.version`` where there is one
    (``VersionId``), else ``ref.etag`` with If-Match (unless ``if_match`` is off), the answer's
    ETag compared with it either way; where the listing gave neither, the bytes are checked
    against ``ref.sha256`` as they arrive. A transfer cut short is continued where it stopped
    (a ranged GET of the rest) once the store answers again. The whole must have arrived within
    ``patience`` of the start (every try included), else it is :class:`StoreUnavailable`,
    whatever came. Returns the GETs sent (botocore's own retries of one are not counted).
    Raises the store's fault (:func:`store_fault`): :class:`ShardChanged` for another version,
    :class:`ShardMissing` for none, :class:`PinningRejected` for a store that rejects If-Match;
    an OSError of writing ``to`` as it is."""
    from botocore.exceptions import ClientError

    address, size = ref.address, ref.size
    bucket, key = split_address(address)
    pin = {"VersionId": ref.version} if ref.version else {"IfMatch": ref.etag} if ref.etag and if_match else {}
    digest = hashlib.sha256() if ref.sha256 and not (ref.etag or ref.version) else None  # nothing else pins it
    gets, started = 0, time.monotonic()
    with open(to, "wb"):  # a file of its own, empty
        pass

    def get(**extra):
        nonlocal gets
        gets += 1
        return client().get_object(Bucket=bucket, Key=key, **extra)

    def request(deadline: float) -> int:
        nonlocal digest
        with open(to, "r+b") as out:
            have = out.seek(0, os.SEEK_END)  # what earlier tries brought: asked for no more
            response = answer(have)
            if have and not response.get("ContentRange"):  # the whole object came: start over
                have = out.seek(0)
                out.truncate()
            if digest is not None and not have:
                digest = hashlib.sha256()

            def write(block: bytes) -> None:
                out.write(block)
                if digest is not None:
                    digest.update(block)

            arrived = _receive(response, write, deadline)
            written = out.tell()
        if not arrived:
            raise too_slow(address, written, size, patience.seconds, time.monotonic() - started)
        if written != size:  # urllib3 raises on a body cut short: this object is not the one indexed
            raise ShardChanged(address, f"{written:,} bytes arrived, the index says {size:,}")
        if digest is not None and digest.hexdigest() != ref.sha256:
            raise ShardChanged(address, "its bytes are not those the index was written with (sha256)")
        return gets

    def answer(have: int):
        """The GET of what is still missing, its answer's ETag compared with the listed one."""
        rest = {"Range": f"bytes={have}-"} if have else {}
        try:
            response = get(**pin, **rest)
        except ClientError as err:
            code = failure_code(err)
            if code in PRECONDITION_CODES and "IfMatch" in pin:
                raise _precondition_failed(address, bucket, key, ref.etag) from None
            if not (code in RANGE_REFUSED_CODES and rest and "IfMatch" in pin):
                raise
            # MinIO answers 416 to a Range with If-Match: ask without it (the answer's ETag, compared
            # below, pins it) rather than fetch again what came at every cut of a far network
            del pin["IfMatch"]
            try:
                response = get(**rest)
            except ClientError as again:
                if failure_code(again) not in RANGE_REFUSED_CODES:
                    raise
                raise ShardChanged(address, f"shorter than the {have:,} bytes that arrived") from None
        came = response.get("ETag", "")
        if ref.etag and came and _bare(came) != _bare(ref.etag):
            response["Body"].close()
            raise ShardChanged(address, f"ETag {ref.etag} listed, {came} now")
        return response

    return patience.call(address, request)


def _precondition_failed(address: str, bucket: str, key: str, etag: str) -> StoreError:
    """The fault of a 412 to If-Match: the object changed, or (its current ETag, one HEAD, is the
    listed one) the store rejects If-Match."""
    from botocore.exceptions import ClientError

    try:
        now = client().head_object(Bucket=bucket, Key=key).get("ETag", "")
    except ClientError as err:
        if failure_code(err) in MISSING_CODES:
            return ShardMissing(address, failure_code(err))
        raise
    if _bare(now) == _bare(etag):
        return PinningRejected(address, f"412 Precondition Failed to If-Match {etag}, the ETag it lists for the object")
    return ShardChanged(address, f"ETag {etag} listed, {now} now")
