"""Connect-protocol transport over HTTP/1.1 (asyncio streams, standard library).

The transport owns a small pool of keep-alive connections to one dsecd, over
TCP or a Unix socket. It speaks the Connect protocol with JSON: unary calls
are a POST with an application/json body; server streams are a POST with one
enveloped message, answered by a sequence of envelopes whose last one
(flag 0x02) carries the end of the stream and maybe an error.

Every call has a deadline. Each read and write waits at most until that
deadline, so a daemon that dies or stalls mid-call gives a typed error
(Unavailable or Timeout) and never a hang.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import struct
import time
from typing import Any, AsyncIterator, Dict, Optional, Tuple

from . import errors

DEFAULT_ADDR = "unix:///var/lib/dsec/dsecd.sock"

_TRANSPORT_ERRORS = (OSError, EOFError, asyncio.IncompleteReadError, ConnectionError)


def resolve_addr(addr: Optional[str] = None) -> Tuple[str, Any]:
    """Parse an address: unix:///path, http://host:port or host:port.

    With no address it uses $DSEC_ADDR, else the local daemon's socket.
    Returns ("unix", path) or ("tcp", (host, port)).
    """
    addr = addr or os.environ.get("DSEC_ADDR") or DEFAULT_ADDR
    if addr.startswith("unix://"):
        path = addr[len("unix://"):]
        if not path:
            raise errors.InvalidArgument(f"address {addr!r} names no socket")
        return "unix", path
    if addr.startswith("http://"):
        addr = addr[len("http://"):].rstrip("/")
    elif "://" in addr:
        raise errors.InvalidArgument(f"address {addr!r}: only unix:// and http:// are supported")
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise errors.InvalidArgument(f"address {addr!r} has no port")
    return "tcp", (host.strip("[]") or "127.0.0.1", int(port))


class Deadline:
    """An absolute point in time a call must finish by (None: no limit)."""

    def __init__(self, timeout: Optional[float]):
        self.timeout = timeout
        self.at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> Optional[float]:
        if self.at is None:
            return None
        return self.at - time.monotonic()

    def header_ms(self) -> Optional[int]:
        rem = self.remaining()
        if rem is None:
            return None
        return max(1, int(rem * 1000))

    async def wait(self, aw, what: str):
        """Await aw, raising errors.Timeout when the deadline passes first."""
        rem = self.remaining()
        if rem is None:
            return await aw
        if rem <= 0:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise errors.Timeout(f"{what}: call timed out after {self.timeout:g}s")
        try:
            return await asyncio.wait_for(aw, rem)
        except asyncio.TimeoutError:
            raise errors.Timeout(f"{what}: call timed out after {self.timeout:g}s") from None


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.used = time.monotonic()
        self.reused = False

    def alive(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:
            pass


class _Response:
    """An HTTP/1.1 response whose body is read incrementally."""

    def __init__(self, conn: _Conn, status: int, headers: Dict[str, str], deadline: Deadline, what: str):
        self.conn = conn
        self.status = status
        self.headers = headers
        self.deadline = deadline
        self.what = what
        te = headers.get("transfer-encoding", "").lower()
        self.chunked = "chunked" in te
        cl = headers.get("content-length")
        self.left = int(cl) if (cl is not None and not self.chunked) else None
        self.done = self.left == 0
        self.keep_alive = headers.get("connection", "").lower() != "close" and (self.chunked or self.left is not None)

    async def read_some(self) -> bytes:
        """The next piece of the body, or b"" at its end."""
        if self.done:
            return b""
        r = self.conn.reader
        w = self.deadline.wait
        if self.chunked:
            line = await w(r.readline(), self.what)
            if not line.endswith(b"\n"):
                raise EOFError("connection closed inside a chunked body")
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the blank line
                    line = await w(r.readline(), self.what)
                    if line in (b"\r\n", b"\n"):
                        break
                    if not line:
                        raise EOFError("connection closed inside chunked trailers")
                self.done = True
                return b""
            data = await w(r.readexactly(size + 2), self.what)
            return data[:-2]
        if self.left is not None:
            data = await w(r.read(min(self.left, 1 << 20)), self.what)
            if not data:
                raise EOFError("connection closed inside the body")
            self.left -= len(data)
            if self.left == 0:
                self.done = True
            return data
        data = await w(r.read(1 << 20), self.what)
        if not data:
            self.done = True
        return data

    async def read_all(self) -> bytes:
        parts = []
        while True:
            b = await self.read_some()
            if not b:
                return b"".join(parts)
            parts.append(b)


class _Call:
    """Tracks how far one attempt got, to decide whether it may be retried."""

    def __init__(self):
        self.fresh_conn = False  # the request went out on a brand new connection
        self.got_response = False


class Transport:
    """A pool of HTTP/1.1 connections to one dsecd, speaking Connect/JSON.

    A Transport is bound to the event loop that first uses it; used from
    another loop it drops its idle connections and starts over.
    """

    def __init__(self, addr: Optional[str] = None, *, max_idle: int = 32,
                 connect_timeout: float = 10.0, max_retries: int = 6,
                 idle_ttl: float = 30.0):
        self.kind, self.where = resolve_addr(addr)
        self.host_header = "dsecd" if self.kind == "unix" else f"{self.where[0]}:{self.where[1]}"
        self.max_idle = max_idle
        self.connect_timeout = connect_timeout
        self.max_retries = max_retries
        self.idle_ttl = idle_ttl
        self._idle: "collections.deque[_Conn]" = collections.deque()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.connections_opened = 0

    # --- connections -----------------------------------------------------

    async def _acquire(self, deadline: Deadline, what: str) -> _Conn:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._idle.clear()
            self._loop = loop
        now = time.monotonic()
        while self._idle:
            c = self._idle.pop()
            if c.alive() and now - c.used < self.idle_ttl:
                c.reused = True
                return c
            c.close()
        rem = deadline.remaining()
        limit = self.connect_timeout if rem is None else min(rem, self.connect_timeout)
        d = Deadline(limit)
        try:
            if self.kind == "unix":
                reader, writer = await d.wait(asyncio.open_unix_connection(self.where, limit=1 << 22), what)
            else:
                reader, writer = await d.wait(
                    asyncio.open_connection(self.where[0], self.where[1], limit=1 << 22), what)
        except errors.Timeout:
            if deadline.remaining() is not None and deadline.remaining() <= 0:
                raise
            raise errors.Unavailable(f"{what}: connect to {self.describe()}: timed out") from None
        except _TRANSPORT_ERRORS as e:
            raise errors.Unavailable(f"{what}: connect to {self.describe()}: {e}") from None
        self.connections_opened += 1
        return _Conn(reader, writer)

    def _release(self, c: _Conn) -> None:
        if c.alive() and len(self._idle) < self.max_idle and asyncio.get_running_loop() is self._loop:
            c.used = time.monotonic()
            c.reused = False
            self._idle.append(c)
        else:
            c.close()

    def describe(self) -> str:
        return f"unix://{self.where}" if self.kind == "unix" else f"{self.where[0]}:{self.where[1]}"

    async def close(self) -> None:
        while self._idle:
            self._idle.pop().close()

    # --- one HTTP exchange -------------------------------------------------

    async def _send(self, path: str, ctype: str, body: bytes, deadline: Deadline,
                    call: _Call, what: str) -> _Response:
        """Send a POST and read the response head. Raises typed errors."""
        conn = await self._acquire(deadline, what)
        call.fresh_conn = not conn.reused
        head = [f"POST {path} HTTP/1.1", f"Host: {self.host_header}",
                f"Content-Type: {ctype}", f"Content-Length: {len(body)}",
                "Connect-Protocol-Version: 1", "User-Agent: libdsec-python"]
        ms = deadline.header_ms()
        if ms is not None:
            head.append(f"Connect-Timeout-Ms: {ms}")
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        try:
            conn.writer.write(data)
            await deadline.wait(conn.writer.drain(), what)
            line = await deadline.wait(conn.reader.readline(), what)
            if not line:
                raise EOFError("connection closed before the response")
            call.got_response = True
            parts = line.decode("latin-1").split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/"):
                raise EOFError(f"bad response line {line[:80]!r}")
            status = int(parts[1])
            headers: Dict[str, str] = {}
            while True:
                line = await deadline.wait(conn.reader.readline(), what)
                if line in (b"\r\n", b"\n"):
                    break
                if not line:
                    raise EOFError("connection closed inside the response head")
                k, _, v = line.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip()
        except errors.Timeout:
            conn.close()
            raise
        except _TRANSPORT_ERRORS as e:
            conn.close()
            if conn.reused and not call.got_response:
                raise _StaleConn() from None
            raise errors.Unavailable(f"{what}: {self.describe()}: {e or type(e).__name__}") from None
        except BaseException:
            conn.close()
            raise
        return _Response(conn, status, headers, deadline, what)

    def _finish(self, resp: _Response) -> None:
        if resp.done and resp.keep_alive:
            self._release(resp.conn)
        else:
            resp.conn.close()

    # --- Connect unary -------------------------------------------------------

    async def unary(self, service: str, method: str, msg: Dict[str, Any], *,
                    timeout: Optional[float], idempotent: bool = False,
                    creating: bool = False) -> Dict[str, Any]:
        """Call a unary RPC; idempotent calls are retried on transport failures."""
        what = f"{method}"
        path = f"/{service}/{method}"
        body = json.dumps(msg, separators=(",", ":")).encode()
        deadline = Deadline(timeout)
        attempt = 0
        while True:
            call = _Call()
            try:
                return await self._unary_once(path, body, deadline, call, what, creating)
            except _StaleConn:
                continue  # the server closed an idle connection under us; nothing was done
            except (errors.Unavailable, errors.Overloaded) as e:
                if not idempotent or attempt >= self.max_retries:
                    raise
                if isinstance(e, errors.Overloaded) and e.code == "resource_exhausted":
                    raise
                delay = _backoff(attempt, getattr(e, "retry_after", None))
                rem = deadline.remaining()
                if rem is not None and rem <= delay:
                    raise
                await asyncio.sleep(delay)
                attempt += 1
            except errors.Timeout as e:
                if creating:
                    raise errors.StartupTimeout(e.message) from None
                raise

    async def _unary_once(self, path, body, deadline, call, what, creating) -> Dict[str, Any]:
        resp = await self._send(path, "application/json", body, deadline, call, what)
        try:
            data = await resp.read_all()
        except errors.Timeout:
            resp.conn.close()
            raise
        except _TRANSPORT_ERRORS as e:
            resp.conn.close()
            raise errors.Unavailable(f"{what}: {self.describe()}: {e or type(e).__name__}") from None
        except BaseException:
            resp.conn.close()
            raise
        self._finish(resp)
        if resp.status != 200:
            raise _http_error(resp.status, resp.headers, data, creating)
        try:
            return json.loads(data) if data else {}
        except ValueError as e:
            raise errors.Internal(f"{what}: bad JSON response: {e}") from None

    # --- Connect server stream ---------------------------------------------

    async def stream(self, service: str, method: str, msg: Dict[str, Any], *,
                     timeout: Optional[float], idempotent: bool = False) -> "ServerStream":
        """Open a server stream. Opening (up to the response head) is retried
        for idempotent calls; the messages themselves never are."""
        what = method
        path = f"/{service}/{method}"
        payload = json.dumps(msg, separators=(",", ":")).encode()
        body = struct.pack(">BI", 0, len(payload)) + payload
        deadline = Deadline(timeout)
        attempt = 0
        while True:
            call = _Call()
            try:
                resp = await self._send(path, "application/connect+json", body, deadline, call, what)
                break
            except _StaleConn:
                continue
            except errors.Unavailable:
                if not idempotent or attempt >= self.max_retries:
                    raise
                delay = _backoff(attempt, None)
                rem = deadline.remaining()
                if rem is not None and rem <= delay:
                    raise
                await asyncio.sleep(delay)
                attempt += 1
        if resp.status != 200:
            try:
                data = await resp.read_all()
            except _TRANSPORT_ERRORS:
                data = b""
            finally:
                resp.conn.close()
            raise _http_error(resp.status, resp.headers, data, False)
        return ServerStream(self, resp)


class ServerStream:
    """The messages of one server-stream response, as dicts.

    Iterate with ``async for``; call close() to abandon the stream early
    (that closes its connection, which cancels the call on the server).
    """

    def __init__(self, transport: Transport, resp: _Response):
        self._t = transport
        self._resp = resp
        self._buf = bytearray()
        self._ended = False
        self._released = False

    def __aiter__(self) -> AsyncIterator[Dict[str, Any]]:
        return self

    async def __anext__(self) -> Dict[str, Any]:
        msg = await self.next()
        if msg is None:
            raise StopAsyncIteration
        return msg

    async def _fill(self, n: int) -> None:
        r = self._resp
        while len(self._buf) < n:
            try:
                data = await r.read_some()
            except errors.Timeout:
                self.close()
                raise
            except _TRANSPORT_ERRORS as e:
                self.close()
                raise errors.Unavailable(
                    f"{r.what}: stream from {self._t.describe()} broke: {e or type(e).__name__}") from None
            except BaseException:
                self.close()
                raise
            if not data:
                self.close()
                raise errors.Unavailable(f"{r.what}: stream from {self._t.describe()} ended without its end message")
            self._buf += data

    async def next(self) -> Optional[Dict[str, Any]]:
        """The next message, or None at a clean end. Raises the stream's error."""
        if self._ended:
            return None
        await self._fill(5)
        flags, size = struct.unpack(">BI", bytes(self._buf[:5]))
        await self._fill(5 + size)
        payload = bytes(self._buf[5:5 + size])
        del self._buf[:5 + size]
        try:
            obj = json.loads(payload) if payload else {}
        except ValueError as e:
            self.close()
            raise errors.Internal(f"{self._resp.what}: bad JSON in stream: {e}") from None
        if flags & 0x01:
            self.close()
            raise errors.Internal(f"{self._resp.what}: compressed message, but none was asked for")
        if flags & 0x02:
            self._ended = True
            await self._drain()
            err = obj.get("error")
            if err:
                raise errors.from_code(err.get("code", "unknown"), err.get("message", ""),
                                       retry_after=_retry_after(self._resp.headers))
            return None
        return obj

    async def _drain(self) -> None:
        r = self._resp
        try:
            while not r.done:
                if not await r.read_some():
                    break
        except Exception:
            r.conn.close()
            return
        self._released = True
        self._t._finish(r)

    def close(self) -> None:
        """Abandon the stream (if not already at its end): its connection is
        closed, never reused, which cancels the call on the server."""
        self._ended = True
        if not self._released:
            self._released = True
            self._resp.conn.close()


