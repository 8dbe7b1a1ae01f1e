"""The object store's faults and dialects, request by request, against moto's S3 server on
localhost and the proxy of tests/far_network.py (which answers, drops headers and rewrites
bodies where moto cannot play a store's part):

* no credential in any line: a secret in the real AWS form (40 characters with "/" and "+"),
  typed or URL-encoded, in a shards address, an image-folder address, the endpoint, botocore's
  own text and a logged warning, is repeated by no line, through the real CLI as well;
* each fault its own class and exit: access refused, no such bucket, a shard deleted or a version
  gone, a store that rejects If-Match (exit 2 at once, one line saying what to fix); throttling at
  the store's pace (Retry-After) and outages beyond the patience (exit 75); expired credentials read
  again (a refreshed credentials file continues the fetch), else exit 2; the cache's disk error out
  of ``fetch`` as it is;
* a shard that trickles in is an outage at the deadline, naming what came;
* dialects: a listing without ETags (the sha256 checked as the bytes arrive), a store that ignores
  If-Match (the answer's ETag), one that answers 416 to a ranged If-Match (continued without it),
  a versioned bucket (each shard pinned to its VersionId, whatever is written since)."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import threading
import time
from urllib.parse import quote

import boto3
import pytest
from far_network import Rewrite
from helpers import REPO, cli_env, free_port, s3_error, wait_until

from ddp_utils.data import object_store
from ddp_utils.data.object_store import (
    AccessRefused,
    BucketMissing,
    CredentialsExpired,
    Patience,
    PinningRejected,
    ShardChanged,
    ShardMissing,
    StoreError,
    StoreUnavailable,
    check_address,
    fetch,
    forget_client,
)
from ddp_utils.data.sets import check_data_dir
from ddp_utils.data.shards import INDEX, ShardIndex
from ddp_utils.runtime.logs import setup_logging
from ddp_utils.runtime.stopping import EXIT_STORE, EXIT_USAGE

# Credentials in the real AWS form (AWS's documented example pair): about half of real secret keys hold "/" or "+"
KEY, SECRET = "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCY+EXAMPLEKEY"
ENCODED = quote(SECRET, safe="")  # wJalrXUtnFEMI%2FK7MDENG%2FbPxRfiCY%2BEXAMPLEKEY
PIECES = [KEY, SECRET, ENCODED, *(piece for piece in re.split(r"[/+]", SECRET) if len(piece) >= 4)]


def leaked(text: str) -> list[str]:
    """The key, the secret (either form) or any of its pieces of 4 characters or more in ``text``."""
    return [piece for piece in PIECES if piece in text]


def path_of(address: str) -> str:
    return "/" + address.removeprefix("s3://")


def logged(proxy, address: str) -> list:
    """The proxy's requests for ``address`` so far (the session's proxy: other tests' included)."""
    return [r for r in proxy.requests if r.path == path_of(address)]


def logged_since(proxy, address: str, before: int, count: int) -> list:
    """The proxy's requests for ``address`` after the first ``before``, once ``count`` of them are
    logged (a request is logged once its answer was sent whole, a moment after the client read it)."""
    assert wait_until(lambda: len(logged(proxy, address)) >= before + count, 5)
    return logged(proxy, address)[before:]


def copy_split(written, prefix: str, bucket: str = "ddp-test") -> str:
    """The training split of ``written`` uploaded below ``prefix``: its ``s3://`` address."""
    client = boto3.client("s3")
    for path in (written / "train").iterdir():
        client.upload_file(str(path), bucket, f"{prefix}/train/{path.name}")
    return f"s3://{bucket}/{prefix}/train"


