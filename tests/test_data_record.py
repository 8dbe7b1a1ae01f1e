"""A run from an object store is held to the data it listed, across its attempts
(``ddp_utils/train/data_record.py``), against moto's S3 server on localhost:

* every start records what the listing gave (``data_listed.json``: bytes, ETag per object);
* a later attempt (``--resume``; a restart adds ``--resume if-restarted``) refuses a shard that
  changed since, in one line naming it, in ``--check`` as in the run; ``--allow-changes``
  continues and says what changed;
* a shard the run itself named (a store fault's shard) may be put back: the resume continues,
  reading it pinned by its content (the index's sha256), and config.json says so."""
from __future__ import annotations

import errno
import json
import os
import re
from typing import Callable

import boto3
import numpy as np
import pytest
from boto3.s3.transfer import TransferConfig
from far_network import Rewrite, Seen
from helpers import assert_ok, in_process, load_ckpt, s3_error

import train_classifier
from ddp_utils.data import shard_cache
from ddp_utils.data.object_store import fetch
from ddp_utils.data.order import ShardAwareSampler
from ddp_utils.data.shards import INDEX, RECORDS, ShardIndex
from ddp_utils.train.data_record import LISTED

RUN = ["--dataset", "shards", "--device", "cpu", "--arch", "small_cnn", "--image-size", "16", "--batch-size", "4",
       "--workers", "0", "--epochs", "1", "--log-every", "1"]
MULTIPART = TransferConfig(multipart_threshold=1)  # one part: the same bytes, another ETag ("...-1")


@pytest.fixture
def prefix(written, bucket, request) -> str:
    """A copy of ``written`` in the bucket of its own, to rewrite."""
    client, name = boto3.client("s3"), "record-" + re.sub(r"\W+", "-", request.node.name)[-40:]
    for path in written.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), "ddp-test", f"{name}/{path.relative_to(written)}")
    return f"s3://ddp-test/{name}"


def test_a_resume_is_held_to_the_listing_its_run_recorded(prefix, written, tmp_path, capsys):
    out = tmp_path / "run"
    args = RUN + ["--data-dir", prefix, "--shard-cache-dir", str(tmp_path / "cache"), "--out", str(out)]
    assert_ok(in_process(train_classifier.main, args + ["--max-steps", "1"], capsys))
    record = json.loads((out / LISTED).read_text())
    listed = ShardIndex.read(f"{prefix}/train").listed
    names = {INDEX, RECORDS, *(shard["name"] for shard in ShardIndex.read(str(written / "train")).shards)}
    assert set(record["train"]["objects"]) == names and record["train"]["root"] == f"{prefix}/train"
    assert all(record["train"]["objects"][name] == [entry.size, entry.etag, ""] for name, entry in listed.items())
    shard = next(name for name in sorted(names) if name.endswith(".tar"))
    boto3.client("s3").upload_file(str(written / "train" / shard), "ddp-test", f"{prefix[len('s3://ddp-test/'):]}/train/{shard}",
                                   Config=MULTIPART)  # the same bytes, another ETag: refused all the same
    check = args + ["--max-steps", "2", "--check", "--resume", "auto"]
    proc = in_process(train_classifier.main, check, capsys)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    etag_then, etag_now = listed[shard].etag, ShardIndex.read(f"{prefix}/train").listed[shard].etag
    assert (f"error: --resume {out}/checkpoint_last.pt: the object store's data changed since its run listed it "
            f"({prefix}/train/{shard} changed (ETag {etag_then} -> {etag_now})); put the listed versions back, add "
            f"--allow-changes to continue on the data as it is now") in proc.stderr
    proc = in_process(train_classifier.main, check + ["--allow-changes"], capsys)
    assert_ok(proc)
    assert f"data: changed since the checkpoint's run read it: {prefix}/train/{shard} changed" in proc.stdout
    (out / "UNREADABLE").write_text(f"{prefix}/train/{shard}\tnot the version this run listed\n")  # as a stop writes
    proc = in_process(train_classifier.main, args + ["--max-steps", "2", "--resume", "auto"], capsys)
    assert_ok(proc)
    assert f"{prefix}/train/{shard} changed (ETag {etag_then} -> {etag_now}) (the run named it: read pinned by its " \
           f"index's sha256)" in proc.stdout
    (resumed,) = json.loads((out / "config.json").read_text())["history"]
    assert len(resumed["resolved"]["data_changes"]) == 1 and shard in resumed["resolved"]["data_changes"][0]
    assert json.loads((out / LISTED).read_text())["train"]["objects"][shard][1] == etag_now  # the new pins
    assert not (out / "UNREADABLE").exists()
    assert_ok(in_process(train_classifier.main, args + ["--max-steps", "3", "--check", "--resume", "auto"], capsys))