class _StaleConn(Exception):
    """A reused keep-alive connection was closed before any response."""


def _backoff(attempt: int, hint: Optional[float]) -> float:
    if hint is not None and hint > 0:
        return hint
    base = min(2.0, 0.05 * (2 ** attempt))
    return base / 2 + random.random() * base / 2


def _retry_after(headers: Dict[str, str]) -> Optional[float]:
    v = headers.get("retry-after")
    if not v:
        return None
    try:
        return float(v)
    except ValueError:
        return None


# Connect's mapping of HTTP status to code, for errors without a JSON body.
_HTTP_CODES = {400: "internal", 401: "unauthenticated", 403: "permission_denied",
               404: "unimplemented", 408: "deadline_exceeded", 429: "unavailable",
               502: "unavailable", 503: "unavailable", 504: "unavailable"}


def _http_error(status: int, headers: Dict[str, str], data: bytes, creating: bool) -> errors.DsecError:
    code, message = "", ""
    try:
        obj = json.loads(data)
        code, message = obj.get("code", ""), obj.get("message", "")
    except (ValueError, AttributeError):
        pass
    if not code:
        code = _HTTP_CODES.get(status, "unknown")
        message = message or f"HTTP {status}: {data[:200].decode('utf-8', 'replace')}"
    return errors.from_code(code, message, retry_after=_retry_after(headers), creating=creating)
