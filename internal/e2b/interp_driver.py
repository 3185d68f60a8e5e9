# The driver of one code-interpreter context (internal/e2b/interpreter.go):
# a long-lived Python process in the sandbox that runs cells in one
# namespace, as a Jupyter kernel would, and streams what they do.
#
# Started as a background process by the adapter (python3 -c BOOTSTRAP
# SOCKET CONTEXT CWD, this source on stdin), it listens on the abstract
# unix socket SOCKET, writes "ready" to its stdout and then serves one
# connection at a time. A connection (made by interp_client.py, one per
# execution) sends a length-prefixed JSON request, {code, env_vars,
# timeout}; the driver answers with newline-delimited JSON events in the
# shapes of E2B's code interpreter: number_of_executions, stdout and
# stderr chunks as they come, result (display data and the last
# expression's value, is_main_result), error {name, value, traceback},
# and finally {"type": "dsec_end"}.
#
# What the cell's child processes write to the inherited descriptors 1 and
# 2 is read through pipes and streamed too. A cell is interrupted (SIGINT,
# a KeyboardInterrupt in the cell) when its connection closes, the HTTP
# request behind it having gone, or at its timeout; a cell that ignores the
# interrupt for KILL_AFTER seconds ends the driver, which the adapter
# starts again (fresh) on the context's next execution.
import ast
import asyncio
import base64
import builtins
import codecs
import datetime
import inspect
import io
import json
import linecache
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import types

KILL_AFTER = 10.0  # seconds a cell may ignore its interrupt
FLUSH_AFTER = 0.2  # seconds a partial line waits before it is sent
MAX_REQUEST = 64 << 20
# Output bytes one execution may stream; beyond, stdout and stderr are
# dropped with a notice (the adapter's client process keeps at most
# 64 MiB, results and errors included).
OUTPUT_LIMIT = 48 << 20

DRIVER_FILE = inspect.currentframe().f_code.co_filename


def now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


class Session:
    """One execution's connection: events go out on it, under a lock (the
    cell's thread, the descriptor pumps and the watcher all send)."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()
        self.gone = False
        self.timed_out = False
        self.streams = {}
        self.sent = 0
        self.truncated = False

    def send(self, event):
        data = (json.dumps(event, default=repr) + "\n").encode("utf-8", "replace")
        with self.lock:
            if self.gone:
                return
            if event.get("type") in ("stdout", "stderr"):
                if self.truncated:
                    return
                if self.sent + len(data) > OUTPUT_LIMIT:
                    self.truncated = True
                    data = (json.dumps({"type": "stderr", "timestamp": now(),
                                        "text": "[dsec: output over %d MiB in one execution; the rest is dropped]\n" % (OUTPUT_LIMIT >> 20)}) + "\n").encode()
            self.sent += len(data)
            try:
                self.conn.sendall(data)
            except OSError:
                self.gone = True


class Stream(io.TextIOBase):
    """A cell's sys.stdout or sys.stderr: text goes out whole lines at a
    time, and a partial line after FLUSH_AFTER, as a kernel's streams do."""

    def __init__(self, session, name, fd):
        self.session = session
        self.stream_name = name
        self.fd = fd
        self.lock = threading.Lock()
        self.buf = []
        self.since = 0.0

    @property
    def encoding(self):
        return "utf-8"

    @property
    def name(self):
        return "<" + self.stream_name + ">"

    def writable(self):
        return True

    def isatty(self):
        return False

    def fileno(self):
        # The real descriptor, whose output is streamed too: a child
        # process given sys.stdout writes into the cell's output.
        return self.fd

    def write(self, s):
        if not isinstance(s, str):
            raise TypeError("write() argument must be str, not " + type(s).__name__)
        if not s:
            return 0
        with self.lock:
            if not self.buf:
                self.since = time.monotonic()
            self.buf.append(s)
            if "\n" not in s:
                return len(s)
            text = "".join(self.buf)
            cut = text.rindex("\n") + 1
            out, rest = text[:cut], text[cut:]
            self.buf = [rest] if rest else []
            self.since = time.monotonic()
        self.session.send({"type": self.stream_name, "text": out, "timestamp": now()})
        return len(s)

    def flush(self, older_than=None):
        with self.lock:
            if not self.buf:
                return
            if older_than is not None and time.monotonic() - self.since < older_than:
                return
            out = "".join(self.buf)
            self.buf = []
        self.session.send({"type": self.stream_name, "text": out, "timestamp": now()})


