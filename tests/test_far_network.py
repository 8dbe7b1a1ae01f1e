"""tests/far_network.py, the far-network proxy, between real clients (http.client, boto3) and real
servers on 127.0.0.1 (a small HTTP/1.1 server here, moto's S3 server): bytes unchanged over
keep-alive connections, 100-continue, the latency and bandwidth as lower bounds, cuts, holds, the
requests it recorded, early closes on either side, a low rate that trickles, the rules that
answer, drop request headers and rewrite bodies, and the loopback-only refusal."""
from __future__ import annotations

import http.client
import http.server
import io
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from far_network import FarNetwork, Rewrite
from helpers import wait_until

BROKEN = (http.client.HTTPException, OSError)  # what a client sees when its connection drops


def payload(n: int) -> bytes:
    return random.Random(n).randbytes(n)


class _Origin(http.server.BaseHTTPRequestHandler):
    """GET /bytes/N (Content-Length), /chunked/N, /close/N (body until close), /truncated/N (closes
    after 10 of N bytes), /headers (the request's header names, one a line); HEAD /bytes/N; PUT
    echoes its body (a 100 Continue first on Expect)."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.server.seen.append((self.command, self.path, self.client_address[1]))
        kind, _, size = self.path.partition("?")[0].strip("/").partition("/")
        body = "\n".join(name.lower() for name in self.headers).encode() if kind == "headers" else payload(int(size))
        self.send_response(200)
        if kind == "chunked":
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for start in range(0, len(body), 10_000):
                piece = body[start:start + 10_000]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
            return
        if kind == "close":
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True
            return
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if kind == "truncated":
            self.wfile.write(body[:10])
            self.close_connection = True
            return
        self.wfile.write(body)

    def do_HEAD(self):
        self.server.seen.append((self.command, self.path, self.client_address[1]))
        self.send_response(200)
        self.send_header("Content-Length", self.path.rpartition("/")[2])
        self.end_headers()

    def do_PUT(self):
        self.server.seen.append((self.command, self.path, self.client_address[1]))
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def origin():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Origin)
    server.daemon_threads = True
    server.handle_error = lambda request, address: None  # the resets of cuts are expected here
    server.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def target(origin):
    origin.seen.clear()
    return ("127.0.0.1", origin.server_address[1])


@pytest.fixture(scope="module")
def moto_port():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    yield server.get_host_and_port()[1]
    server.stop()


_opened: list[http.client.HTTPConnection] = []


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    while _opened:
        _opened.pop().close()


def connect(proxy: FarNetwork | int) -> http.client.HTTPConnection:
    """A client connection to the proxy (or a port), closed when the test ends."""
    _opened.append(http.client.HTTPConnection("127.0.0.1", getattr(proxy, "port", proxy), timeout=10))
    return _opened[-1]


def get(conn: http.client.HTTPConnection, path: str, headers: dict | None = None, method: str = "GET"):
    conn.request(method, path, headers=headers or {})
    response = conn.getresponse()
    return response.status, response.read()


def answered(proxy: FarNetwork, n: int) -> list:
    """proxy.requests once it holds n (it is appended to just after the client got the last byte)."""
    assert wait_until(lambda: len(proxy.requests) >= n), proxy.requests
    return proxy.requests


def test_bytes_pass_unchanged_over_one_keep_alive_connection_and_every_request_is_recorded(target, origin):
    with FarNetwork(target, latency_s=0, bytes_per_s=None) as proxy:
        assert proxy.url == f"http://127.0.0.1:{proxy.port}"
        conn = connect(proxy)
        secret = {"Authorization": "AWS4-HMAC-SHA256 Credential=secret-key-id/x, Signature=deadbeef"}
        assert get(conn, "/bytes/100000?part=1&x=2", {**secret, "Range": "bytes=0-"}) == (200, payload(100_000))
        assert get(conn, "/chunked/70000", secret) == (200, payload(70_000))
        assert get(conn, "/bytes/5000", method="HEAD") == (200, b"")
        conn.request("PUT", "/echo", body=payload(20_000), headers=secret)
        assert conn.getresponse().read() == payload(20_000)
        assert len({port for _, _, port in origin.seen}) == 1  # one server connection for all four
        assert get(conn, "/close/3000") == (200, payload(3000))  # body until the server closes

        # Expect: 100-continue: the server's interim response arrives before the body is sent
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
            sock.sendall(b"PUT /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
            interim = b""
            while not interim.endswith(b"\r\n\r\n"):
                interim += sock.recv(1)
            assert interim.startswith(b"HTTP/1.1 100 ")
            sock.sendall(b"hello")
            response = http.client.HTTPResponse(sock, method="PUT")
            response.begin()
            assert (response.status, response.read()) == (200, b"hello")

        done = [(r.method, r.path, r.query, r.range_header, r.status, r.response_bytes) for r in answered(proxy, 6)]
        assert done == [("GET", "/bytes/100000", "part=1&x=2", "bytes=0-", 200, 100_000),
                        ("GET", "/chunked/70000", "", None, 200, 70_000), ("HEAD", "/bytes/5000", "", None, 200, 0),
                        ("PUT", "/echo", "", None, 200, 20_000), ("GET", "/close/3000", "", None, 200, 3000),
                        ("PUT", "/echo", "", None, 200, 5)]
        assert all(0 <= r.started <= r.ended for r in proxy.requests)


def test_boto3_put_with_100_continue_and_get_through_the_proxy(moto_port, tmp_path, monkeypatch):
    import boto3
    from botocore.config import Config

    for name, value in {"AWS_ACCESS_KEY_ID": "key-id-never-logged", "AWS_SECRET_ACCESS_KEY": "secret-never-logged",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": str(tmp_path / "none"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    data = payload(300_000)
    with FarNetwork(("127.0.0.1", moto_port), latency_s=0.01, bytes_per_s=None) as proxy:
        client = boto3.client("s3", endpoint_url=proxy.url, region_name="us-east-1",
                              config=Config(retries={"max_attempts": 1}))
        client.create_bucket(Bucket="far-network")
        client.put_object(Bucket="far-network", Key="blob", Body=io.BytesIO(data))  # file-like: Expect 100-continue
        assert client.get_object(Bucket="far-network", Key="blob")["Body"].read() == data
        part = client.get_object(Bucket="far-network", Key="blob", Range="bytes=100-199")["Body"].read()
        assert part == data[100:200]
        done = [(r.method, r.path, r.range_header, r.status, r.response_bytes) for r in answered(proxy, 4)]
    assert done[0][:2] == ("PUT", "/far-network") and done[1][:2] == ("PUT", "/far-network/blob")
    assert done[2:] == [("GET", "/far-network/blob", None, 200, 300_000),
                        ("GET", "/far-network/blob", "bytes=100-199", 206, 100)]


def test_every_request_pays_the_latency_once(target):
    with FarNetwork(target, latency_s=0.1, bytes_per_s=None) as proxy:
        conn = connect(proxy)
        start = time.monotonic()
        for _ in range(5):
            assert get(conn, "/bytes/1000") == (200, payload(1000))
        assert time.monotonic() - start >= 5 * 0.1 - 0.005
        assert all(r.ended - r.started >= 0.1 - 0.005 for r in answered(proxy, 5))
        proxy.set(latency_s=None)
        assert get(conn, "/bytes/10")[0] == 200


def test_the_bandwidth_per_connection_is_capped(target):
    with FarNetwork(target, latency_s=0, bytes_per_s=200_000) as proxy:
        conn = connect(proxy)
        start = time.monotonic()
        assert get(conn, "/bytes/300000") == (200, payload(300_000))
        assert time.monotonic() - start >= 1.4
        proxy.set(bytes_per_s=None)  # uncapped from now on; the body is still whole
        assert get(conn, "/bytes/300000") == (200, payload(300_000))


def test_a_low_rate_trickles_in_small_pieces(target):
    """At 300 B/s the body comes about 300 bytes a second from the start (pieces of what 50 ms
    carry), not 16 kB at once and then nothing for 55 s."""
    with FarNetwork(target, latency_s=0, bytes_per_s=300) as proxy, socket.create_connection(
            ("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"GET /bytes/100000 HTTP/1.1\r\nHost: x\r\n\r\n")
        came, started, marks = 0, time.monotonic(), []
        while len(marks) < 2:
            came += len(sock.recv(65536))
            if time.monotonic() - started >= len(marks) + 1:
                marks.append(came)
        first, second = marks[0], marks[1] - marks[0]  # each second's bytes (the head's included in the first)
        assert 150 < first < 600 and 150 < second < 450, marks


def test_a_rule_answers_drops_request_headers_and_rewrites_bodies(target, origin):
    def rule(seen):
        if seen.path == "/bytes/10":
            return Rewrite(status=503, answer=b"busy", headers=(("Retry-After", "2"),))
        if seen.path == "/headers":
            return Rewrite(drop=("X-Secret",))
        if seen.path.startswith(("/bytes/", "/chunked/")):
            return Rewrite(body=lambda body: body[::-1] + b"!")
        return None

    with FarNetwork(target, latency_s=0, bytes_per_s=None) as proxy:
        proxy.rewrite(rule)
        conn = connect(proxy)
        conn.request("GET", "/bytes/10?x=1")
        response = conn.getresponse()
        assert (response.status, response.read(), response.getheader("Retry-After")) == (503, b"busy", "2")
        assert origin.seen == []  # answered by the proxy
        status, names = get(conn, "/headers", {"X-Secret": "s3cr3t", "X-Kept": "1"})
        assert status == 200 and b"x-kept" in names.split(b"\n") and b"x-secret" not in names.split(b"\n")
        assert get(conn, "/bytes/5000") == (200, payload(5000)[::-1] + b"!")
        assert get(conn, "/chunked/70000") == (200, payload(70_000)[::-1] + b"!")  # sent whole, its length set
        assert get(conn, "/bytes/5000", method="HEAD") == (200, b"")
        proxy.rewrite(None)
        assert get(conn, "/bytes/10") == (200, payload(10))  # the same connection throughout
        done = [(r.method, r.path, r.query, r.status, r.response_bytes) for r in answered(proxy, 6)]
    assert done == [("GET", "/bytes/10", "x=1", 503, 4), ("GET", "/headers", "", 200, len(names)),
                    ("GET", "/bytes/5000", "", 200, 5001), ("GET", "/chunked/70000", "", 200, 70_001),
                    ("HEAD", "/bytes/5000", "", 200, 0), ("GET", "/bytes/10", "", 200, 10)]
    assert len({port for _, _, port in origin.seen}) == 1


def test_a_cut_drops_a_body_mid_way_refuses_new_connections_then_ends(target):
    with FarNetwork(target, latency_s=0, bytes_per_s=200_000) as proxy:
        conn = connect(proxy)
        conn.request("GET", "/bytes/1000000")
        response = conn.getresponse()
        assert response.read(50_000) == payload(1_000_000)[:50_000]
        proxy.cut(1.0)
        cut_at = time.monotonic()
        with pytest.raises(BROKEN):
            response.read()
        with pytest.raises(BROKEN):
            get(connect(proxy), "/bytes/10")
        assert proxy.requests == []  # nothing was answered in full
        time.sleep(max(0.0, cut_at + 1.05 - time.monotonic()))
        assert get(connect(proxy), "/bytes/10") == (200, payload(10))
        assert wait_until(lambda: proxy.open_connections <= 1)
        proxy.cut(60)  # ended early
        with pytest.raises(BROKEN):
            get(connect(proxy), "/bytes/10")
        proxy.end_cut()
        assert get(connect(proxy), "/bytes/10") == (200, payload(10))


def test_a_hold_keeps_requests_waiting_until_release(target):
    with FarNetwork(target, latency_s=0, bytes_per_s=None) as proxy, ThreadPoolExecutor(1) as pool:
        conn = connect(proxy)
        assert get(conn, "/bytes/100") == (200, payload(100))
        proxy.hold()
        waiting = pool.submit(get, conn, "/bytes/200")
        time.sleep(0.5)
        assert not waiting.done() and len(proxy.requests) == 1
        proxy.release()
        assert waiting.result(timeout=5) == (200, payload(200))

        proxy.hold()
        waiting = pool.submit(get, connect(proxy), "/bytes/300")
        time.sleep(0.2)
        assert not waiting.done()
        proxy.release()
        assert waiting.result(timeout=5) == (200, payload(300))
        assert [r.response_bytes for r in answered(proxy, 3)] == [100, 200, 300]


def test_early_closes_on_either_side_leave_the_proxy_serving_and_stop_ends_everything(target):
    proxy = FarNetwork(target, latency_s=0, bytes_per_s=200_000).start()
    conn = connect(proxy)
    conn.request("GET", "/bytes/1000000")
    conn.getresponse().read(10_000)
    conn.close()  # the client leaves mid-body
    with pytest.raises(http.client.IncompleteRead):
        get(connect(proxy), "/truncated/1000")  # the server leaves mid-body
    assert wait_until(lambda: proxy.open_connections == 0)
    assert get(connect(proxy), "/bytes/10") == (200, payload(10))
    assert [r.response_bytes for r in answered(proxy, 1)] == [10]

    streaming = connect(proxy)
    streaming.request("GET", "/bytes/1000000")
    response = streaming.getresponse()
    proxy.hold()
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(get, connect(proxy), "/bytes/10")
        assert wait_until(lambda: proxy.open_connections == 3), proxy.open_connections  # with the one of /bytes/10
        start, serving = time.monotonic(), [t for t in threading.enumerate() if t.name == "far-network"]
        proxy.stop()
        assert time.monotonic() - start < 3
        # its own thread ended (another test's proxy, a session fixture's, may be serving beside it)
        assert [t for t in threading.enumerate() if t.name == "far-network"] == [t for t in serving if t.is_alive()]
        assert len(serving) == 1 + len([t for t in threading.enumerate() if t.name == "far-network"])
        with pytest.raises(BROKEN):
            held.result(timeout=5)
    with pytest.raises(BROKEN):
        response.read()

    with socket.socket() as closed:  # a server that is not there: the client's connection drops
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with FarNetwork(("127.0.0.1", port), latency_s=0, bytes_per_s=None) as proxy, pytest.raises(BROKEN):
        get(connect(proxy), "/bytes/10")


@pytest.mark.parametrize("host", ["10.0.0.1", "example.com", "0.0.0.0", "192.168.1.20", "::ffff:10.0.0.1", "2001:db8::1"])
def test_a_target_off_loopback_is_refused(host):
    with pytest.raises(ValueError, match="not a loopback address") as refused:
        FarNetwork((host, 9000))
    assert "\n" not in str(refused.value)


def test_loopback_targets_are_accepted():
    assert FarNetwork(("127.0.0.2", 9000)).target == ("127.0.0.2", 9000)
    assert FarNetwork(("::1", 9000)).target == ("::1", 9000)
    assert FarNetwork(("localhost", 9000)).target == ("127.0.0.1", 9000)
