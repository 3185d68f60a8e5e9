"""A tiny fake Connect server on loopback (or a Unix socket) for offline tests.

Routes map "/dsec.v1.SandboxService/Method" to functions taking a Call; the
function answers with call.reply / call.error for unary methods, or
call.send / call.end for server streams (and client streams, whose
messages are call.msgs, call.msg the first), or call.drop() to cut the
connection without an answer; server.default, if set, answers the paths
without a route. Every request is recorded in server.requests.
server.early(method) makes a client stream's route answer after the first
message, the rest unread, and close the connection as Go's server does
(its write side first, the socket half a second later).
FakeServer(tls=True) serves HTTPS with testdata/localhost.pem (CERT), a
self-signed certificate for localhost and 127.0.0.1.
"""

import base64
import json
import os
import socket
import socketserver
import ssl
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


def b64(b):
    if isinstance(b, str):
        b = b.encode()
    return base64.b64encode(b).decode()


class Call:
    def __init__(self, handler, path, headers, msg, streaming, msgs=None):
        self.h = handler
        self.path = path
        self.method = path.rsplit("/", 1)[-1]
        self.headers = headers
        self.msg = msg
        self.msgs = msgs if msgs is not None else [msg]
        self.streaming = streaming
        self.started = False

    # unary
    def reply(self, obj, status=200, extra_headers=None):
        body = json.dumps(obj).encode()
        self.h.send_response(status)
        self.h.send_header("Content-Type", "application/json")
        self.h.send_header("Content-Length", str(len(body)))
        for k, v in (extra_headers or {}).items():
            self.h.send_header(k, v)
        self.h.end_headers()
        self.h.wfile.write(body)
        self.h.wfile.flush()

    def error(self, code, message, status=None, extra_headers=None):
        if self.streaming:
            self.end({"code": code, "message": message})
            return
        status = status or {"not_found": 404, "invalid_argument": 400, "unavailable": 503,
                            "resource_exhausted": 429, "deadline_exceeded": 504,
                            "unauthenticated": 401, "failed_precondition": 400}.get(code, 500)
        self.reply({"code": code, "message": message}, status=status, extra_headers=extra_headers)

    # streams
    def _start(self):
        if not self.started:
            self.started = True
            self.h.send_response(200)
            self.h.send_header("Content-Type", "application/connect+json")
            self.h.send_header("Transfer-Encoding", "chunked")
            self.h.end_headers()

    def _chunk(self, data):
        self.h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.h.wfile.flush()

    def send(self, obj, flags=0):
        self._start()
        payload = json.dumps(obj).encode()
        self._chunk(struct.pack(">BI", flags, len(payload)) + payload)

    def end(self, error=None):
        self.send({"error": error} if error else {}, flags=0x02)
        self.h.wfile.write(b"0\r\n\r\n")
        self.h.wfile.flush()

    def drop(self):
        """Cut the connection with a reset, as a killed daemon would."""
        self.h.close_connection = True
        try:
            self.h.wfile.flush()
        except OSError:
            pass
        s = self.h.connection
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.h.dropped = True


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self):
        super().setup()
        if self.connection.family != socket.AF_UNIX:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.dropped = False
        with self.server.lock:
            self.server.connections += 1

    def log_message(self, *a):
        pass

    def address_string(self):
        return "fake"

    def _body(self):
        if "chunked" not in self.headers.get("Transfer-Encoding", ""):
            return self.rfile.read(int(self.headers.get("Content-Length", "0")))
        parts = []
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                self.rfile.readline()
                return b"".join(parts)
            parts.append(self.rfile.read(size))
            self.rfile.readline()

    def _first_envelope(self):
        """Read a chunked body only until its first envelope is whole."""
        buf = b""
        while len(buf) < 5 or len(buf) < 5 + struct.unpack(">BI", buf[:5])[1]:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                break
            buf += self.rfile.read(size)
            self.rfile.readline()
        return buf

    def do_POST(self):
        early = self.path in self.server.early_paths
        body = self._first_envelope() if early else self._body()
        ctype = self.headers.get("Content-Type", "")
        streaming = ctype == "application/connect+json"
        msgs = []
        if streaming:
            while body:
                flags, size = struct.unpack(">BI", body[:5])
                assert flags == 0 and size <= len(body) - 5, "bad request envelope"
                msgs.append(json.loads(body[5:5 + size]))
                body = body[5 + size:]
            msg = msgs[0] if msgs else {}
        else:
            msg = json.loads(body) if body else {}
        call = Call(self, self.path, dict(self.headers), msg, streaming, msgs if streaming else None)
        with self.server.lock:
            self.server.requests.append(call)
        fn = self.server.routes.get(self.path) or self.server.default
        if fn is None:
            call.error("unimplemented", f"no route {self.path}", status=404)
            return
        fn(call)
        if call.streaming and not call.started and not self.dropped:
            call.end()
        if self.dropped:
            self.close_connection = True
        if early:
            self.wfile.flush()
            self.rfile.read(256 << 10)  # what Go's server discards of an unread body
            self.connection.shutdown(socket.SHUT_WR)
            time.sleep(0.5)
            self.close_connection = True


class _TCP(socketserver.ThreadingMixIn, HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024


class _Unix(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = 1024

    def server_bind(self):
        socketserver.UnixStreamServer.server_bind(self)
        self.server_name, self.server_port = "fake", 0


CERT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata", "localhost.pem")
KEY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata", "localhost.key")


class FakeServer:
    """Start with FakeServer(routes) (TCP), FakeServer(routes, tls=True)
    (HTTPS) or FakeServer(routes, unix_path=...)."""

    def __init__(self, routes=None, unix_path=None, tls=False):
        cls = _Unix if unix_path else _TCP
        self.srv = cls(unix_path if unix_path else ("127.0.0.1", 0), _Handler)
        self.tls = tls
        if tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(CERT, KEY)
            # The handshake happens at accept; one that fails is dropped there.
            self.srv.socket = ctx.wrap_socket(self.srv.socket, server_side=True)
        self.srv.routes = dict(routes or {})
        self.srv.default = None
        self.srv.early_paths = set()
        self.srv.requests = []
        self.srv.connections = 0
        self.srv.lock = threading.Lock()
        self.unix_path = unix_path
        self.thread = threading.Thread(target=self.srv.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def addr(self):
        if self.unix_path:
            return "unix://" + self.unix_path
        if self.tls:
            return "https://127.0.0.1:%d" % self.srv.server_address[1]
        return "127.0.0.1:%d" % self.srv.server_address[1]

    @property
    def routes(self):
        return self.srv.routes

    @property
    def requests(self):
        return self.srv.requests

    @property
    def connections(self):
        return self.srv.connections

    def route(self, method, fn, service="dsec.v1.SandboxService"):
        self.srv.routes[f"/{service}/{method}"] = fn

    def early(self, method, service="dsec.v1.LayerService"):
        self.srv.early_paths.add(f"/{service}/{method}")

    @property
    def default(self):
        return self.srv.default

    @default.setter
    def default(self, fn):
        self.srv.default = fn

    def methods(self):
        """The methods called so far, in order."""
        with self.srv.lock:
            return [c.method for c in self.srv.requests]

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()
        if self.unix_path and os.path.exists(self.unix_path):
            os.unlink(self.unix_path)
