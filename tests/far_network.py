"""The tests' far network in front of a local S3-compatible server (moto's): an HTTP/1.1
forwarding proxy on 127.0.0.1 that adds latency per request, caps the bandwidth of each
connection, cuts all connections for a while ("outages"), holds requests back, answers or rewrites
them by rule, and records every request it answered. bench/far_store.py and bench/store_clients.py
use it too, in process like the tests: it has no command line and writes no file (``requests`` is
the record)::

    with FarNetwork(target=("127.0.0.1", server_port), latency_s=0.1, bytes_per_s=2e6) as proxy:
        client = boto3.client("s3", endpoint_url=proxy.url)
        proxy.cut(5)
        proxy.rewrite(lambda seen: Rewrite(status=503, answer=b"<Error><Code>SlowDown</Code></Error>")
                      if seen.method == "GET" else None)

The contract:

* Loopback only: it listens on 127.0.0.1 and connects only to a loopback target (127.0.0.0/8, ::1
  or "localhost", which means 127.0.0.1); any other target is refused with a one-line ValueError
  before anything is opened.
* Each client connection gets one server connection of its own (reopened when the server closed
  it); requests on it are forwarded one after the other, bytes unchanged (the Host header and the
  request signature stay valid). ``Expect: 100-continue`` works: the server's interim response
  reaches the client before the body is forwarded.
* Latency: a request is forwarded ``latency_s`` after its head arrived; every request pays it once.
* Bandwidth: server-to-client bytes of each connection are paced to ``bytes_per_s`` (None: no
  cap), in pieces of 16 kB or, at a lower rate, of what 50 ms carry (so that 300 B/s trickles in
  15-byte pieces rather than waiting a minute for 16 kB); client-to-server bytes are not paced.
* Cut: every open connection is closed at once, with a reset where a request is under way (a plain
  close between requests, so that a response sent in full stays whole), and until the cut ends
  every new connection is accepted and reset; then service is normal again.
* Hold: requests that arrive while held wait, unforwarded, until the release.
* A server that cannot be reached, or that closes mid-response: the client's connection is closed
  (no 502 is made up); other connections go on.
* Rewrite: a rule (:meth:`FarNetwork.rewrite`) sees each request (:class:`Seen`: method, path,
  query, headers) once its latency and any hold are over, and returns None (forwarded as it is)
  or a :class:`Rewrite`: a canned answer (status, body, headers; nothing is forwarded and the
  request's own body is read and dropped), or the request forwarded without some of its headers
  (the server then sees a request whose signature no longer covers it: moto does not check),
  and/or its response's body rewritten (read whole, for small answers such as a listing; its
  length set anew). Rules run on the proxy's thread: they must be quick.
* Record: a request is recorded in ``requests`` when its response has been sent completely (an
  aborted one is not), without its headers (they carry credentials and signatures).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import http
import ipaddress
import math
import socket
import struct
import threading
from typing import Callable

PIECE = 16 * 1024          # bytes per paced write to a client, at most
PIECE_S = 0.05             # s: at a low rate, a paced write carries what this time allows (at least a byte)
HEAD_LIMIT = 64 * 1024     # the longest request or response head accepted
EXPECT_WAIT_S = 1.0        # how long to wait for a server's "100 Continue" before forwarding the body anyway
STOP_WAIT_S = 5.0          # how long stop() waits for the connections and the thread to end
_KEEP = object()           # set(): "leave this setting as it is"


@dataclasses.dataclass(frozen=True)
class Request:
    """One answered request. ``path`` is the URL path without the query string, ``query`` the raw
    query string ("" if none), ``range_header`` the Range header or None, ``response_bytes`` the
    bytes of the response body (payload bytes for a chunked one), ``started`` (its head arrived)
    and ``ended`` (its response was sent) in seconds since the proxy started."""
    method: str
    path: str
    query: str
    range_header: str | None
    status: int
    response_bytes: int
    started: float
    ended: float


@dataclasses.dataclass(frozen=True)
class Seen:
    """A request as a rule sees it: ``path`` without the query string, ``query`` the raw query
    string, ``headers`` with names in lower case (several of a name joined by ", ")."""
    method: str
    path: str
    query: str
    headers: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Rewrite:
    """What a rule does with one request: with ``status``, the proxy answers it itself with
    ``answer`` as the body and ``headers`` besides Content-Length; else it forwards the request
    without the headers named in ``drop`` (any case), and ``body``, if given, makes the response's
    body from the server's (read whole)."""
    status: int | None = None
    answer: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    drop: tuple[str, ...] = ()
    body: Callable[[bytes], bytes] | None = None