class Pump:
    """The read end of the pipe behind fd 1 or 2 (non-blocking)."""

    def __init__(self, fd, name):
        self.fd = fd
        self.name = name
        self.lock = threading.Lock()
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")


class Driver:
    def __init__(self, sock_name, cwd):
        self.sock_name = sock_name
        self.cwd = cwd
        self.count = 0
        self.session = None  # the running cell's, for the descriptor pumps
        self.in_cell = False
        self.main_ident = threading.main_thread().ident
        self.loop = None
        self.module = types.ModuleType("__main__")
        self.ns = self.module.__dict__
        self.ns.update({"__builtins__": builtins, "display": self.display, "__dsec_system__": self.system})
        self.stdio = (sys.stdout, sys.stderr, sys.stdin)
        self.pumps = []  # the pipes behind fds 1 and 2

    # -- start -----------------------------------------------------------

    def start(self):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\0" + self.sock_name)
        listener.listen(64)
        os.write(1, b"ready\n")
        # From here on fds 1 and 2 are pipes this process reads: what cells'
        # child processes write there is streamed to the running cell.
        for fd, name in ((1, "stdout"), (2, "stderr")):
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            os.set_blocking(r, False)
            p = Pump(r, name)
            self.pumps.append(p)
            threading.Thread(target=self.pump, args=(p,), daemon=True).start()
        sys.modules["__main__"] = self.module
        signal.signal(signal.SIGINT, self.on_sigint)
        return listener

    def pump(self, p):
        while True:
            try:
                select.select([p.fd], [], [])
            except OSError:
                return
            if not self.drain(p):
                return

    def drain(self, p):
        """Streams what is in p's pipe now to the running cell; False once
        the pipe has ended. The pump's thread calls it when the pipe has
        data, and a cell's end, so that what the cell's children wrote
        before it ended is its output, not the next cell's."""
        with p.lock:
            while True:
                try:
                    data = os.read(p.fd, 65536)
                except BlockingIOError:
                    return True
                except InterruptedError:
                    continue
                except OSError:
                    return False
                if not data:
                    return False
                text = p.decoder.decode(data)
                s = self.session
                if text and s is not None and p.name in s.streams:
                    s.streams[p.name].write(text)

    def on_sigint(self, signum, frame):
        # An interrupt only ever stops a cell, never the driver.
        if self.in_cell:
            raise KeyboardInterrupt

    # -- serving -----------------------------------------------------------

    def serve(self, listener):
        while True:
            try:
                conn, _ = listener.accept()
            except KeyboardInterrupt:
                continue
            try:
                self.handle(conn)
            except KeyboardInterrupt:
                pass
            except Exception:  # the driver's own failure: say so, keep serving
                try:
                    os.write(2, traceback.format_exc().encode())
                except OSError:
                    pass
            finally:
                self.session = None
                try:
                    conn.close()
                except OSError:
                    pass

    def handle(self, conn):
        req = read_request(conn)
        if req is None:
            return
        s = Session(conn)
        if peer_gone(conn):
            return  # the request behind it is gone already: nothing to run
        s.streams = {"stdout": Stream(s, "stdout", 1), "stderr": Stream(s, "stderr", 2)}
        done = threading.Event()
        timeout = float(req.get("timeout") or 0)
        watcher = threading.Thread(target=self.watch, args=(s, done, timeout), daemon=True)
        self.session = s
        watcher.start()
        try:
            self.run(s, str(req.get("code", "")), req.get("env_vars") or {}, timeout)
        finally:
            done.set()
            for p in self.pumps:
                self.drain(p)
            for st in s.streams.values():
                st.flush()
            s.send({"type": "dsec_end"})
            self.session = None

    def watch(self, s, done, timeout):
        """Interrupts the cell when its connection goes or its timeout
        passes, and ends the driver when the cell ignores that."""
        deadline = time.monotonic() + timeout if timeout > 0 else None
        interrupted = None
        while not done.is_set():
            if not s.gone:
                try:
                    r, _, _ = select.select([s.conn], [], [], 0.05)
                except (OSError, ValueError):
                    r = [s.conn]
                if r:
                    s.gone = True  # the client sends nothing more: EOF
            else:
                done.wait(0.05)
            for st in list(s.streams.values()):
                st.flush(FLUSH_AFTER)
            t = time.monotonic()
            if interrupted is None:
                if deadline is not None and t >= deadline:
                    s.timed_out = True
                    interrupted = t
                elif s.gone:
                    interrupted = t
                if interrupted is not None and not done.is_set():
                    signal.pthread_kill(self.main_ident, signal.SIGINT)
            elif t - interrupted > KILL_AFTER and not done.is_set():
                if not s.gone:
                    s.send({"type": "error", "name": "ContextKilled",
                            "value": "the cell ignored its interrupt for %g s; the context's process was ended and starts afresh on its next execution" % KILL_AFTER,
                            "traceback": ""})
                os._exit(3)

    # -- running a cell ------------------------------------------------------

    def run(self, s, code, env_vars, timeout):
        self.count += 1
        s.send({"type": "number_of_executions", "execution_count": self.count})
        filename = "<cell-%d>" % self.count
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        saved_env = {}
        for k, v in env_vars.items():
            k, v = str(k), str(v)
            saved_env[k] = os.environ.get(k)
            os.environ[k] = v
        sys.stdout, sys.stderr = s.streams["stdout"], s.streams["stderr"]
        sys.stdin = io.StringIO("")
        signal.signal(signal.SIGINT, self.on_sigint)
        try:
            try:
                self.in_cell = True
                self.execute(s, code, filename)
            finally:
                self.in_cell = False
        except BaseException as exc:  # noqa: B036 - SystemExit, KeyboardInterrupt: the cell's error
            for st in s.streams.values():
                st.flush()
            s.send(self.error_event(exc, s, timeout))
        finally:
            sys.stdout, sys.stderr, sys.stdin = self.stdio
            for k, old in saved_env.items():
                if old is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = old

    def execute(self, s, code, filename):
        try:
            tree = ast.parse(code, filename, "exec")
        except SyntaxError as first:
            # Not Python as it stands: maybe IPython's line forms.
            shell = shell_lines(code)
            if shell == code:
                raise
            try:
                tree = ast.parse(shell, filename, "exec")
            except SyntaxError:
                raise first from None
            code = shell
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr) and not code.rstrip().endswith(";"):
            last = ast.Expression(tree.body.pop().value)
        flags = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)  # Python 3.8 and later
        self.run_code(compile(tree, filename, "exec", flags=flags))
        if last is not None:
            value = self.run_code(compile(last, filename, "eval", flags=flags))
            if value is not None:
                self.ns["_"] = value
                s.send(result_event(bundle(value), True))

    def run_code(self, co):
        value = eval(co, self.ns)
        if co.co_flags & getattr(inspect, "CO_COROUTINE", 0) and inspect.iscoroutine(value):
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
            value = self.loop.run_until_complete(value)
        return value

    def error_event(self, exc, s, timeout):
        if isinstance(exc, SyntaxError):
            lines = traceback.format_exception_only(type(exc), exc)
        else:
            # The cell's frames only: not the driver's exec and eval, nor
            # the signal handler that raised an interrupt.
            te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
            te.stack = traceback.StackSummary.from_list(
                [f for f in te.stack if f.filename != DRIVER_FILE])
            lines = list(te.format())
        if isinstance(exc, KeyboardInterrupt) and s.timed_out:
            return {"type": "error", "name": "TimeoutError",
                    "value": "execution timed out after %g s and was interrupted" % timeout,
                    "traceback": "".join(lines)}
        return {"type": "error", "name": type(exc).__name__, "value": str(exc), "traceback": "".join(lines)}

    def display(self, *objs, **kwargs):
        s = self.session
        if s is None:
            return
        for obj in objs:
            for st in s.streams.values():
                st.flush()
            s.send(result_event(bundle(obj), False))

    def system(self, cmd):
        """`!cmd` in a cell: the command's output into the cell's stdout."""
        sys.stdout.flush()
        p = subprocess.Popen(cmd, shell=True, executable="/bin/sh", stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            for line in iter(p.stdout.readline, b""):
                sys.stdout.write(line.decode("utf-8", "replace"))
            p.wait()
        except BaseException:
            p.kill()
            p.wait()
            raise
        finally:
            p.stdout.close()
        return None


_MAGIC = re.compile(r"^(\s*)(!|%cd\s|%cd$|%pip\s|%env\s)(.*)$")


def shell_lines(code):
    """IPython's line forms a cell may use, as Python: `!cmd`, `%pip ...`,
    `%cd DIR`, `%env K=V`. Only tried when the cell is not Python as it
    stands."""
    out = []
    for line in code.split("\n"):
        m = _MAGIC.match(line)
        if not m:
            out.append(line)
            continue
        indent, kind, rest = m.group(1), m.group(2).strip(), m.group(3).strip()
        if kind == "!":
            out.append("%s__dsec_system__(%r)" % (indent, rest))
        elif kind == "%pip":
            out.append("%s__dsec_system__(%r)" % (indent, sys.executable + " -m pip " + rest))
        elif kind == "%cd":
            out.append("%s__import__('os').chdir(__import__('os').path.expanduser(%r or '~'))" % (indent, rest))
        else:
            k, _, v = rest.partition("=")
            out.append("%s__import__('os').environ.__setitem__(%r, %r)" % (indent, k.strip(), v.strip()))
    return "\n".join(out)


# Jupyter's MIME types and the _repr_*_ methods that give them.
_REPRS = [
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("application/pdf", "_repr_pdf_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
    ("application/javascript", "_repr_javascript_"),
]

_BINARY = {"image/png", "image/jpeg", "application/pdf"}


def bundle(value):
    """A value's display data, as IPython's formatter makes it: repr as
    text/plain, and what its _repr_mimebundle_ / _repr_*_ methods give."""
    data = {}
    mb = getattr(value, "_repr_mimebundle_", None)
    if callable(mb) and not isinstance(value, type):
        try:
            got = mb(include=None, exclude=None)
            if isinstance(got, tuple):
                got = got[0]
            if isinstance(got, dict):
                data.update(got)
        except Exception:
            pass
    for mime, name in _REPRS:
        if mime in data:
            continue
        f = getattr(value, name, None)
        if not callable(f) or isinstance(value, type):
            continue
        try:
            got = f()
        except Exception:
            continue
        if isinstance(got, tuple):
            got = got[0]
        if got is not None:
            data[mime] = got
    for mime in list(data):
        v = data[mime]
        if isinstance(v, (bytes, bytearray)):
            data[mime] = base64.b64encode(v).decode("ascii") if mime in _BINARY else bytes(v).decode("utf-8", "replace")
    if "text/plain" not in data:
        data["text/plain"] = repr(value)
    return data


# E2B's result fields by MIME type; the rest go to extra.
_FIELDS = {
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown",
    "image/svg+xml": "svg", "image/png": "png", "image/jpeg": "jpeg",
    "application/pdf": "pdf", "text/latex": "latex", "application/json": "json",
    "application/javascript": "javascript", "e2b/data": "data", "e2b/chart": "chart",
}


def result_event(data, main):
    ev = {"type": "result"}
    extra = {}
    for mime, v in data.items():
        field = _FIELDS.get(mime)
        if field is None:
            extra[mime] = v
        else:
            ev[field] = v
    text = ev.get("text")
    # E2B's server drops the quotes of a string's repr.
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        ev["text"] = text[1:-1]
    ev["extra"] = extra
    ev["is_main_result"] = main
    return ev


def read_exactly(conn, n):
    chunks = []
    while n > 0:
        b = conn.recv(min(n, 1 << 20))
        if not b:
            return None
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def read_request(conn):
    head = read_exactly(conn, 8)
    if head is None:
        return None
    n = int.from_bytes(head, "big")
    if n > MAX_REQUEST:
        return None
    body = read_exactly(conn, n)
    if body is None:
        return None
    try:
        req = json.loads(body.decode("utf-8"))
    except ValueError:
        return None
    return req if isinstance(req, dict) else None


def peer_gone(conn):
    try:
        r, _, _ = select.select([conn], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(r)


def main(argv):
    sock_name, cwd = argv[1], argv[2] if len(argv) > 2 else ""
    if cwd:
        os.chdir(cwd)
    d = Driver(sock_name, cwd)
    if "" not in sys.path:
        sys.path.insert(0, "")
    d.serve(d.start())


main(sys.argv)
