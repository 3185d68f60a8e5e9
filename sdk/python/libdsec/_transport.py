"""Connect-protocol transport over HTTP/1.1 (asyncio streams, standard library).

The transport owns small pools of keep-alive connections to one dsecd or to
a list of apiservers, over TCP, TLS or a Unix socket. It speaks the Connect
protocol with JSON: unary calls are a POST with an application/json body;
server streams are a POST with one enveloped message, answered by a sequence
of envelopes whose last one (flag 0x02) carries the end of the stream and
maybe an error; a client stream sends its envelopes in a chunked body as
they come and is answered as a server stream of one message.

Every call has a deadline. Each read and write waits at most until that
deadline, so a daemon that dies or stalls mid-call gives a typed error
(Unavailable or Timeout) and never a hang.

Addresses and failover: the transport keeps a current address, the first
to begin with, and moves to the next when one fails. A call that cannot
reach a server (the connection is refused or times out, the TLS handshake
fails, a kept-alive connection turns out closed before any answer) goes on
to the next address at once, whatever the call: no server has seen it. A
call that reached a server and got Unavailable back (or a proxy's 502, 503,
504, or a connection broken before the answer) goes on to the next address
only if it may repeat (idempotent=True); the first pass over the addresses
this call has not tried is immediate, later attempts back off. Every
attempt counts against max_retries.

Every request carries "Authorization: Bearer <token>": the token argument,
else $DSEC_TOKEN, else the file named by $DSEC_TOKEN_FILE, else
DEFAULT_TOKEN_FILE when it exists and is readable, else none.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import ssl
import struct
import time
import urllib.parse
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Tuple

from . import errors

DEFAULT_ADDR = "unix:///var/lib/dsec/dsecd.sock"
DEFAULT_TOKEN_FILE = "/var/lib/dsec/admin.token"

_TRANSPORT_ERRORS = (OSError, EOFError, asyncio.IncompleteReadError, ConnectionError)


class _Endpoint:
    """One address: where it is, and its idle connections."""

    def __init__(self, addr: str, kind: str, where: Any, tls: bool = False, prefix: str = ""):
        self.addr = addr
        self.kind = kind            # "unix" or "tcp"
        self.where = where          # the socket's path, or (host, port)
        self.tls = tls
        self.prefix = prefix        # path before the procedure, without a trailing slash
        if kind == "unix":
            self.host_header = "dsecd"
        else:
            host, port = where
            self.host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.idle: "collections.deque[_Conn]" = collections.deque()

    def describe(self) -> str:
        if self.kind == "unix":
            return f"unix://{self.where}"
        return ("https://" if self.tls else "") + self.host_header


def _split(spec: str) -> List[str]:
    parts = [a.strip() for a in spec.split(",")]
    if any(not a for a in parts):
        raise errors.InvalidArgument(f"address list {spec!r} has an empty entry")
    return parts


def _parse(addr: str) -> _Endpoint:
    if "," in addr:
        raise errors.InvalidArgument(f"address {addr!r} is a list; see resolve_addrs")
    if addr.startswith("unix://"):
        path = addr[len("unix://"):]
        if not path:
            raise errors.InvalidArgument(f"address {addr!r} names no socket")
        return _Endpoint(addr, "unix", path)
    tls, prefix, rest = False, "", addr
    if addr.startswith(("http://", "https://")):
        u = urllib.parse.urlsplit(addr)
        if not u.netloc or u.query or u.fragment or "@" in u.netloc:
            raise errors.InvalidArgument(f"address {addr!r} is not a URL of the form scheme://host:port[/path]")
        tls, rest, prefix = u.scheme == "https", u.netloc, u.path.rstrip("/")
    elif "://" in addr:
        raise errors.InvalidArgument(f"address {addr!r}: only unix://, http:// and https:// are supported")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise errors.InvalidArgument(f"address {addr!r} has no port")
    return _Endpoint(addr, "tcp", (host.strip("[]") or "127.0.0.1", int(port)), tls, prefix)


def resolve_addr(addr: Optional[str] = None) -> Tuple[str, Any]:
    """Parse one address: unix:///path, http://host:port, https://host:port or host:port.

    With no address it uses $DSEC_ADDR, else the local daemon's socket.
    Returns ("unix", path), ("tcp", (host, port)) or, for https,
    ("tls", (host, port)). A list of addresses is resolve_addrs's.
    """
    ep = _parse(addr or os.environ.get("DSEC_ADDR") or DEFAULT_ADDR)
    return ("tls" if ep.tls else ep.kind), ep.where


def resolve_addrs(addr: Optional[str] = None) -> List[Tuple[str, Any]]:
    """Parse one address or a comma-separated list of them; see resolve_addr."""
    spec = addr or os.environ.get("DSEC_ADDR") or DEFAULT_ADDR
    return [resolve_addr(a) for a in _split(spec)]


class _Credential:
    """The bearer token and where it came from; only the latter goes into messages."""

    def __init__(self, token: str = "", source: str = "", note: str = ""):
        self.token = token
        self.source = source
        self.note = note

    def __repr__(self) -> str:
        return f"_Credential({self.describe()})"

    @classmethod
    def load(cls, explicit: Optional[str], token_file: str) -> "_Credential":
        if explicit:
            return cls._check(explicit, "the token argument")
        env = os.environ.get("DSEC_TOKEN")
        if env:
            return cls._check(env, "$DSEC_TOKEN")
        path = os.environ.get("DSEC_TOKEN_FILE")
        if path:
            source = f"token file {path} ($DSEC_TOKEN_FILE)"
            try:
                with open(path) as f:
                    data = f.read()
            except OSError as e:
                raise errors.InvalidArgument(f"read {source}: {e.strerror or e}") from None
            return cls._check(data, source)
        try:
            with open(token_file) as f:
                data = f.read()
        except FileNotFoundError:
            return cls()
        except OSError as e:
            return cls(note=f"{token_file} is not readable: {e.strerror or e}")
        if not data.strip():
            return cls(note=f"{token_file} is empty")
        return cls._check(data, f"token file {token_file}")

    @classmethod
    def _check(cls, token: str, source: str) -> "_Credential":
        token = token.strip()
        if not token:
            raise errors.InvalidArgument(f"the token from {source} is empty")
        if any(c <= " " or c == "\x7f" or not c.isprintable() for c in token):
            raise errors.InvalidArgument(f"the token from {source} holds a space or control character")
        return cls(token, source)

    def describe(self) -> str:
        if self.token:
            return f"token from {self.source}"
        s = "no token sent: set $DSEC_TOKEN or $DSEC_TOKEN_FILE, or pass token="
        return f"{s}; {self.note}" if self.note else s

    def redact(self, msg: str) -> str:
        return msg.replace(self.token, "[token]") if self.token else msg


def _ssl_context(ca_file: Optional[str]) -> ssl.SSLContext:
    source = ca_file
    if not ca_file:
        ca_file = os.environ.get("DSEC_CA_FILE") or None
        source = f"{ca_file} ($DSEC_CA_FILE)"
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise errors.InvalidArgument(f"read CA file {source}: {getattr(e, 'strerror', None) or e}") from None


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
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ep: "_Endpoint"):
        self.reader = reader
        self.writer = writer
        self.ep = ep
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
    """Tracks one call across its attempts and addresses: which addresses it
    tried, and which one the last attempt reached (None: none)."""

    def __init__(self, n: int):
        self.tried = [False] * n
        self.reached: Optional[int] = None

    def untried(self) -> bool:
        return not all(self.tried)


class _Unreached(Exception):
    """An attempt did not reach a server; error is what the caller would see."""

    def __init__(self, error: errors.DsecError, cert: bool = False):
        super().__init__(error.message)
        self.error = error
        self.cert = cert


class Transport:
    """Pools of HTTP/1.1 connections to one dsecd or a list of apiservers,
    speaking Connect/JSON.

    A Transport is bound to the event loop that first uses it; used from
    another loop it drops its idle connections and starts over.
    """

    def __init__(self, addr: Optional[str] = None, *, max_idle: int = 32,
                 connect_timeout: float = 10.0, max_retries: int = 6,
                 idle_ttl: float = 30.0, token: Optional[str] = None,
                 ca_file: Optional[str] = None):
        spec = addr or os.environ.get("DSEC_ADDR") or DEFAULT_ADDR
        self.endpoints = [_parse(a) for a in _split(spec)]
        self.cur = 0  # index of the current address
        first = self.endpoints[0]
        self.kind, self.where, self.host_header = first.kind, first.where, first.host_header
        self._cred = _Credential.load(token, DEFAULT_TOKEN_FILE)
        self._ssl: Optional[ssl.SSLContext] = None
        if ca_file or os.environ.get("DSEC_CA_FILE") or any(ep.tls for ep in self.endpoints):
            self._ssl = _ssl_context(ca_file)
        self.max_idle = max_idle
        self.connect_timeout = connect_timeout
        self.max_retries = max_retries
        self.idle_ttl = idle_ttl
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.connections_opened = 0

    def __repr__(self) -> str:
        return f"Transport({', '.join(ep.addr for ep in self.endpoints)})"

    # --- addresses -----------------------------------------------------------

    def _advance(self, i: int) -> None:
        """Move the current address past i, unless another call moved it already."""
        if self.cur == i:
            self.cur = (i + 1) % len(self.endpoints)

    def _order(self, call: _Call) -> List[int]:
        """The addresses an attempt tries in turn: from the current one on,
        those this call has not tried yet first."""
        n = len(self.endpoints)
        ring = [(self.cur + k) % n for k in range(n)]
        return [i for i in ring if not call.tried[i]] + [i for i in ring if call.tried[i]]

    async def _attempt(self, call: _Call, what: str, fn: Callable[[_Endpoint, int], Any]):
        """Run fn on the addresses in turn until one reaches a server; the
        result (or error) of that one stands. Raises Unavailable when none
        could be reached."""
        unreached: List[_Unreached] = []
        for i in self._order(call):
            ep = self.endpoints[i]
            call.tried[i] = True
            while True:
                call.reached = None
                try:
                    return await fn(ep, i)
                except _StaleConn:
                    continue  # the server closed an idle connection under us; nothing was done
                except _Unreached as u:
                    call.reached = None
                    unreached.append(u)
                    self._advance(i)
                    break
        if len(unreached) == 1:
            err = unreached[0].error
        else:
            err = errors.Unavailable(f"{what}: none of {len(unreached)} apiservers could be reached: "
                                     + "; ".join(u.error.message.split(": ", 1)[-1] for u in unreached))
        err.cert_error = all(u.cert for u in unreached)
        raise err

    # --- connections -----------------------------------------------------

    async def _acquire(self, ep: _Endpoint, deadline: Deadline, what: str) -> "_Conn":
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            for e in self.endpoints:
                e.idle.clear()
            self._loop = loop
        now = time.monotonic()
        while ep.idle:
            c = ep.idle.pop()
            if c.alive() and now - c.used < self.idle_ttl:
                c.reused = True
                return c
            c.close()
        rem = deadline.remaining()
        limit = self.connect_timeout if rem is None else min(rem, self.connect_timeout)
        d = Deadline(limit)
        try:
            if ep.kind == "unix":
                reader, writer = await d.wait(asyncio.open_unix_connection(ep.where, limit=1 << 22), what)
            elif ep.tls:
                reader, writer = await d.wait(asyncio.open_connection(
                    ep.where[0], ep.where[1], limit=1 << 22, ssl=self._ssl, server_hostname=ep.where[0],
                    ssl_handshake_timeout=max(0.1, limit)), what)
            else:
                reader, writer = await d.wait(
                    asyncio.open_connection(ep.where[0], ep.where[1], limit=1 << 22), what)
        except errors.Timeout:
            if deadline.remaining() is not None and deadline.remaining() <= 0:
                raise
            raise _Unreached(errors.Unavailable(f"{what}: connect to {ep.describe()}: timed out")) from None
        except ssl.SSLCertVerificationError as e:
            raise _Unreached(errors.Unavailable(f"{what}: connect to {ep.describe()}: {e}"), cert=True) from None
        except _TRANSPORT_ERRORS as e:
            raise _Unreached(errors.Unavailable(f"{what}: connect to {ep.describe()}: {e}")) from None
        self.connections_opened += 1
        return _Conn(reader, writer, ep)

    def _release(self, c: "_Conn") -> None:
        if c.alive() and len(c.ep.idle) < self.max_idle and asyncio.get_running_loop() is self._loop:
            c.used = time.monotonic()
            c.reused = False
            c.ep.idle.append(c)
        else:
            c.close()

    def describe(self) -> str:
        return ",".join(ep.describe() for ep in self.endpoints)

    async def close(self) -> None:
        conns = []
        for ep in self.endpoints:
            while ep.idle:
                c = ep.idle.pop()
                c.close()
                conns.append(c)
        if conns and asyncio.get_running_loop() is self._loop:
            # A TLS connection says goodbye before it is closed; let it.
            waits = [c.writer.wait_closed() for c in conns]
            try:
                await asyncio.wait_for(asyncio.gather(*waits, return_exceptions=True), 1.0)
            except asyncio.TimeoutError:
                pass

    # --- one HTTP exchange -------------------------------------------------

    def _head(self, ep: _Endpoint, path: str, ctype: str, length: str, deadline: Deadline) -> bytes:
        """A POST's request head; length is a Content-Length, or "chunked"."""
        head = [f"POST {ep.prefix}{path} HTTP/1.1", f"Host: {ep.host_header}", f"Content-Type: {ctype}",
                "Transfer-Encoding: chunked" if length == "chunked" else f"Content-Length: {length}",
                "Connect-Protocol-Version: 1", "User-Agent: libdsec-python"]
        if self._cred.token:
            head.append(f"Authorization: Bearer {self._cred.token}")
        ms = deadline.header_ms()
        if ms is not None:
            head.append(f"Connect-Timeout-Ms: {ms}")
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")

    async def _send(self, ep: _Endpoint, i: int, path: str, ctype: str, body: bytes, deadline: Deadline,
                    call: _Call, what: str) -> _Response:
        """Send a POST and read the response head. Raises typed errors."""
        conn = await self._acquire(ep, deadline, what)
        call.reached = i
        data = self._head(ep, path, ctype, str(len(body)), deadline) + body
        try:
            conn.writer.write(data)
            await deadline.wait(conn.writer.drain(), what)
        except errors.Timeout:
            conn.close()
            raise
        except _TRANSPORT_ERRORS as e:
            conn.close()
            if conn.reused:
                raise _StaleConn() from None
            raise errors.Unavailable(f"{what}: {ep.describe()}: {e or type(e).__name__}") from None
        except BaseException:
            conn.close()
            raise
        return await self._read_head(conn, ep, deadline, what)

    async def _read_head(self, conn: _Conn, ep: _Endpoint, deadline: Deadline, what: str) -> _Response:
        """Read a response head. Raises typed errors."""
        got_response = False
        try:
            line = await deadline.wait(conn.reader.readline(), what)
            if not line:
                raise EOFError("connection closed before the response")
            got_response = True
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
            if conn.reused and not got_response:
                raise _StaleConn() from None
            raise errors.Unavailable(f"{what}: {ep.describe()}: {e or type(e).__name__}") from None
        except BaseException:
            conn.close()
            raise
        return _Response(conn, status, headers, deadline, what)

    def _finish(self, resp: _Response) -> None:
        if resp.done and resp.keep_alive:
            self._release(resp.conn)
        else:
            resp.conn.close()

    def _failed(self, call: _Call, e: errors.DsecError) -> errors.DsecError:
        """What a reached server's error means for the addresses, and for
        the message: an Unavailable server is left for the next address; an
        Unauthenticated answer says where the token came from."""
        if isinstance(e, (errors.Unavailable, errors.Overloaded)) and e.code == "unavailable" \
                and call.reached is not None:
            self._advance(call.reached)
        if isinstance(e, errors.Unauthenticated):
            e.message = self._cred.redact(e.message)
            e.args = (e.message,)
            e.token = self._cred.describe()
        return e

    def _next_delay(self, call: _Call, e: errors.DsecError, attempt: int, idempotent: bool,
                    deadline: Deadline) -> Optional[float]:
        """How long to wait before the next attempt after e, or None: no next attempt."""
        if not idempotent or attempt >= self.max_retries or getattr(e, "cert_error", False):
            return None
        if isinstance(e, errors.Overloaded) and e.code == "resource_exhausted":
            return None
        if call.reached is not None and call.untried():
            return 0.0
        delay = _backoff(attempt, getattr(e, "retry_after", None))
        rem = deadline.remaining()
        if rem is not None and rem <= delay:
            return None
        return delay

    # --- Connect unary -------------------------------------------------------

    async def unary(self, service: str, method: str, msg: Dict[str, Any], *,
                    timeout: Optional[float], idempotent: bool = False,
                    creating: bool = False) -> Dict[str, Any]:
        """Call a unary RPC. Every call goes on to the next address when it
        cannot reach a server; idempotent ones are also retried after an
        Unavailable answer or a broken connection."""
        what = f"{method}"
        path = f"/{service}/{method}"
        body = json.dumps(msg, separators=(",", ":")).encode()
        deadline = Deadline(timeout)
        call = _Call(len(self.endpoints))
        attempt = 0
        while True:
            try:
                return await self._attempt(call, what, lambda ep, i: self._unary_once(
                    ep, i, path, body, deadline, call, what, creating))
            except (errors.Unavailable, errors.Overloaded) as e:
                self._failed(call, e)
                delay = self._next_delay(call, e, attempt, idempotent, deadline)
                if delay is None:
                    raise
                if delay:
                    await asyncio.sleep(delay)
                attempt += 1
            except errors.Unauthenticated as e:
                raise self._failed(call, e)
            except errors.Timeout as e:
                if creating:
                    raise errors.StartupTimeout(e.message) from None
                raise

    async def _unary_once(self, ep, i, path, body, deadline, call, what, creating) -> Dict[str, Any]:
        resp = await self._send(ep, i, path, "application/json", body, deadline, call, what)
        try:
            data = await resp.read_all()
        except errors.Timeout:
            resp.conn.close()
            raise
        except _TRANSPORT_ERRORS as e:
            resp.conn.close()
            raise errors.Unavailable(f"{what}: {ep.describe()}: {e or type(e).__name__}") from None
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
        """Open a server stream. Every stream goes on to the next address when
        it cannot reach a server; opening an idempotent one (up to the
        response head) is also retried after an Unavailable answer. The
        messages themselves never are."""
        what = method
        path = f"/{service}/{method}"
        payload = json.dumps(msg, separators=(",", ":")).encode()
        body = struct.pack(">BI", 0, len(payload)) + payload
        deadline = Deadline(timeout)
        call = _Call(len(self.endpoints))
        attempts = [0]

        async def pause(e: errors.DsecError) -> None:
            # Raises e when there is no next attempt.
            self._failed(call, e)
            delay = self._next_delay(call, e, attempts[0], idempotent, deadline)
            if delay is None:
                raise e
            if delay:
                await asyncio.sleep(delay)
            attempts[0] += 1

        async def open_() -> "ServerStream":
            while True:
                try:
                    return await self._attempt(call, what, lambda ep, i: self._open(
                        ep, i, path, body, deadline, call, what))
                except (errors.Unavailable, errors.Overloaded) as e:
                    await pause(e)
                except errors.Unauthenticated as e:
                    raise self._failed(call, e)

        async def again(e: errors.DsecError) -> "ServerStream":
            await pause(e)
            return await open_()

        stream = await open_()
        if idempotent:
            # A Connect server answers a stream's errors in its body: until
            # the first message, an Unavailable one is another attempt too.
            stream._again = again
        return stream

    # --- Connect client stream ---------------------------------------------

    async def client_stream(self, service: str, method: str, messages: AsyncIterator[Dict[str, Any]], *,
                            timeout: Optional[float]) -> Dict[str, Any]:
        """Call a client-streaming RPC: each of messages goes as an envelope
        of a chunked request body as it comes, and the answer is one message.
        The stream is sent once, on a connection of its own: it goes on to
        the next address only when none could be reached, since messages may
        not be read twice. An error raised by messages abandons the call (the
        connection is closed without the body's end)."""
        what = method
        path = f"/{service}/{method}"
        deadline = Deadline(timeout)
        call = _Call(len(self.endpoints))
        try:
            return await self._attempt(call, what, lambda ep, i: self._client_stream_once(
                ep, i, path, messages, deadline, call, what))
        except (errors.Unavailable, errors.Overloaded, errors.Unauthenticated) as e:
            raise self._failed(call, e)

    async def _client_stream_once(self, ep, i, path, messages, deadline, call, what) -> Dict[str, Any]:
        # A new connection: a kept-alive one found closed would show it only
        # after messages were consumed.
        idle, ep.idle = ep.idle, collections.deque()
        try:
            conn = await self._acquire(ep, deadline, what)
        finally:
            ep.idle.extend(idle)
        call.reached = i
        # The server may answer before the body ends (it refused the
        # stream): its answer is read while the body goes.
        answer = asyncio.ensure_future(self._read_head(conn, ep, deadline, what))
        whole = False  # the body went to its end: the connection may be kept
        try:
            conn.writer.write(self._head(ep, path, "application/connect+json", "chunked", deadline))
            async for msg in messages:
                payload = json.dumps(msg, separators=(",", ":")).encode()
                env = struct.pack(">BI", 0, len(payload)) + payload
                conn.writer.write(b"%x\r\n%s\r\n" % (len(env), env))
                if not await self._sent(conn, answer, deadline, what):
                    break
            else:
                conn.writer.write(b"0\r\n\r\n")
                whole = await self._sent(conn, answer, deadline, what)
        except _TRANSPORT_ERRORS:
            pass  # the server ended the call: its answer says why
        except BaseException:
            answer.cancel()
            conn.close()
            raise
        finally:
            aclose = getattr(messages, "aclose", None)
            if aclose is not None:
                await aclose()  # a source left early lets go of what it holds now
        try:
            resp = await answer
        except _StaleConn:
            raise errors.Unavailable(f"{what}: {ep.describe()}: connection closed before the response") from None
        resp.keep_alive = resp.keep_alive and whole
        stream = await self._stream_of(resp, i)
        try:
            out = await stream.next()
            if out is None:
                raise errors.Internal(f"{what}: the stream ended without an answer")
            if await stream.next() is not None:
                raise errors.Internal(f"{what}: more than one answer")
            return out
        finally:
            stream.close()

    @staticmethod
    async def _sent(conn: _Conn, answer: "asyncio.Future", deadline: Deadline, what: str) -> bool:
        """Wait until what was written has gone, or the answer has come (the
        server ended the call early: the rest need not go, and must not, as a
        write the server no longer reads would break the connection before
        the answer is read). Reports whether it went."""
        if answer.done():
            return False
        drain = asyncio.ensure_future(conn.writer.drain())
        try:
            await deadline.wait(asyncio.wait({drain, answer}, return_when=asyncio.FIRST_COMPLETED), what)
        finally:
            if not drain.done():
                drain.cancel()
        if drain.done() and not drain.cancelled():
            drain.result()  # a broken connection raises here
            return not answer.done()
        return False

    async def _open(self, ep, i, path, body, deadline, call, what) -> "ServerStream":
        resp = await self._send(ep, i, path, "application/connect+json", body, deadline, call, what)
        return await self._stream_of(resp, i)

    async def _stream_of(self, resp: _Response, i: int) -> "ServerStream":
        """The messages of a stream's response, or the error a refusal (not
        200) carries."""
        if resp.status != 200:
            try:
                data = await resp.read_all()
            except _TRANSPORT_ERRORS:
                data = b""
            finally:
                resp.conn.close()
            raise _http_error(resp.status, resp.headers, data, False)
        return ServerStream(self, resp, i)