# ----------------------------------------------------------------------------- no credential in any line
def test_a_secret_with_slash_and_plus_is_repeated_by_no_line(s3_server, monkeypatch, capsys):
    """Every form the issue found repeated, in process: the shards address and the image-folder
    address as typed and URL-encoded, the endpoint as typed in the unreachable-store line,
    botocore's own text quoting that endpoint, and warnings through the logger."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    for secret in (SECRET, ENCODED):
        address = f"s3://{KEY}:{secret}@ddp-test/imagenet-like"
        assert check_data_dir("shards", address, False) == (
            "--data-dir s3://***@ddp-test/imagenet-like: credentials do not belong in the address; set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) instead")
        assert check_data_dir("imagefolder", address, False).startswith(
            "--data-dir s3://***@ddp-test/imagenet-like: an object store holds shards only")

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{KEY}:{SECRET}@127.0.0.1:1")
    fault = StoreUnavailable("s3://b/x/train/shard-000000.tar", "EndpointConnectionError, for 3 s")
    assert "(EndpointConnectionError, for 3 s; endpoint http://***@127.0.0.1:1)" in str(fault) and not leaked(str(fault))
    forget_client()  # a client for this endpoint: botocore refuses it, quoting it
    with pytest.raises(StoreError) as refused:
        ShardIndex.read("s3://ddp-test/imagenet-like/train")
    assert "Custom endpoint `http://***@127.0.0.1:1` was not a valid URI" in str(refused.value)
    assert refused.value.exit_code == EXIT_USAGE and not leaked(str(refused.value))
    forget_client()

    log = setup_logging(0)
    log.warning("reading %s failed", f"s3://{KEY}:{ENCODED}@b/x/shard-000001.tar")
    log.warning("the store said: %s", SECRET)  # a credential quoted bare, as an exception's text may
    try:
        raise ValueError(f"Port could not be cast to integer value as '{SECRET.split('/')[0]}'")
    except ValueError:
        log.exception("a traceback")
    said = capsys.readouterr().out
    assert "reading s3://***@b/x/shard-000001.tar failed" in said and "the store said: ***" in said
    assert "as '***'" in said and not leaked(said), said


@pytest.mark.parametrize("dataset, data_dir, endpoint", [
    ("shards", f"s3://{KEY}:{SECRET}@ddp-test/imagenet-like", None),
    ("imagefolder", f"s3://{KEY}:{ENCODED}@ddp-test/imagenet-like", None),
    ("shards", "s3://ddp-test/imagenet-like", f"http://{KEY}:{ENCODED}@127.0.0.1:PORT"),
])
def test_the_cli_repeats_no_piece_of_a_secret(dataset, data_dir, endpoint, s3_server, tmp_path):
    """The real CLI's --check: the shards address and the image-folder address refused, and a
    store that cannot be reached at an endpoint carrying the secret, each one line, exit 2."""
    env = {**s3_server, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET}
    if endpoint:
        endpoint = endpoint.replace("PORT", str(free_port()))
        env["AWS_ENDPOINT_URL"] = endpoint
    proc = subprocess.run([sys.executable, str(REPO / "train_classifier.py"), "--dataset", dataset, "--data-dir",
                           data_dir, "--device", "cpu", "--check", "--out", str(tmp_path / "run")], cwd=REPO,
                          env=cli_env(env), capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_USAGE and proc.stderr.count("\n") == 1, proc.stderr
    assert not leaked(proc.stdout + proc.stderr), proc.stdout + proc.stderr
    if endpoint:
        assert proc.stderr == (
            f"train_classifier.py: error: {data_dir}/train/index.json: the object store could not be reached "
            f"(EndpointConnectionError; endpoint http://***@{endpoint.rpartition('@')[2]}); check the address and "
            f"AWS_ENDPOINT_URL\n")
    else:
        assert proc.stderr.startswith("train_classifier.py: error: --data-dir s3://***@ddp-test/imagenet-like: ")


def test_an_old_urllib3_is_refused_in_one_line(monkeypatch):
    """Without read1 a body that trickles could not be cut at the deadline."""
    from urllib3.response import HTTPResponse

    for kind in HTTPResponse.__mro__:  # as urllib3 2.1 has it: no read1 on the response or its bases
        if "read1" in vars(kind):
            monkeypatch.delattr(kind, "read1")
    assert check_address("s3://bucket/x") == ("--data-dir s3://bucket/x: reading an object store needs urllib3 "
                                              "2.2.1 or newer; pip install -r requirements-shards.txt")


# ----------------------------------------------------------------------------- each fault its own class
@pytest.mark.parametrize("code", ["AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled", ""])
def test_access_refused_is_named_at_once_with_exit_2(code, bucket, proxied, tmp_path):
    """The proxy refuses every request (a bare 403 for ""): a first start's pre-flight, a
    restarted attempt's and a shard's download each say it in one line at once, never "the
    store did not answer"; nothing is sent again."""
    ref = ShardIndex.read(f"{bucket}/train").refs()[0]
    proxied.rewrite(lambda seen: s3_error(403, code))
    said = (rf"the object store refused access \({code or '403'}; endpoint http://127.0.0.1:\d+\); check the credentials "
            r"\(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the machine's role\) and the bucket's "
            r"policy$")
    for patience in (0, 30):
        started = time.monotonic()
        with pytest.raises(AccessRefused, match=rf"^{bucket}/train/index.json: {said}") as refused:
            ShardIndex.read(f"{bucket}/train", patience=patience)
        assert refused.value.exit_code == EXIT_USAGE and time.monotonic() - started < 2
    before = len(logged(proxied, ref.address))
    with pytest.raises(AccessRefused, match=rf"^{ref.address}: {said}"):
        fetch(ref, str(tmp_path / "shard"), Patience(30))
    time.sleep(0.2)
    assert len(logged_since(proxied, ref.address, before, 1)) == 1