def loopback_host(host: str) -> str:
    """The address to connect to for ``host``: itself for a loopback IP address, 127.0.0.1 for
    "localhost"; ValueError (one line) for anything else, which is never resolved or contacted."""
    if host.lower() == "localhost":
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        address = None
    if address is None or not address.is_loopback:
        raise ValueError(f"target {host!r} is not a loopback address (127.0.0.0/8, ::1 or localhost); "
                         "the far network connects to nothing else")
    return str(address)


class _BadMessage(ValueError):
    """A head or chunk that is not HTTP/1.1: the connection ends."""


class _Head:
    """A request or response head: its raw bytes (forwarded unchanged), first line and headers."""

    def __init__(self, raw: bytes):
        self.raw = raw
        lines = raw.decode("latin-1").split("\r\n")
        self.first = lines[0].split(" ", 2)
        self.headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, colon, value = line.partition(":")
            if not colon:
                raise _BadMessage(f"bad header line {line[:40]!r}")
            key, value = name.strip().lower(), value.strip()
            self.headers[key] = f"{self.headers[key]}, {value}" if key in self.headers else value

    def tokens(self, name: str) -> set[str]:
        return {token.strip().lower() for token in self.headers.get(name, "").split(",")}

    def framing(self, until_close: bool) -> tuple[str, int]:
        """How the body is delimited: ("chunked", 0), ("length", N), or without either header
        ("close", 0) for a response (``until_close``) and ("length", 0) for a request."""
        if "chunked" in self.tokens("transfer-encoding"):
            return "chunked", 0
        if "content-length" in self.headers:
            length = int(self.headers["content-length"].split(",")[0])
            if length < 0:
                raise _BadMessage("negative Content-Length")
            return "length", length
        return ("close", 0) if until_close else ("length", 0)


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


def _without(raw: bytes, names: set[str]) -> bytes:
    """A head without its header lines named in ``names`` (lower case)."""
    first, *lines = raw.split(b"\r\n")
    kept = [line for line in lines if line.partition(b":")[0].strip().decode("latin-1").lower() not in names]
    return b"\r\n".join([first, *kept])


def _with_length(raw: bytes, length: int) -> bytes:
    """A response head for a body of ``length`` bytes sent whole (no chunked framing)."""
    head = _without(raw, {"content-length", "transfer-encoding"})
    return head[:-2] + b"Content-Length: %d\r\n\r\n" % length


async def _read_payload(reader: asyncio.StreamReader, kind: str, length: int) -> bytes:
    """One body's payload, read whole (chunked framing and trailers taken off)."""
    if kind == "length":
        return await reader.readexactly(length)
    if kind == "close":
        return await reader.read()
    parts = []
    while size := int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip(), 16):
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)
    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
        pass
    return b"".join(parts)


async def _read_response_head(reader: asyncio.StreamReader) -> tuple[int, _Head]:
    head = _Head(await _read_head(reader))
    if len(head.first) < 2 or not head.first[0].startswith("HTTP/") or not head.first[1].isdigit():
        raise _BadMessage("bad status line")
    return int(head.first[1]), head


