"""The object store's faults and dialects, request by request, against moto's S3 server on
localhost and the proxy of bench/far_network.py:

* no credential in any line: a secret in the real AWS form (40 characters with "/" and "+"),
  typed or URL-encoded, in a shards address, an image-folder address, the endpoint, botocore's
  own text and a logged warning, is repeated by no line, through the real CLI as well."""
from __future__ import annotations

import re
import subprocess
import sys
from urllib.parse import quote

import pytest
from helpers import REPO, cli_env, free_port

from ddp_utils.config import UsageError
from ddp_utils.data.object_store import StoreUnavailable
from ddp_utils.data.sets import check_data_dir
from ddp_utils.data.shards import ShardIndex
from ddp_utils.runtime.logs import setup_logging
from ddp_utils.runtime.stopping import EXIT_USAGE

# Credentials in the real AWS form (AWS's documented example pair): about half of real secret keys hold "/" or "+"
KEY, SECRET = "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCY+EXAMPLEKEY"
ENCODED = quote(SECRET, safe="")  # wJalrXUtnFEMI%2FK7MDENG%2FbPxRfiCY%2BEXAMPLEKEY
PIECES = [KEY, SECRET, ENCODED, *(piece for piece in re.split(r"[/+]", SECRET) if len(piece) >= 4)]


def leaked(text: str) -> list[str]:
    """The key, the secret (either form) or any of its pieces of 4 characters or more in ``text``."""
    return [piece for piece in PIECES if piece in text]


# ----------------------------------------------------------------------------- no credential in any line
def test_a_secret_with_slash_and_plus_is_repeated_by_no_line(s3_server, monkeypatch, capsys):
    """Every form the issue found repeated, in process: the shards address and the image-folder
    address as typed and URL-encoded, the endpoint as typed in the unreachable-store line, the
    line of a store that cannot be reached there, and warnings through the logger."""
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
    monkeypatch.setattr("ddp_utils.data.object_store._clients", {})  # a client for this endpoint
    with pytest.raises(UsageError) as refused:
        ShardIndex.read("s3://ddp-test/imagenet-like/train")
    assert "(EndpointResolutionError; endpoint http://***@127.0.0.1:1)" in str(refused.value)
    assert refused.value.exit_code == EXIT_USAGE and not leaked(str(refused.value))

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
        assert proc.stderr.startswith(
            f"train_classifier.py: error: {data_dir}/train/index.json: the object store refused or could not be "
            f"reached (EndpointConnectionError; endpoint http://***@{endpoint.rpartition('@')[2]}); "), proc.stderr
    else:
        assert proc.stderr.startswith("train_classifier.py: error: --data-dir s3://***@ddp-test/imagenet-like: ")


def test_the_masking_formatter_leaves_a_line_without_credentials_whole(capsys):
    setup_logging(0).info("step 3/9: loss 1.25, data wait 4%% (%s)", "s3://bucket/x/shard-000001.tar")
    assert re.search(r"\[rank0\] INFO step 3/9: loss 1.25, data wait 4% \(s3://bucket/x/shard-000001.tar\)\n$",
                     capsys.readouterr().out)