def test_a_missing_bucket_and_a_deleted_shard_are_exit_2_at_once(bucket, written, proxied, tmp_path):
    client = boto3.client("s3")
    missing = ShardIndex.read(f"{bucket}/train").refs()[0]
    missing = dataclasses.replace(missing, address=missing.address.replace("ddp-test", "no-such-bucket-here"))
    started = time.monotonic()
    with pytest.raises(BucketMissing, match=r"^s3://no-such-bucket-here/imagenet-like/train/shard-000000.tar: no such "
                                            r"bucket at this endpoint \(NoSuchBucket; endpoint http://127.0.0.1:\d+\); "
                                            r"check the bucket's name in the address, and AWS_ENDPOINT_URL$"):
        fetch(missing, str(tmp_path / "a"), Patience(30))
    address = copy_split(written, "deleted")
    ref = ShardIndex.read(address).refs()[0]
    client.delete_object(Bucket="ddp-test", Key=f"deleted/train/{ref.address.rpartition('/')[2]}")
    with pytest.raises(ShardMissing, match=rf"^{ref.address}: removed from the store since this run listed it "
                                           r"\(NoSuchKey\); the data changed under the run: put it back, or start a "
                                           r"new run on the new data$") as missing_shard:
        fetch(ref, str(tmp_path / "b"), Patience(30))
    assert missing_shard.value.exit_code == EXIT_USAGE and time.monotonic() - started < 3
    time.sleep(0.2)
    gets = [r.status for r in logged_since(proxied, ref.address, 0, 3) if r.method == "GET"]
    assert gets == [404]  # not sent again (before it: the copy's upload, its deletion)


def test_throttling_is_waited_out_at_the_stores_pace_and_beyond_the_patience_is_exit_75(bucket, written, proxied,
                                                                                        tmp_path):
    """A 503 with Retry-After: 2 to the first try (botocore's two sends): the next try waits the
    2 s the store asked for (the backoff alone waits below 0.2 s; ServiceUnavailable rather than
    SlowDown, after which botocore's adaptive mode paces its own sends too), and the wait is logged
    when the store answers. SlowDown to every try: exit 75 once the patience is over."""
    ref = ShardIndex.read(f"{bucket}/train").refs()[0]
    throttled, waits = [], []

    def slow_down(seen):
        if seen.path == path_of(ref.address) and len(throttled) < 2:
            throttled.append(seen)
            return s3_error(503, "ServiceUnavailable", (("Retry-After", "2"),))
        return None

    proxied.rewrite(slow_down)
    before = len(logged(proxied, ref.address))
    fetch(ref, str(tmp_path / "a"), Patience(30, on_recovered=lambda *said: waits.append(said)))
    assert (tmp_path / "a").read_bytes() == (written / "train" / "shard-000000.tar").read_bytes()
    first, second, third = logged_since(proxied, ref.address, before, 3)
    assert (first.status, second.status, third.status) == (503, 503, 200)
    assert third.started - second.ended >= 1.9, (second, third)
    (said,) = waits
    assert said[0] == ref.address and said[1] >= 1.9 and said[2] == "ServiceUnavailable"

    proxied.rewrite(lambda seen: s3_error(503, "SlowDown"))
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match=rf"^{ref.address}: the object store did not answer \(SlowDown, for \d s; "
                                               r"endpoint http://127.0.0.1:\d+\); the run stops to be started again "
                                               r"once it answers \(exit 75\)$") as unavailable:
        fetch(ref, str(tmp_path / "b"), Patience(1.5))
    assert unavailable.value.exit_code == EXIT_STORE and 1.5 <= time.monotonic() - started < 5