def test_a_shard_put_back_is_read_pinned_by_its_content(prefix, written, tmp_path):
    from ddp_utils.train.checkpoint import Resume
    from ddp_utils.train.data_record import check_same_data, write_listing_record

    listings = tuple(ShardIndex.read(f"{prefix}/{split}") for split in ("train", "val"))
    write_listing_record(str(tmp_path), listings)
    shard = listings[0].shards[1]["name"]
    boto3.client("s3").upload_file(str(written / "train" / shard), "ddp-test", f"{prefix[len('s3://ddp-test/'):]}/train/{shard}",
                                   Config=MULTIPART)
    now = tuple(ShardIndex.read(f"{prefix}/{split}") for split in ("train", "val"))
    resume = Resume(tmp_path / "checkpoint_last.pt", {"resolved": {}})
    (train, val), accepted = check_same_data(resume, now, [f"{prefix}/train/{shard}"], allow_changes=False)
    assert train.by_content == {shard} and not val.by_content and len(accepted) == 1
    refs = {ref.address: ref for ref in train.refs()}
    put_back = refs[f"{prefix}/train/{shard}"]
    assert (put_back.etag, put_back.version, put_back.sha256) == ("", "", listings[0].shards[1]["sha256"])
    assert all(ref.etag for address, ref in refs.items() if address != put_back.address)
    with pytest.raises(Exception, match="the object store's data changed since its run listed it"):
        check_same_data(resume, now, [], allow_changes=False)  # not named: refused


def test_a_shard_record_that_cannot_be_decoded_is_mended_as_its_stop_line_says(prefix, written, tmp_path, capsys):
    """A shard damaged in the bucket after its index was written (same size: the listing passes):
    the run stops on its records, naming them and saying "copy its shard again"; once copied
    again, the resume continues (the shard the run named, read pinned by its content) to the end."""
    index = ShardIndex.read(str(written / "train"))
    sampler = ShardAwareSampler(index.shard, 1, 0, seed=0, batch_size=4)
    sampler.set_epoch(0)
    order = [i for _, i in sampler]
    number = int(index.shard[order[-1]])  # the last one read
    step = next(k for k, i in enumerate(order) if index.shard[i] == number) // 4 + 1  # its first sample's
    assert number != 0 and step >= 2  # shard 0 is the preview's; a step trained before
    name = index.shards[number]["name"]
    data = bytearray((written / "train" / name).read_bytes())
    for i in np.flatnonzero(index.shard == number):  # every image of it: zeros, as a damaged copy holds
        data[index.offset[i]:index.offset[i] + index.size[i]] = bytes(int(index.size[i]))
    client, key = boto3.client("s3"), f"{prefix[len('s3://ddp-test/'):]}/train/{name}"
    client.put_object(Bucket="ddp-test", Key=key, Body=bytes(data))
    out = tmp_path / "run"
    args = RUN + ["--data-dir", prefix, "--shard-cache-dir", str(tmp_path / "cache"), "--out", str(out)]
    proc = in_process(train_classifier.main, args, capsys)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = next(line for line in (proc.stdout + proc.stderr).splitlines() if "cannot decode" in line)
    assert re.search(rf"ERROR step {step} \(not taken\): cannot decode .* in {prefix}/train/{name} .*; copy (its|their) "
                     r"shard again from where write_shards.py wrote it \(--check-data compares every shard with its "
                     r"index\), then continue with --resume auto; the last good checkpoint is", line), line
    client.upload_file(str(written / "train" / name), "ddp-test", key)  # copied again
    proc = in_process(train_classifier.main, args + ["--resume", "auto"], capsys)
    assert_ok(proc)
    assert f"{prefix}/train/{name} changed (ETag" in proc.stdout and "(the run named it" in proc.stdout
    assert load_ckpt(out / "checkpoint_last.pt")["step"] == len(order) // 4  # the epoch to its end