async def _relay_exactly(reader: asyncio.StreamReader, length: int, send: Callable) -> None:
    """Copies ``length`` bytes from ``reader`` to the coroutine ``send`` as they come."""
    left = length
    while left:
        data = await reader.read(min(left, PIECE))
        if not data:
            raise asyncio.IncompleteReadError(b"", left)
        left -= len(data)
        await send(data)


async def _relay_body(reader: asyncio.StreamReader, kind: str, length: int, send: Callable) -> int:
    """Copies one body from ``reader`` to the coroutine ``send`` as it comes; the payload bytes."""
    if kind == "length":
        await _relay_exactly(reader, length, send)
        return length
    if kind == "close":
        total = 0
        while True:
            data = await reader.read(PIECE)
            if not data:
                return total
            total += len(data)
            await send(data)
    total = 0  # chunked: size line, data and CRLF per chunk, up to the 0-size chunk and the trailers
    while True:
        line = await reader.readuntil(b"\r\n")
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise _BadMessage("bad chunk size") from None
        await send(line)
        if size == 0:
            break
        total += size
        await _relay_exactly(reader, size + 2, send)  # the data and its CRLF
    while True:
        line = await reader.readuntil(b"\r\n")
        await send(line)
        if line == b"\r\n":
            return total


def _reset_on_close(writer: asyncio.StreamWriter) -> None:
    """SO_LINGER 0: closing the socket sends a reset, as a dropped path would look to the peer."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass


class _Connection:
    """A client connection, its server connection and its pacing state."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, task: asyncio.Task):
        self.client_r, self.client_w, self.task = reader, writer, task
        self.up_r: asyncio.StreamReader | None = None
        self.up_w: asyncio.StreamWriter | None = None
        self.busy = False      # a request is under way: a cut resets instead of closing
        self.aborted = False   # cut or stopped: forward nothing more
        self.free_at = 0.0     # loop time at which the next paced piece may go

    def close_upstream(self) -> None:
        if self.up_w is not None:
            self.up_w.transport.abort()
        self.up_r = self.up_w = None

    def abort(self) -> None:
        self.aborted = True
        if self.busy:
            _reset_on_close(self.client_w)
        self.client_w.transport.abort()
        self.close_upstream()