def test_expired_credentials_are_read_again_so_a_refreshed_file_continues(bucket, written, proxied, tmp_path,
                                                                          monkeypatch):
    """The proxy answers ExpiredToken to every request signed with the old key: the fetch reads
    the credentials again before each try (a new client, a new session), and goes on with the new
    key once the credentials file holds it; a file never refreshed is exit 2 once the patience is
    over, naming the expired credentials."""
    ref = ShardIndex.read(f"{bucket}/train").refs()[0]
    old, new = "AKIAOLDEXPIREDKEY000", "AKIANEWREFRESHEDKEY0"
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    credentials = tmp_path / "credentials"
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))

    def credentials_of(key: str) -> None:
        credentials.write_text(f"[default]\naws_access_key_id = {key}\naws_secret_access_key = secret-of-{key}\n")

    credentials_of(old)
    signed = []

    def expired(seen):
        if seen.path != path_of(ref.address):
            return None
        signed.append(re.search(r"Credential=([^/]+)/", seen.headers["authorization"]).group(1))
        return s3_error(400, "ExpiredToken") if signed[-1] == old else None

    proxied.rewrite(expired)
    forget_client()
    refreshed = threading.Timer(1.0, credentials_of, (new,))
    refreshed.start()
    started = time.monotonic()
    fetch(ref, str(tmp_path / "a"), Patience(5))
    assert time.monotonic() - started >= 1.0 and (tmp_path / "a").read_bytes() == (
        written / "train" / "shard-000000.tar").read_bytes()
    assert signed[0] == old and signed[-1] == new and set(signed) == {old, new}, signed

    credentials_of(old)
    forget_client()
    with pytest.raises(CredentialsExpired, match=rf"^{ref.address}: the credentials expired \(ExpiredToken, for \d s, "
                                                 r"read again before each try; endpoint http://127.0.0.1:\d+\); refresh "
                                                 r"them \(the AWS_\* variables, the profile's files or the role\)$") as err:
        fetch(ref, str(tmp_path / "b"), Patience(1.5))
    assert err.value.exit_code == EXIT_USAGE


def test_a_cache_disk_error_comes_out_of_fetch_as_it_is(bucket, proxied):
    """A full disk is the cache's to report (shard_cache.NodeCache), not an outage: one GET, then
    the OSError itself."""
    ref = ShardIndex.read(f"{bucket}/train").refs()[0]
    sent = []
    proxied.rewrite(lambda seen: sent.append(seen.method) if seen.path == path_of(ref.address) else None)
    with pytest.raises(OSError, match="No space left on device"):
        fetch(ref, "/dev/full", Patience(30))
    assert sent == ["GET"]


# ----------------------------------------------------------------------------- a slow store is an outage
def test_a_shard_that_trickles_in_is_an_outage_at_the_deadline(bucket, proxied, tmp_path, monkeypatch):
    """300 bytes a second (the proxy sends them in 15-byte pieces): a shard and a restarted
    attempt's index each stop at the patience, 2 s, not after a read of 64 kB, naming what came."""
    monkeypatch.setattr(object_store, "READ_TIMEOUT_S", 1.0)  # the bound: the patience and one read
    forget_client()
    ref = ShardIndex.read(f"{bucket}/train").refs()[0]
    proxied.set(bytes_per_s=300)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match=rf"^{ref.address}: the object store did not answer \(not all of it "
                                               r"within 2 s: (\d+) B of 522.2 kB came, at (\d+) B/s; endpoint "
                                               r"http://127.0.0.1:\d+\); the run stops") as slow:
        fetch(ref, str(tmp_path / "a"), Patience(2))
    assert 2 <= time.monotonic() - started < 2 + object_store.READ_TIMEOUT_S
    came, rate = map(int, re.search(r"(\d+) B of .* at (\d+) B/s", str(slow.value)).groups())
    assert 0 < came < 600 and came == (tmp_path / "a").stat().st_size and rate < 300
    assert slow.value.exit_code == EXIT_STORE
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match=rf"^{bucket}/val/{INDEX}: the object store did not answer \(not all "
                                               r"of it within 2 s: \d+ B of \d+ B came"):
        ShardIndex.read(f"{bucket}/val", patience=2)
    assert time.monotonic() - started < 2 + object_store.READ_TIMEOUT_S


class _Blocks:
    """A GET's body as botocore's StreamingBody gives its raw response: ``blocks``, each read
    after its pause (s)."""

    def __init__(self, blocks: list[tuple[float, bytes]]):
        self.blocks = blocks

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def read1(self, size: int) -> bytes:
        if not self.blocks:
            return b""
        pause, block = self.blocks.pop(0)
        time.sleep(pause)
        return block


