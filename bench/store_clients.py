"""Download layers for shards in an object store, measured side by side in one run through a far network.

    python bench/store_clients.py                          # 16 shards of 1 MB, 100 ms per request, 2 MB/s
    python bench/store_clients.py --shards 32 --shard-mb 4 --latency-ms 50 --mbps 4 --rounds 5
    python bench/store_clients.py --smoke                  # seconds: 3 shards of 64 kB, 10 ms, 1 round

What it measures: moto's S3 server on 127.0.0.1 (a subprocess) holds ``--shards`` random shards of
``--shard-mb`` MB, behind ``tests/far_network.py`` (``--latency-ms`` per request, ``--mbps`` MB/s per
connection: a scaled stand-in for a far S3, where one connection carries about a third of what a
rank needs). Each row is a download layer and the way it is driven (the project's ``fetch``: one GET
per shard, as the read-ahead does it with ``--shard-downloads 4``, and with 16; boto3's transfer
manager with its HEAD and ranged parts; the CRT transfer client when ``awscrt`` imports, free and
held to 4 connections), every row with fresh
clients each round, the rounds interleaved. For each row: the wall seconds to fetch every shard
(the median of ``--rounds``), MB/s, the requests per shard as the proxy answered them (GET, HEAD,
how many carried a Range header), body bytes moved per shard byte and the peak number of requests
in flight at once (a connection each). Every shard a row fetched is checked against the sha256 of
what was uploaded, every round: a row that leaves a shard short or wrong fails instead of winning.
A second table repeats the rows with the network direct (no latency, no cap): the layers' own
cost on this machine. Speed ratios are against "project: one GET per shard, 4 at once"; the
closing lines are computed from the measured numbers. Exit 0 when every row that ran gave every
shard whole (a CRT row that cannot run or fails says why in its row and leaves the exit alone), 1
otherwise.

The figures go to docs/performance.md. Traffic goes to 127.0.0.1 only: the proxy refuses any
other target and the CRT client's requests are checked for their Host before they are sent.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the far network is the object-store tests' proxy
from far_network import FarNetwork, Request  # noqa: E402

from ddp_utils.data import object_store  # noqa: E402
from ddp_utils.data.object_store import Patience, ShardRef, fetch  # noqa: E402
from ddp_utils.runtime.spawn import free_port  # noqa: E402

BUCKET, PREFIX = "bench-store-clients", "shards"
REGION = "us-east-1"
BASELINE = "project: one GET per shard, 4 at once"
AT_ONCE = 4             # the read-ahead's default --shard-downloads
MANY = 16               # --shard-downloads 16: as many GETs in flight as the free CRT client makes for 16 shards
PATIENCE_S = 30.0       # the project's fetch: how long a transient fault is waited out (none expected here)
NOISE = 1.10            # a speed ratio within this factor of 1 is not told apart from noise on a busy machine
SMOKE = {"shards": 3, "shard_mb": 0.064, "latency_ms": 10.0, "rounds": 1, "part_kb": 16}
AWS_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                 "AWS_SESSION_TOKEN", "AWS_PROFILE")


@dataclass(frozen=True)
class Shard:
    key: str
    size: int
    etag: str
    sha256: str

    @property
    def file_name(self) -> str:
        return self.key.rsplit("/", 1)[-1]


# A layer's start(shards, folder) makes its clients (untimed) and returns (run, close): run() fetches
# every shard into folder (timed), close() lets the clients and their connections go.
Starter = Callable[[list[Shard], Path], tuple[Callable[[], None], Callable[[], None]]]


@dataclass
class Row:
    """One download layer and how it is driven; ``unavailable``: why it cannot run here (not
    measured), ``failed``: why a measured round did not give every shard whole (one line);
    ``optional``: its failure is reported in its row only, not in the exit status."""

    key: str                # what the closing lines call it by
    name: str
    start: Starter | None
    optional: bool = False
    unavailable: str = ""
    failed: str = ""
    walls: list[float] = field(default_factory=list)
    requests: list[list[Request]] = field(default_factory=list)  # per round, the proxy's answered requests

    @property
    def ok(self) -> bool:
        return not (self.unavailable or self.failed) and bool(self.walls)

    def wall(self) -> float:
        return statistics.median(self.walls)

    def per_shard(self, shards: int, keep: Callable[[Request], bool] = lambda r: True) -> float:
        """Requests per shard that ``keep`` selects, over every measured round."""
        return sum(keep(r) for reqs in self.requests for r in reqs) / (shards * len(self.requests))

    def bytes_ratio(self, needed: int) -> float:
        """Response body bytes per shard byte, over every measured round (1.00: each byte once)."""
        return sum(r.response_bytes for reqs in self.requests for r in reqs) / (needed * len(self.requests))

    def peak(self) -> int:
        """The most requests in flight at once in any round (each on a connection of its own)."""
        best = 0
        for reqs in self.requests:
            # at equal times an end goes first: a connection reused back to back is not two at once
            events = sorted([(r.started, 1) for r in reqs] + [(r.ended, -1) for r in reqs])
            now = 0
            for _, step in events:
                now += step
                best = max(best, now)
        return best


# ----------------------------------------------------------------------------- the layers
def project_layer(at_once: int) -> Starter:
    """The project's ``fetch`` (one GET per shard, pinned to its ETag), ``at_once`` shards on threads
    of their own as the read-ahead runs them (1: one after the other)."""

    def start(shards: list[Shard], folder: Path):
        # client() keeps one client per process; dropped so that each round starts with a fresh one (and
        # its empty connection pool) like every other row, made here so that its making is not timed
        object_store._clients.pop(os.getpid(), None)
        object_store.client()
        patience = Patience(PATIENCE_S)

        def one(shard: Shard) -> None:
            fetch(ShardRef(f"s3://{BUCKET}/{shard.key}", shard.size, shard.etag), str(folder / shard.file_name), patience)

        def run() -> None:
            if at_once == 1:
                for shard in shards:
                    one(shard)
            else:
                with ThreadPoolExecutor(at_once) as pool:
                    list(pool.map(one, shards))  # list(): a failed download raises here

        def close() -> None:
            made = object_store._clients.pop(os.getpid(), None)
            if made is not None:
                made.close()

        return run, close

    return start


def transfer_layer(at_once: int, **config) -> Starter:
    """boto3's transfer manager (``client.download_file``) with ``TransferConfig(**config)``,
    ``at_once`` shards on threads of their own."""

    def start(shards: list[Shard], folder: Path):
        import boto3
        from boto3.s3.transfer import TransferConfig

        client = boto3.client("s3")  # the endpoint: AWS_ENDPOINT_URL, the proxy
        # "classic" named: with awscrt installed, boto3's "auto" picks the CRT client on the instance types
        # it is tuned for, and this row measures the classic manager wherever it runs
        transfer = TransferConfig(preferred_transfer_client="classic", **config)

        def one(shard: Shard) -> None:
            client.download_file(BUCKET, shard.key, str(folder / shard.file_name), Config=transfer)

        def run() -> None:
            with ThreadPoolExecutor(at_once) as pool:
                list(pool.map(one, shards))

        return run, client.close

    return start


def crt_unavailable() -> str:
    """Why the CRT row cannot run here ("" if it can)."""
    try:
        import awscrt  # noqa: F401
        import awscrt.s3  # noqa: F401
        from s3transfer.crt import CRTTransferManager  # noqa: F401
    except ImportError as err:
        return f"not installed ({err.name or err}; pip install awscrt)"
    return ""


def crt_version() -> str:
    try:
        import awscrt
    except ImportError:
        return ""
    return awscrt.__version__


def crt_layer(endpoint: str, max_connections: int | None = None) -> Starter:
    """The CRT transfer client (s3transfer's ``CRTTransferManager`` on an ``awscrt`` S3 client), every
    shard submitted at once, the CRT choosing its parts and connections (at most ``max_connections``
    for the whole client where given: TransferConfig's max_concurrency caps each download alone).

    Built from s3transfer's parts rather than ``boto3.s3.transfer.create_transfer_manager(...,
    TransferConfig(preferred_transfer_client="crt"))``: boto3 makes its CRT client with TLS always on
    (``use_ssl=True``) and its request serializer with ``endpoint_url=None`` (whatever the client's), so
    it cannot reach a plain-http server such as moto; here TLS is off and the endpoint is ``endpoint``."""

    def start(shards: list[Shard], folder: Path):
        import awscrt.s3
        import boto3
        import botocore.session
        from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
        from awscrt.s3 import S3Client, S3RequestTlsMode
        from botocore.config import Config
        from s3transfer.crt import (
            BotocoreCRTCredentialsWrapper,
            BotocoreCRTRequestSerializer,
            CRTTransferManager,
        )

        host = endpoint.split("://", 1)[1]

        class LoopbackSerializer(BotocoreCRTRequestSerializer):
            """The CRT connects to the request's Host: anything but the proxy is refused before it is sent."""

            def serialize_http_request(self, transfer_type, future):
                request = super().serialize_http_request(transfer_type, future)
                if request.headers.get("host") != host:
                    raise RuntimeError(f"CRT request for host {request.headers.get('host')!r}, not {host}: refused")
                return request

        serializer = LoopbackSerializer(botocore.session.Session(), {
            "region_name": REGION, "endpoint_url": endpoint, "config": Config(s3={"addressing_style": "path"})})
        credentials = boto3.session.Session().get_credentials()
        # as s3transfer.crt.create_s3_crt_client makes it (8 MB parts, the recommended throughput target or
        # 10 Gb/s), with TLS off and, where asked, the client's connections capped
        loops = EventLoopGroup()
        crt = S3Client(bootstrap=ClientBootstrap(loops, DefaultHostResolver(loops)), region=REGION,
                       credential_provider=BotocoreCRTCredentialsWrapper(credentials).to_crt_credentials_provider(),
                       part_size=8 * 2 ** 20, tls_mode=S3RequestTlsMode.DISABLED,
                       throughput_target_gbps=awscrt.s3.get_recommended_throughput_target_gbps() or 10.0,
                       max_active_connections_override=max_connections)
        manager = CRTTransferManager(crt, serializer)

        def run() -> None:
            futures = [manager.download(BUCKET, shard.key, str(folder / shard.file_name)) for shard in shards]
            for future in futures:
                future.result()

        return run, manager.shutdown

    return start


def rows(endpoint: str, part_kb: int) -> list[Row]:
    part = part_kb * 1024
    found = [
        Row("project-1", "project: one GET per shard, 1 at a time", project_layer(1)),
        Row("project", BASELINE, project_layer(AT_ONCE)),
        Row("project-many", f"project: one GET per shard, {MANY} at once (--shard-downloads {MANY})",
            project_layer(MANY)),
        Row("tm-1", "boto3 transfer manager (download_file), 1 shard at a time, default config", transfer_layer(1)),
        Row("tm-ranged", f"boto3 transfer manager, 1 shard at a time, {part_kb} kB ranged parts x 4 threads",
            transfer_layer(1, multipart_threshold=part, multipart_chunksize=part, max_concurrency=4)),
        Row("tm", f"boto3 transfer manager, {AT_ONCE} shards at once (default config)", transfer_layer(AT_ONCE)),
    ]
    crt_rows = [("crt", "boto3 + CRT (awscrt) transfer client, every shard submitted at once", None),
                ("crt-capped", f"boto3 + CRT (awscrt) transfer client, every shard submitted at once, at most "
                               f"{AT_ONCE} connections", AT_ONCE)]
    missing = crt_unavailable()
    for key, name, cap in crt_rows:
        found.append(Row(key, name, None if missing else crt_layer(endpoint, cap), optional=True, unavailable=missing))
    return found


# ----------------------------------------------------------------------------- the store
def start_store(work: Path) -> tuple[subprocess.Popen, int]:
    """moto's S3 server on a free 127.0.0.1 port, answering; its log in ``work``."""
    server = Path(sys.executable).with_name("moto_server")
    if not server.exists():
        raise SystemExit(f"{server} is missing; pip install -r requirements-dev.txt installs moto[server]")
    port = free_port()
    log = open(work / "moto_server.log", "wb")
    proc = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    log.close()  # the child holds its own descriptor
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                stop_store(proc)
                raise SystemExit(f"moto_server did not answer on 127.0.0.1:{port} within 30 s (log: {log.name})")
            time.sleep(0.1)


def stop_store(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def upload(count: int, size: int) -> list[Shard]:
    """``count`` shards of ``size`` random bytes into the bucket (straight to the server)."""
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    shards = []
    for number in range(count):
        data = os.urandom(size)
        key = f"{PREFIX}/shard-{number:06d}.tar"
        etag = client.put_object(Bucket=BUCKET, Key=key, Body=data)["ETag"]
        shards.append(Shard(key, size, etag, hashlib.sha256(data).hexdigest()))
    client.close()
    return shards


def check_files(shards: list[Shard], folder: Path) -> None:
    """Every shard in ``folder``, whole: its size and its sha256 as uploaded; RuntimeError otherwise."""
    for shard in shards:
        path = folder / shard.file_name
        if not path.is_file():
            raise RuntimeError(f"{shard.key} was not written")
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        if path.stat().st_size != shard.size or digest.hexdigest() != shard.sha256:
            raise RuntimeError(f"{shard.key}: {path.stat().st_size} bytes that are not the {shard.size} uploaded")


def settled(proxy: FarNetwork) -> int:
    """The count of answered requests once it stops changing: the proxy logs a request once its last
    byte is with the kernel, a moment after a client may have read it."""
    count, quiet_since = len(proxy.requests), time.monotonic()
    while time.monotonic() - quiet_since < 0.05:
        time.sleep(0.01)
        now = len(proxy.requests)
        if now != count:
            count, quiet_since = now, time.monotonic()
    return count


def measure(found: list[Row], shards: list[Shard], proxy: FarNetwork, rounds: int, work: Path) -> None:
    """``rounds`` rounds of every row, interleaved (a machine that slows down mid-run slows every row
    alike); each round fresh clients, an empty folder, the files checked afterwards."""
    before = settled(proxy)
    for _ in range(rounds):
        for row in found:
            if row.start is None or row.failed:
                continue
            folder = work / "downloads"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                run, close = row.start(shards, folder)
                try:
                    started = time.perf_counter()
                    run()
                    wall = time.perf_counter() - started
                finally:
                    close()
                after = settled(proxy)  # read first: proxy.requests is a copy made when it is read
                answered = proxy.requests[before:after]
                before = after
                check_files(shards, folder)
            except Exception as err:  # reported in the row: the other rows still run
                row.failed = " ".join(f"{type(err).__name__}: {err}".split())[:200]
                before = settled(proxy)  # what the failed round left is nobody's
                continue
            row.walls.append(wall)
            row.requests.append(answered)
    shutil.rmtree(work / "downloads", ignore_errors=True)


# ----------------------------------------------------------------------------- the report
def speed_vs(row: Row, base: Row | None) -> str:
    return f"{base.wall() / row.wall():.2f}x" if base is not None and base.ok else "-"


def far_table(found: list[Row], count: int, size: int, rounds: int) -> None:
    base = next((r for r in found if r.name == BASELINE and r.ok), None)
    print(f"| download layer, how driven | wall s (median of {rounds}) | MB/s | requests per shard | GET | HEAD "
          f"| with Range | body bytes / shard bytes | peak requests at once | speed vs \"{BASELINE}\" |")
    print("| --- | --: | --: | --: | --: | --: | --: | --: | --: | --: |")
    for row in found:
        if not row.ok:
            print(f"| {row.name} | {row.unavailable or 'FAILED: ' + row.failed} | | | | | | | | |")
            continue
        print(f"| {row.name} | {row.wall():.2f} | {count * size / 1e6 / row.wall():.2f} "
              f"| {row.per_shard(count):.2f} | {row.per_shard(count, lambda r: r.method == 'GET'):.2f} "
              f"| {row.per_shard(count, lambda r: r.method == 'HEAD'):.2f} "
              f"| {row.per_shard(count, lambda r: r.range_header is not None):.2f} "
              f"| {row.bytes_ratio(count * size):.2f} | {row.peak()} | {speed_vs(row, base)} |")


def direct_table(found: list[Row], count: int, size: int, rounds: int) -> None:
    base = next((r for r in found if r.name == BASELINE and r.ok), None)
    print(f"| download layer, how driven | wall s (median of {rounds}) | MB/s | speed vs \"{BASELINE}\" |")
    print("| --- | --: | --: | --: |")
    for row in found:
        if not row.ok:
            print(f"| {row.name} | {row.unavailable or 'FAILED: ' + row.failed} | | |")
            continue
        print(f"| {row.name} | {row.wall():.3f} | {count * size / 1e6 / row.wall():.1f} | {speed_vs(row, base)} |")


def verdict(ratio: float) -> str:
    if ratio >= NOISE:
        return "pays"
    if ratio <= 1 / NOISE:
        return "costs"
    return f"does not pay (within {NOISE - 1:.0%}, noise)"


def conclusions(far: list[Row], direct: list[Row], count: int) -> list[str]:
    """The closing lines, each computed from the measured rows (a comparison with a row that did not
    run is left out)."""
    by_key = {row.key: row for row in far if row.ok}
    by_name = {row.name: row for row in far if row.ok}
    lines = []

    def compare(what: str, key: str, reference: str) -> None:
        a, b = by_key.get(key), by_key.get(reference)
        if a is None or b is None:
            return
        ratio = b.wall() / a.wall()
        lines.append(f"- {what}: {ratio:.2f}x the speed ({a.wall():.2f} s against {b.wall():.2f} s), "
                     f"{a.per_shard(count):.2f} requests per shard against {b.per_shard(count):.2f}, up to "
                     f"{a.peak()} requests in flight against {b.peak()}: {verdict(ratio)}")

    compare(f"several shards at once ({AT_ONCE} GETs in flight) against one at a time, the project's fetch", "project",
            "project-1")
    compare(f"{MANY} shards at once against {AT_ONCE}, the project's fetch", "project-many", "project")
    compare("ranged parts for one shard against the transfer manager's default, one shard at a time", "tm-ranged",
            "tm-1")
    compare(f"the transfer manager's HEAD + GET against the project's one GET, {AT_ONCE} shards at once", "tm",
            "project")
    compare(f"the CRT client held to {AT_ONCE} connections against the project's {AT_ONCE} at once", "crt-capped",
            "project")
    compare(f"the CRT client, free, against the project's {MANY} at once", "crt", "project-many")
    compare(f"the CRT client, free, against the project's {AT_ONCE} at once (the default)", "crt", "project")
    if by_name:
        best = min(by_name.values(), key=Row.wall)
        base = by_name.get(BASELINE)
        against = f", {base.wall() / best.wall():.2f}x the project's {AT_ONCE} at once" if base else ""
        lines.append(f"- fastest through the far network: \"{best.name}\", {best.wall():.2f} s{against}, at "
                     f"{best.per_shard(count):.2f} requests per shard and up to {best.peak()} requests at once")
        same = [row for row in by_name.values() if row.peak() <= AT_ONCE]
        if base is not None and same:
            best_same = min(same, key=Row.wall)
            lines.append(f"- with at most {AT_ONCE} requests in flight (the read-ahead's connections): fastest "
                         f"\"{best_same.name}\", {base.wall() / best_same.wall():.2f}x the project's {AT_ONCE} at "
                         f"once, at {best_same.per_shard(count):.2f} requests per shard")
    shares = [(row.wall() / by_name[row.name].wall(), row) for row in direct if row.ok and row.name in by_name]
    if shares:
        share, row = max(shares, key=lambda pair: pair[0])
        bound = "the network, not the layers' own work" if share < 1 / 3 else \
            "partly the layers' own work on this machine (a third or more of a row's far time)"
        lines.append(f"- direct network: a row's time is at most {share:.0%} of its time through the far network "
                     f"(\"{row.name}\", {row.wall():.3f} s against {by_name[row.name].wall():.2f} s): the far "
                     f"figures measure {bound}")
    return lines


# ----------------------------------------------------------------------------- the command line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--shards", type=int, default=16, help="shards uploaded and fetched by every row (default 16)")
    parser.add_argument("--shard-mb", type=float, default=1.0, help="size of a shard in MB, 1e6 bytes as write_shards.py counts them (default 1)")
    parser.add_argument("--latency-ms", type=float, default=100.0,
                        help="far network: delay per request, in ms (default 100)")
    parser.add_argument("--mbps", type=float, default=2.0,
                        help="far network: bandwidth per connection in MB/s, 1e6 bytes (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every row, interleaved; the median is shown "
                        "(default 3)")
    parser.add_argument("--part-kb", type=int, default=256,
                        help="part size and threshold of the transfer manager's ranged row, in kB (default 256)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes for a test: 3 shards of 64 kB, 10 ms, 16 kB parts, 1 round (overrides those)")
    args = parser.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    if args.shards < 1 or args.shard_mb <= 0 or args.latency_ms < 0 or args.mbps <= 0 or args.rounds < 1 \
            or args.part_kb < 1:
        parser.error("--shards, --rounds and --part-kb must be >= 1, --shard-mb and --mbps > 0, --latency-ms >= 0")
    size = int(args.shard_mb * 1e6)

    work = Path(tempfile.mkdtemp(prefix="bench-store-clients-"))
    saved = {name: os.environ.get(name) for name in AWS_VARIABLES}
    saved_client = object_store._clients.pop(os.getpid(), None)  # a caller's own client, put back at the end
    proc = proxy = None
    try:
        proc, port = start_store(work)
        for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE"):  # the caller's identity is not the bench's
            os.environ.pop(name, None)
        os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                          AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION=REGION)
        started = time.perf_counter()
        shards = upload(args.shards, size)
        proxy = FarNetwork(("127.0.0.1", port), latency_s=args.latency_ms / 1000, bytes_per_s=args.mbps * 1e6).start()
        os.environ["AWS_ENDPOINT_URL"] = proxy.url  # every row's clients: through the far network

        far = rows(proxy.url, args.part_kb)
        measure(far, shards, proxy, args.rounds, work)
        proxy.set(latency_s=None, bytes_per_s=None)
        direct = rows(proxy.url, args.part_kb)
        measure(direct, shards, proxy, args.rounds, work)

        version = crt_version()
        one_get = args.latency_ms / 1000 + size / (args.mbps * 1e6)
        print(f"\n{args.shards} shards of {size / 1e6:g} MB ({args.shards * size / 1e6:g} MB) from moto's S3 server "
              f"through the far network: {args.latency_ms:g} ms per request, {args.mbps:g} MB/s per connection "
              f"(on paper, one GET of a shard on one connection: {one_get:.2f} s). Fresh clients each round, rounds "
              f"interleaved, every shard checked by sha256; {os.cpu_count()} CPU cores; awscrt "
              f"{version or 'not installed'}.\n")
        far_table(far, args.shards, size, args.rounds)
        print(f"\nThe same rows with the network direct (no latency, no bandwidth cap), median of {args.rounds}:\n")
        direct_table(direct, args.shards, size, args.rounds)
        print("\nWhat pays (speed ratios from the table above; within "
              f"{NOISE - 1:.0%} counts as noise):\n")
        for line in conclusions(far, direct, args.shards):
            print(line)
        print(f"\n({time.perf_counter() - started:.0f} s)")
        failed = [row for row in far + direct if row.failed]
        for row in failed:
            print(f"{row.name}: {row.failed}", file=sys.stderr)
        return 1 if any(not row.optional for row in failed) else 0
    finally:
        if proxy is not None:
            proxy.stop()
        if proc is not None:
            stop_store(proc)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        object_store._clients.pop(os.getpid(), None)
        if saved_client is not None:
            object_store._clients[os.getpid()] = saved_client
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