class ServerStream:
    """The messages of one server-stream response, as dicts.

    Iterate with ``async for``; call close() to abandon the stream early
    (that closes its connection, which cancels the call on the server).
    """

    def __init__(self, transport: Transport, resp: _Response, index: int = 0):
        self._t = transport
        self._resp = resp
        self._index = index  # the address it came from
        self._again: Optional[Callable[[errors.DsecError], Any]] = None  # reopens it elsewhere
        self._yielded = False
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
                self._t._advance(self._index)
                raise errors.Unavailable(
                    f"{r.what}: stream from {self._ep().describe()} broke: {e or type(e).__name__}") from None
            except BaseException:
                self.close()
                raise
            if not data:
                self.close()
                self._t._advance(self._index)
                raise errors.Unavailable(f"{r.what}: stream from {self._ep().describe()} ended without its end message")
            self._buf += data

    async def next(self) -> Optional[Dict[str, Any]]:
        """The next message, or None at a clean end. Raises the stream's error.

        A stream that may repeat is opened again on the next address when it
        fails with Unavailable before its first message."""
        while True:
            try:
                msg = await self._next()
            except (errors.Unavailable, errors.Overloaded) as e:
                if self._yielded or self._again is None:
                    raise
                s = await self._again(e)
                self._resp, self._index, self._buf = s._resp, s._index, s._buf
                self._ended = self._released = False
                continue
            self._yielded = True
            return msg

    async def _next(self) -> Optional[Dict[str, Any]]:
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
                call = _Call(len(self._t.endpoints))
                call.reached = self._index
                raise self._t._failed(call, errors.from_code(
                    err.get("code", "unknown"), err.get("message", ""),
                    retry_after=_retry_after(self._resp.headers)))
            return None
        return obj

    def _ep(self) -> _Endpoint:
        return self._t.endpoints[self._index]

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