def test_the_deadline_cuts_a_body_still_arriving_not_one_whose_last_bytes_came(tmp_path, monkeypatch):
    """The deadline passes during a body's reads: the last of its announced bytes arriving just
    after it completes the shard; any other read after it stops the fetch."""
    data = b"0123456789"
    ref = object_store.ShardRef("s3://b/p/shard-000000.tar", len(data), etag='"e"')

    class Store:
        def __init__(self, blocks):
            self.blocks = blocks

        def get_object(self, **request):
            return {"ContentLength": len(data), "ETag": '"e"', "Body": _Blocks(list(self.blocks))}

    monkeypatch.setattr(object_store, "client", lambda: Store([(0, data[:6]), (0.3, data[6:])]))
    assert fetch(ref, str(tmp_path / "a"), Patience(0.1)) == 1 and (tmp_path / "a").read_bytes() == data
    monkeypatch.setattr(object_store, "client", lambda: Store([(0, data[:3]), (0.3, data[3:6]), (0, data[6:])]))
    with pytest.raises(StoreUnavailable, match=r"\(not all of it within 0.1 s: 6 B of 10 B came, at \d+ B/s;"):
        fetch(ref, str(tmp_path / "b"), Patience(0.1))


# ----------------------------------------------------------------------------- dialects
def test_a_listing_without_etags_is_checked_against_the_index_sha256_as_it_arrives(written, proxied, tmp_path):
    address = copy_split(written, "no-etags")
    proxied.rewrite(lambda seen: Rewrite(body=lambda xml: re.sub(rb"<ETag>[^<]*</ETag>", b"", xml))
                    if "list-type=2" in seen.query else None)
    index = ShardIndex.read(address)
    assert [index.listed[shard["name"]].etag for shard in index.shards] == [""] * len(index.shards)
    intact, rewritten = index.refs()[1], index.refs()[0]
    assert intact.sha256 and fetch(intact, str(tmp_path / "a"), Patience(30)) == 1
    assert (tmp_path / "a").read_bytes() == (written / "train" / index.shards[1]["name"]).read_bytes()
    original = (written / "train" / index.shards[0]["name"]).read_bytes()
    boto3.client("s3").put_object(Bucket="ddp-test", Key=f"no-etags/train/{index.shards[0]['name']}",
                                  Body=original[::-1])  # the same size, other bytes
    with pytest.raises(ShardChanged, match=rf"^{rewritten.address}: not the version this run listed at its start "
                                           r"\(its bytes are not those the index was written with \(sha256\)\)"):
        fetch(rewritten, str(tmp_path / "b"), Patience(30))


def test_a_store_that_ignores_if_match_is_caught_by_the_answers_etag(written, proxied, tmp_path):
    address = copy_split(written, "ignores-if-match")
    ref = ShardIndex.read(address).refs()[0]
    proxied.rewrite(lambda seen: Rewrite(drop=("If-Match",)) if seen.method == "GET" else None)
    name = ref.address.rpartition("/")[2]
    now = boto3.client("s3").put_object(Bucket="ddp-test", Key=f"ignores-if-match/train/{name}",
                                        Body=(written / "train" / name).read_bytes()[::-1])["ETag"]
    with pytest.raises(ShardChanged, match=rf"^{ref.address}: not the version this run listed at its start \(ETag "
                                           rf"{ref.etag} listed, {now} now\)"):
        fetch(ref, str(tmp_path / "a"), Patience(30))


def test_a_store_that_rejects_if_match_says_to_turn_it_off_and_then_the_answers_etag_pins(bucket, written, proxied,
                                                                                          tmp_path):
    """412 to any request with If-Match, as SeaweedFS answers: one HEAD finds the listed ETag
    current, so the line names --no-store-if-match; without If-Match the fetch succeeds, and
    another ETag in the answer is still refused."""
    ref = ShardIndex.read(f"{bucket}/train").refs()[0]
    proxied.rewrite(lambda seen: s3_error(412, "PreconditionFailed") if "if-match" in seen.headers else None)
    before = len(logged(proxied, ref.address))
    with pytest.raises(PinningRejected, match=rf"^{ref.address}: the object store rejects If-Match \(412 Precondition "
                                              rf"Failed to If-Match {ref.etag}, the ETag it lists for the object\); add "
                                              r"--no-store-if-match \(each shard is then checked against the ETag its "
                                              r"answer carries\)$") as rejected:
        fetch(ref, str(tmp_path / "a"), Patience(30))
    assert rejected.value.exit_code == EXIT_USAGE
    assert [(r.method, r.status) for r in logged_since(proxied, ref.address, before, 2)] == [
        ("GET", 412), ("HEAD", 200)]
    assert fetch(ref, str(tmp_path / "b"), Patience(30), if_match=False) == 1
    assert (tmp_path / "b").read_bytes() == (written / "train" / "shard-000000.tar").read_bytes()
    with pytest.raises(ShardChanged, match=rf"\(ETag \"stale\" listed, {ref.etag} now\)"):
        fetch(dataclasses.replace(ref, etag='"stale"'), str(tmp_path / "c"), Patience(30), if_match=False)