# ----------------------------------------------------------------------------- every stop line, followed as written
STOPS = {  # the fault, met at the epoch's last shard: the words of its line, and what the line says to do
    "access refused": (r"the object store refused access \(AccessDenied; endpoint \S+\); check the credentials "
                       r"\(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the machine's role\) and the "
                       r"bucket's policy", "the store lets it in again"),
    "credentials expired": (r"the credentials expired \(ExpiredToken, for \d+ s, read again before each try; endpoint "
                            r"\S+\); refresh them", "the store takes them again"),
    "store rejects If-Match": (r"the object store rejects If-Match \(412 Precondition Failed to If-Match \S+, the ETag "
                               r"it lists for the object\); add --no-store-if-match", "--no-store-if-match"),
    "shard removed": (r"removed from the store since this run listed it \(NoSuchKey\); the data changed under the "
                      r"run: put it back", "put back"),
    "shard rewritten": (r"not the version this run listed at its start \(ETag \S+ listed, \S+ now\); the data "
                        r"changed under the run: put the listed version back", "put back"),
    "cache disk full": (r"the node's cache of shards could not be written \(No space left on device\): [\d.]+ GB "
                        r"free there, the cache may fill [\d.]+ GB; point --shard-cache-dir at a local disk with room, "
                        r"or lower --shard-cache-gb", "the disk has room again"),
}


@pytest.mark.slow  # two runs a case
@pytest.mark.parametrize("case", list(STOPS))
def test_each_stop_line_of_a_bucket_run_followed_as_written_continues_the_run(case, prefix, written, s3_server,
                                                                              proxied, monkeypatch, tmp_path, capsys):
    """A fault at the epoch's last shard stops the run (a single process, through the proxy)
    with exit 2 and one line naming what to fix, then "continue with --resume auto"; done as the
    line says (the store's rule lifted, the listed shard put back as the same bytes uploaded in
    one part, whose ETag differs, the flag added), that command runs to the epoch's end."""
    words, fix = STOPS[case]
    index = ShardIndex.read(str(written / "train"))
    sampler = ShardAwareSampler(index.shard, 1, 0, seed=0, batch_size=4)
    sampler.set_epoch(0)
    name = index.shards[int(index.shard[[i for _, i in sampler][-1]])]["name"]
    address, key = f"{prefix}/train/{name}", f"{prefix[len('s3://ddp-test/'):]}/train/{name}"
    direct = boto3.client("s3", endpoint_url=s3_server["AWS_ENDPOINT_URL"])  # past the proxy

    def at_the_shard(answer: Callable[[Seen], Rewrite | None]) -> None:
        proxied.rewrite(lambda seen: answer(seen) if seen.method == "GET" and seen.path.endswith(key) else None)

    if case == "access refused":
        at_the_shard(lambda seen: s3_error(403, "AccessDenied"))
    elif case == "credentials expired":
        at_the_shard(lambda seen: s3_error(400, "ExpiredToken"))
    elif case == "store rejects If-Match":
        at_the_shard(lambda seen: s3_error(412, "PreconditionFailed") if "if-match" in seen.headers else None)
    elif case == "shard removed":  # after the listing, as its download starts
        at_the_shard(lambda seen: direct.delete_object(Bucket="ddp-test", Key=key) and None)
    elif case == "shard rewritten":
        at_the_shard(lambda seen: direct.put_object(Bucket="ddp-test", Key=key, Body=b"\0" * 10240) and None)
    else:
        def no_room(ref, *args):
            if ref.address == address:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return fetch(ref, *args)
        monkeypatch.setattr(shard_cache, "fetch", no_room)
    out = tmp_path / "run"
    args = RUN + ["--data-dir", prefix, "--shard-cache-dir", str(tmp_path / "cache"), "--shard-read-ahead", "0",
                  "--shard-downloads", "1", "--store-timeout", "3", "--out", str(out)]
    proc = in_process(train_classifier.main, args, capsys)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in said, said
    (line,) = [line for line in said.splitlines() if "(not taken)" in line]
    where = r"\S+/ddp-shards-\w+-node\S+" if case == "cache disk full" else re.escape(address)
    assert re.search(rf"ERROR step \d+ \(not taken\): {where}: {words}[^;]*; continue with --resume auto; the last "
                     rf"good checkpoint is {re.escape(str(out))}/checkpoint_last.pt \(step \d+\)$", line), line
    proxied.rewrite(None)
    monkeypatch.setattr(shard_cache, "fetch", fetch)
    resume = args + ["--resume", "auto"]
    if fix == "--no-store-if-match":
        resume.append(fix)
    elif fix == "put back":  # the listed bytes again, in one multipart part: another ETag
        direct.upload_file(str(written / "train" / name), "ddp-test", key, Config=MULTIPART)
    proc = in_process(train_classifier.main, resume, capsys)
    assert_ok(proc)
    assert load_ckpt(out / "checkpoint_last.pt")["step"] == len(index) // 4  # the epoch to its end