class FarNetwork:
    """The proxy; see the module docstring for its contract. Settings, rules, cuts and holds may
    be changed from any thread while it runs."""

    def __init__(self, target: tuple[str, int], latency_s: float | None = 0.1, bytes_per_s: float | None = 2e6):
        if not isinstance(target, (tuple, list)) or len(target) != 2:
            raise ValueError(f"target must be (host, port), got {target!r}")
        host, target_port = target
        self._host = loopback_host(str(host))
        if not isinstance(target_port, int) or not 0 < target_port < 65536:
            raise ValueError(f"target port must be in 1..65535, got {target_port!r}")
        self._target_port = target_port
        self.target = (self._host, target_port)
        self._latency_s, self._bytes_per_s = 0.0, None
        self.set(latency_s=latency_s, bytes_per_s=bytes_per_s)
        self._lock = threading.Lock()
        self._requests: list[Request] = []
        self._rule: Callable[[Seen], Rewrite | None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[_Connection] = set()
        self._released: asyncio.Event | None = None
        self._cut_until = 0.0
        self._closing = False
        self._t0 = 0.0
        self.port = 0

    # ------------------------------------------------------------------ control, from any thread

    def start(self) -> FarNetwork:
        """Listens on a free port of 127.0.0.1 (``self.port``) and serves from a daemon thread named
        "far-network" with an event loop of its own; returns self."""
        if self._thread is not None:
            raise RuntimeError("FarNetwork.start: this proxy was started already")
        self._loop = asyncio.new_event_loop()
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="far-network", daemon=True)
        self._thread.start()
        try:
            self.port = ready.result(timeout=30)
        except BaseException:
            self._thread.join(STOP_WAIT_S)
            raise
        return self

    def stop(self) -> None:
        """Closes every connection and the listener and joins the thread (within a few seconds)."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None or not thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=STOP_WAIT_S)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass  # the loop stops below all the same
        if not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
        thread.join(STOP_WAIT_S)
        if thread.is_alive():
            raise RuntimeError(f"FarNetwork.stop: the proxy thread did not end within {STOP_WAIT_S:g} s")

    def __enter__(self) -> FarNetwork:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def requests(self) -> list[Request]:
        """The answered requests so far, in order of completion (a copy). A request is added once
        its last byte is with the kernel: a client in another thread may have read it a moment
        earlier."""
        with self._lock:
            return list(self._requests)

    @property
    def open_connections(self) -> int:
        """Client connections being served now."""
        return len(self._conns)

    def set(self, latency_s=_KEEP, bytes_per_s=_KEEP) -> None:
        """Changes the latency per request (None: 0) and the bandwidth per connection (None: no
        cap); a setting left out stays. Takes effect for the next request and the next piece."""
        if latency_s is not _KEEP:
            latency = 0.0 if latency_s is None else float(latency_s)
            if not math.isfinite(latency) or latency < 0:
                raise ValueError(f"latency_s must be a finite number >= 0, got {latency_s!r}")
            self._latency_s = latency
        if bytes_per_s is not _KEEP:
            rate = None if bytes_per_s is None else float(bytes_per_s)
            if rate is not None and (not math.isfinite(rate) or rate <= 0):
                raise ValueError(f"bytes_per_s must be a finite number > 0 or None, got {bytes_per_s!r}")
            self._bytes_per_s = rate

    def rewrite(self, rule: Callable[[Seen], Rewrite | None] | None) -> None:
        """From the next request on, ``rule(request)`` says what to do with each (None: forward
        it as it is); ``rewrite(None)`` ends the rewriting."""
        self._rule = rule

    def cut(self, seconds: float) -> None:
        """An outage now, for ``seconds``: open connections drop, new ones are reset."""
        value = float(seconds)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"seconds must be a finite number >= 0, got {seconds!r}")
        self._call(self._cut_now, value)

    def end_cut(self) -> None:
        """Ends an outage now: new connections are served again."""
        self._call(self._end_cut)

    def hold(self) -> None:
        """Requests that arrive from now on wait, unforwarded, until release()."""
        self._call(lambda: self._released.clear())

    def release(self) -> None:
        """Ends a hold: the waiting requests go on."""
        self._call(lambda: self._released.set())

    def _call(self, function: Callable, *args):
        """Runs ``function`` on the proxy's loop and waits for it: applied before this returns."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            raise RuntimeError("FarNetwork is not running; call start() first")
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run():
            try:
                done.set_result(function(*args))
            except BaseException as error:  # handed to the calling thread
                done.set_exception(error)

        loop.call_soon_threadsafe(run)
        return done.result(timeout=STOP_WAIT_S)

    # ------------------------------------------------------------------ the loop's thread

    def _run(self, ready: concurrent.futures.Future) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            self._server = loop.run_until_complete(self._listen())
        except BaseException as error:
            ready.set_exception(error)
            loop.close()
            return
        ready.set_result(self._server.sockets[0].getsockname()[1])
        try:
            loop.run_forever()
        finally:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(asyncio.sleep(0))  # the aborted transports close their sockets
            loop.close()

    async def _listen(self) -> asyncio.AbstractServer:
        self._t0 = asyncio.get_running_loop().time()
        self._released = asyncio.Event()
        self._released.set()
        return await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=HEAD_LIMIT)

    async def _shutdown(self) -> None:
        self._closing = True  # a connection accepted but not yet served is reset when its turn comes
        self._server.close()
        tasks = [conn.task for conn in self._conns]
        for conn in list(self._conns):
            conn.abort()
            conn.task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_WAIT_S / 2)
        try:
            await asyncio.wait_for(self._server.wait_closed(), STOP_WAIT_S / 4)
        except asyncio.TimeoutError:
            pass

    def _end_cut(self) -> None:
        self._cut_until = 0.0

    def _cut_now(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        self._cut_until = max(self._cut_until, loop.time() + seconds)
        for conn in list(self._conns):
            conn.abort()
            conn.task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing or asyncio.get_running_loop().time() < self._cut_until:
            _reset_on_close(writer)
            writer.transport.abort()
            return
        conn = _Connection(reader, writer, asyncio.current_task())
        # drain() then returns only once everything is with the kernel: pacing is real, and a
        # response counts as sent only when it is
        writer.transport.set_write_buffer_limits(high=0)
        self._conns.add(conn)
        try:
            while not conn.aborted and await self._exchange(conn):
                pass
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
                asyncio.CancelledError):
            pass  # the client, the server, a cut or stop() ended this connection
        finally:
            self._conns.discard(conn)
            conn.client_w.transport.abort()
            conn.close_upstream()

    async def _exchange(self, conn: _Connection) -> bool:
        """Forwards one request and its response; False when the connection is to close."""
        try:
            raw = await _read_head(conn.client_r)
        except asyncio.IncompleteReadError as error:
            if error.partial:
                raise
            return False  # the client closed between requests
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        request = _Head(raw)
        if len(request.first) != 3:
            raise _BadMessage("bad request line")
        method, target = request.first[0].upper(), request.first[1]
        kind, length = request.framing(until_close=False)
        has_body = kind == "chunked" or length > 0
        expect = has_body and "100-continue" in request.tokens("expect")
        conn.busy = True
        await self._released.wait()
        delay = arrived + self._latency_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if conn.aborted:
            return False
        path, _, query = target.partition("?")
        rule = self._rule
        rewrite = rule(Seen(method, path, query, dict(request.headers))) if rule is not None else None
        if rewrite is not None and rewrite.status is not None:
            return await self._answer(conn, request, rewrite, arrived)
        if rewrite is not None and rewrite.drop:
            request.raw = _without(request.raw, {name.lower() for name in rewrite.drop})

        sent = 0  # response bytes sent to the client for this request
        wants_body = True

        async def to_client(data: bytes) -> None:
            nonlocal sent
            sent += len(data)
            await self._to_client(conn, data)

        async def to_server(data: bytes) -> None:
            conn.up_w.write(data)
            await conn.up_w.drain()

        for attempt in range(2):
            reused = await self._open_upstream(conn)
            try:
                await to_server(request.raw)
                response = await self._await_continue(conn, to_client) if expect else None
                wants_body = response is None
                if has_body and wants_body:
                    await _relay_body(conn.client_r, kind, length, to_server)
                if response is None:
                    response = await self._final_response(conn, to_client)
                break
            except (asyncio.IncompleteReadError, ConnectionError) as error:
                # a server that had closed its idle connection just before: once more, on a new one
                stale = isinstance(error, ConnectionError) or not error.partial
                if attempt or not reused or has_body or sent or not stale:
                    raise
                conn.close_upstream()
        status, head = response

        if method == "HEAD" or 100 <= status < 200 or status in (204, 304):
            kind, length = "length", 0
        else:
            kind, length = head.framing(until_close=True)
        if rewrite is not None and rewrite.body is not None and (kind != "length" or length):
            payload = rewrite.body(await _read_payload(conn.up_r, kind, length))
            await to_client(_with_length(head.raw, len(payload)))
            await to_client(payload)
            body = len(payload)
        else:
            await to_client(head.raw)
            body = await _relay_body(conn.up_r, kind, length, to_client)
        conn.busy = False
        ended = loop.time()
        self._answered(Request(method=method, path=path, query=query, range_header=request.headers.get("range"),
                               status=status, response_bytes=body, started=round(arrived - self._t0, 6),
                               ended=round(ended - self._t0, 6)))
        closes = "close" in request.tokens("connection") or "close" in head.tokens("connection") or (
            head.first[0] == "HTTP/1.0" and "keep-alive" not in head.tokens("connection"))
        return wants_body and kind != "close" and not closes

    async def _answer(self, conn: _Connection, request: _Head, rewrite: Rewrite, arrived: float) -> bool:
        """Answers a request with ``rewrite``'s canned response; False when the connection is to
        close (a request that expected 100-continue: its body never comes)."""
        method, target = request.first[0].upper(), request.first[1]
        kind, length = request.framing(until_close=False)
        expect = (kind == "chunked" or length > 0) and "100-continue" in request.tokens("expect")
        if (kind == "chunked" or length > 0) and not expect:
            await _read_payload(conn.client_r, kind, length)
        body = b"" if method == "HEAD" else rewrite.answer
        extra = [*rewrite.headers, *([("Connection", "close")] if expect else [])]
        head = "".join([f"HTTP/1.1 {rewrite.status} {http.HTTPStatus(rewrite.status).phrase}\r\n",
                        f"Content-Length: {len(rewrite.answer)}\r\n", *(f"{name}: {value}\r\n" for name, value in extra),
                        "\r\n"])
        await self._to_client(conn, head.encode("latin-1") + body)
        conn.busy = False
        loop = asyncio.get_running_loop()
        path, _, query = target.partition("?")
        self._answered(Request(method=method, path=path, query=query, range_header=request.headers.get("range"),
                               status=rewrite.status, response_bytes=len(body), started=round(arrived - self._t0, 6),
                               ended=round(loop.time() - self._t0, 6)))
        return not expect and "close" not in request.tokens("connection")

    async def _open_upstream(self, conn: _Connection) -> bool:
        """Connects to the target unless the connection is open still; True when reused."""
        if conn.up_w is not None and not conn.up_r.at_eof() and not conn.up_w.is_closing():
            return True
        conn.close_upstream()
        conn.up_r, conn.up_w = await asyncio.open_connection(self._host, self._target_port, limit=HEAD_LIMIT)
        return False

    async def _await_continue(self, conn: _Connection, to_client: Callable) -> tuple[int, _Head] | None:
        """After a head with ``Expect: 100-continue``: None when the body is to follow (the server
        sent 100 Continue, which goes to the client, or nothing within EXPECT_WAIT_S), or the
        server's final response when it wants no body."""
        while True:
            try:
                status, head = await asyncio.wait_for(_read_response_head(conn.up_r), EXPECT_WAIT_S)
            except asyncio.TimeoutError:
                return None  # as curl and botocore do: a server that ignores Expect gets the body
            if status >= 200:
                return status, head
            await to_client(head.raw)
            if status == 100:
                return None

    async def _final_response(self, conn: _Connection, to_client: Callable) -> tuple[int, _Head]:
        """The server's final response head; interim (1xx) ones on the way go to the client."""
        while True:
            status, head = await _read_response_head(conn.up_r)
            if status >= 200:
                return status, head
            await to_client(head.raw)

    async def _to_client(self, conn: _Connection, data: bytes) -> None:
        """Writes to the client in pieces paced to the bandwidth at the time of each piece."""
        view, start = memoryview(data), 0
        while start < len(view):
            rate = self._bytes_per_s
            piece = view[start:start + (PIECE if rate is None else max(1, min(PIECE, int(rate * PIECE_S))))]
            start += len(piece)
            if rate is not None:
                now = asyncio.get_running_loop().time()
                begin = max(now, conn.free_at)  # no credit saved up while idle
                conn.free_at = begin + len(piece) / rate
                if begin > now:
                    await asyncio.sleep(begin - now)
            conn.client_w.write(piece)
            await conn.client_w.drain()

    def _answered(self, request: Request) -> None:
        with self._lock:
            self._requests.append(request)