def test_a_416_to_a_ranged_if_match_continues_the_transfer_without_it(bucket, written, proxied, tmp_path):
    """MinIO's answer to the rest of a transfer cut short, asked for with If-Match: the rest is
    asked for again without it (the answer's ETag compared), not the whole shard again."""
    ref = ShardIndex.read(f"{bucket}/train").refs()[0]
    ranged = []

    def no_ranged_if_match(seen):
        if seen.path != path_of(ref.address) or "range" not in seen.headers:
            return None
        ranged.append("if-match" in seen.headers)
        return s3_error(416, "InvalidRange") if ranged[-1] else None

    proxied.rewrite(no_ranged_if_match)
    before = len(logged(proxied, ref.address))
    proxied.set(bytes_per_s=300_000)
    threading.Timer(0.6, proxied.cut, (1.0,)).start()  # the body cut part way
    assert fetch(ref, str(tmp_path / "a"), Patience(30)) >= 3  # the cut GET, (any refused during the cut,) the 416, the rest
    assert (tmp_path / "a").read_bytes() == (written / "train" / "shard-000000.tar").read_bytes()
    assert ranged == [True, False]
    (refused, rest) = logged_since(proxied, ref.address, before, 2)  # the cut GET was not answered whole
    assert refused.status == 416 and rest.status == 206 and 0 < rest.response_bytes < ref.size


def test_a_versioned_bucket_pins_each_shard_to_its_version(written, proxied, s3_server, tmp_path):
    """A bucket that keeps versions is listed with its versions: each shard's GET names the
    VersionId listed, so a shard overwritten mid-read still comes as listed, even continued after
    a cut; the listed version deleted is a shard missing."""
    direct = boto3.client("s3", endpoint_url=s3_server["AWS_ENDPOINT_URL"])  # past the proxy, which is cut below
    direct.create_bucket(Bucket="ddp-versioned")
    direct.put_bucket_versioning(Bucket="ddp-versioned", VersioningConfiguration={"Status": "Enabled"})
    address = copy_split(written, "data", bucket="ddp-versioned")
    index = ShardIndex.read(address)
    assert all(index.listed[shard["name"]].version for shard in index.shards)
    ref = index.refs()[0]
    original = (written / "train" / index.shards[0]["name"]).read_bytes()
    key = f"data/train/{index.shards[0]['name']}"
    proxied.set(bytes_per_s=300_000)
    overwrite = threading.Timer(0.3, lambda: direct.put_object(Bucket="ddp-versioned", Key=key, Body=original[::-1]))
    overwrite.start()
    threading.Timer(0.6, proxied.cut, (1.0,)).start()
    assert fetch(ref, str(tmp_path / "a"), Patience(30)) >= 2  # cut, then continued
    overwrite.join()
    assert (tmp_path / "a").read_bytes() == original
    assert direct.get_object(Bucket="ddp-versioned", Key=key)["Body"].read() == original[::-1]
    gets = [r for r in logged_since(proxied, ref.address, 0, 1) if r.method == "GET"]  # the copy's upload before
    assert all(f"versionId={ref.version}" in r.query for r in gets) and gets[-1].range_header is not None
    direct.delete_object(Bucket="ddp-versioned", Key=key, VersionId=ref.version)
    with pytest.raises(ShardMissing, match=rf"^{ref.address}: removed from the store since this run listed it "
                                           r"\(NoSuchVersion\)"):
        fetch(ref, str(tmp_path / "b"), Patience(30))


def test_the_masking_formatter_leaves_a_line_without_credentials_whole(capsys):
    setup_logging(0).info("step 3/9: loss 1.25, data wait 4%% (%s)", "s3://bucket/x/shard-000001.tar")
    assert re.search(r"\[rank0\] INFO step 3/9: loss 1.25, data wait 4% \(s3://bucket/x/shard-000001.tar\)\n$",
                     capsys.readouterr().out)
