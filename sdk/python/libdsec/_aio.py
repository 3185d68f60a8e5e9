"""The asyncio client: AsyncClient, Sandbox, Job, Session and result types."""

from __future__ import annotations

import asyncio
import base64
import io
import math
import os
import tarfile
import threading
import uuid
from dataclasses import dataclass
from typing import (Any, AsyncIterator, Callable, Dict, Iterable, List, Mapping,
                    Optional, Sequence, Tuple, Union)

from . import errors
from ._fncall import (BATCH_GRACE, FNCALL, MAX_BATCH, Language, RunCode, RunResult, passed,
                      split_cases)
from ._events import EventCalls
from ._usage import UsageCalls
from ._iam import IAMCalls, When, _ms
from ._trajectory import TrajectoryCalls
from ._transport import ServerStream, Transport

SANDBOX = "dsec.v1.SandboxService"
LAYERS = "dsec.v1.LayerService"

DEFAULT_TIMEOUT = 30.0      # unary calls
DEFAULT_CREATE_TIMEOUT = 120.0
# The isolations a create may ask for (SandboxSpec.isolation).
ISOLATIONS = ("container", "gvisor", "microvm")
EXEC_GRACE = 15.0           # beyond a command's own timeout, for its report to arrive
# Stdin up to STDIN_INLINE bytes goes in the exec request; more is streamed
# with WriteStdin, STDIN_CHUNK bytes a call, once the command has started (the
# API takes at most 63 MiB in one request).
STDIN_INLINE = 1 << 20
STDIN_CHUNK = 1 << 20

Command = Union[str, Sequence[str]]
Data = Union[bytes, bytearray, memoryview, str]

_STATUS = {
    "EXIT_STATUS_OK": "ok", "EXIT_STATUS_NONZERO": "nonzero", "EXIT_STATUS_TIMEOUT": "timeout",
    "EXIT_STATUS_OOM": "oom", "EXIT_STATUS_KILLED": "killed", "EXIT_STATUS_START_ERROR": "sandbox_error",
}


@dataclass
class GradeResult:
    """A clean-room grade (Sandbox.grade; docs/grading.md).

    reward is the number the grader wrote to $DSEC_REWARD_FILE when it
    wrote one (reward_source "file"; "file-invalid" when it was no finite
    number, scored 0), else 1.0 on exit 0 and 0.0 otherwise (reward_source
    "exit"); a grader that did not exit 0 scores 0 whatever the file says.
    status is the grader's, as ExecResult's. times are milliseconds
    (capture_ms, start_ms, tests_ms, grader_ms, reward_ms, receipt_ms,
    evidence_ms, total_ms), with pooled and laid (bools: the room came
    from a grade pool, the capture was laid into it);
    capture is the workspace's SnapshotInfo; raw the whole GradeResult.
    infra_fault names the platform's fault when the platform ended the
    grader (reward_source "fault"): mask the rollout, the reward means
    nothing. receipt is the grade's signed receipt (docs/receipts.md), the
    bytes to write to a file for `dsec receipt verify`; None where the
    server holds no receipt key. provenance is the graded sandbox's
    provenance when the grade began (as Sandbox.provenance() gives it,
    flags_set included; None where it could not be read), and
    trajectory_hash its trajectory's "sha256:HEX@SIZE" so far ("" when it
    records none).
    """
    reward: float
    reward_source: str
    exit_code: int
    status: str
    stdout_bytes: bytes
    stderr_bytes: bytes
    times: Dict[str, int]
    capture: Dict[str, Any]
    grader_sandbox_id: str
    user: str
    raw: Dict[str, Any]
    infra_fault: Optional[str] = None
    receipt: Optional[bytes] = None
    provenance: Optional[Dict[str, Any]] = None
    trajectory_hash: str = ""

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode(errors="replace")

    @classmethod
    def _from(cls, r: Dict[str, Any]) -> "GradeResult":
        ex = r.get("exit", {})
        return cls(reward=float(r.get("reward", 0.0)), reward_source=r.get("rewardSource", ""),
                   exit_code=int(ex.get("exitCode", 0)), status=_STATUS.get(ex.get("status", ""), "ok"),
                   stdout_bytes=base64.b64decode(r.get("stdout", "")),
                   stderr_bytes=base64.b64decode(r.get("stderr", "")),
                   times={_snake(k): v if isinstance(v, bool) else int(v) for k, v in r.get("times", {}).items()},
                   capture=r.get("capture", {}), grader_sandbox_id=r.get("graderSandboxId", ""),
                   user=r.get("user", ""), raw=r, infra_fault=errors.fault_of_enum(r.get("fault")),
                   receipt=base64.b64decode(r["receipt"]) if r.get("receipt") else None,
                   provenance=_provenance(r["provenance"]) if r.get("provenance") else None,
                   trajectory_hash=r.get("trajectoryHash", ""))


def _snake(camel: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in camel)


def _bytes(data: Data) -> bytes:
    if isinstance(data, str):
        return data.encode()
    return bytes(data)


def _b64(data: Data) -> str:
    return base64.b64encode(_bytes(data)).decode("ascii")


def _unb64(s: Optional[str]) -> bytes:
    if not s:
        return b""
    s = s.replace("-", "+").replace("_", "/")
    return base64.b64decode(s + "=" * (-len(s) % 4))


UPLOAD_PIECE = 1 << 20  # bytes of archive in one message of an upload


async def _upload_messages(header: Dict[str, Any], path: str) -> AsyncIterator[Dict[str, Any]]:
    """The messages of an upload of path: the header, the archive in pieces
    (a file as it is, a directory packed by a thread as it is read), then the
    end marker, which only a source read whole gets."""
    loop = asyncio.get_running_loop()
    if not os.path.isdir(path):
        with open(path, "rb") as f:
            yield {"header": dict(header, size=str(os.fstat(f.fileno()).st_size))}
            while True:
                piece = await loop.run_in_executor(None, f.read, UPLOAD_PIECE)
                if not piece:
                    break
                yield {"data": _b64(piece)}
        yield {"end": True}
        return
    rfd, wfd = os.pipe()
    failed: List[BaseException] = []

    def pack() -> None:
        try:
            with os.fdopen(wfd, "wb") as w, tarfile.open(fileobj=w, mode="w|", format=tarfile.PAX_FORMAT) as tf:
                for name in sorted(os.listdir(path)):
                    tf.add(os.path.join(path, name), arcname=name)
        except BaseException as e:  # a broken pipe too: the upload ended first
            failed.append(e)

    packer = threading.Thread(target=pack, name="dsec-upload-pack", daemon=True)
    packer.start()
    try:
        yield {"header": header}
        with os.fdopen(rfd, "rb", buffering=0) as r:
            rfd = -1
            while True:
                piece = await loop.run_in_executor(None, _read_full, r, UPLOAD_PIECE)
                if not piece:
                    break
                yield {"data": _b64(piece)}
        await loop.run_in_executor(None, packer.join)
        if failed:
            raise errors.InvalidArgument(f"upload {header['ref']}: pack {path}: {failed[0]}")
        yield {"end": True}
    finally:
        if rfd >= 0:
            os.close(rfd)


def _read_full(r, n: int) -> bytes:
    """Up to n bytes from r, fewer only at its end."""
    parts, got = [], 0
    while got < n:
        b = r.read(n - got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def _rules(rules: Mapping[str, bool]) -> Dict[str, bool]:
    """Network rules as sent: each value must be True or False. Rules are
    security policy, so "false" (a string, truthy in Python) or 0 is refused
    by name rather than read as allow."""
    out: Dict[str, bool] = {}
    for k, v in rules.items():
        if not isinstance(v, bool):
            raise errors.InvalidArgument(
                f"network rule {str(k)!r}: want True or False, not {type(v).__name__} {v!r}")
        out[str(k)] = v
    return out


def _lower_enum(v: Optional[str], prefix: str) -> str:
    if not v:
        return ""
    return v[len(prefix):].lower() if v.startswith(prefix) else v.lower()


_LIVE_STATES = ["creating", "running", "pausing", "paused", "resuming", "stopping"]


async def _each_live(sbs, concurrency: int, call) -> List["Sandbox"]:
    """Run call on every sandbox, at most concurrency at once, and return
    those it succeeded on: a sandbox that ended or vanished meanwhile is
    skipped, any other error raised."""
    sem = asyncio.Semaphore(concurrency)
    ok: List[bool] = [False] * len(sbs)

    async def one(i, sb):
        async with sem:
            try:
                await call(sb)
                ok[i] = True
            except (errors.SandboxGone, errors.NotFound):
                pass

    await asyncio.gather(*(one(i, sb) for i, sb in enumerate(sbs)))
    return [sb for i, sb in enumerate(sbs) if ok[i]]


async def _each(items, concurrency: int, call) -> None:
    """Run call on every item, at most concurrency at once; raise the first error."""
    sem = asyncio.Semaphore(concurrency)

    async def one(item):
        async with sem:
            await call(item)

    await asyncio.gather(*(one(x) for x in items))


def _state_name(s: str) -> str:
    s = s.upper()
    return s if s.startswith("STATE_") else "STATE_" + s


def _decode(b: bytes) -> str:
    return b.decode("utf-8", errors="replace")


# --- results -------------------------------------------------------------------

@dataclass
class ExecResult:
    """What a finished command did.

    status is "ok", "nonzero", "timeout", "oom", "killed" or "sandbox_error"
    (the command could not be started). stdout/stderr are text decoded as
    UTF-8 with errors="replace"; stdout_bytes/stderr_bytes are the raw bytes.
    truncated says the output lacks stdout_dropped/stderr_dropped bytes the
    command wrote (the calls that return such a result raise
    errors.OutputDropped with it instead). A result unpacks as
    (exit_code, stdout, stderr).
    """
    exit_code: int
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    duration_s: float = 0.0
    truncated: bool = False
    status: str = "ok"
    signal: int = 0
    message: str = ""
    process_id: str = ""
    pid: int = 0
    stdout_dropped: int = 0
    stderr_dropped: int = 0
    infra_fault: Optional[str] = None
    phase: Optional[str] = None

    @property
    def stdout(self) -> str:
        return _decode(self.stdout_bytes)

    @property
    def stderr(self) -> str:
        return _decode(self.stderr_bytes)

    @property
    def output(self) -> str:
        """stdout then stderr, as text."""
        return self.stdout + self.stderr

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def __iter__(self):
        return iter((self.exit_code, self.stdout, self.stderr))


@dataclass
class ExecEvent:
    """One event of a streamed command.

    type is "started" (process_id, pid, tag set), "stdout" or "stderr" (data
    set), "dropped" (where the stream lacks dropped bytes of stream,
    "stdout" or "stderr": see errors.OutputDropped) or "exited" (result set,
    with the output gathered so far).
    """
    type: str
    data: bytes = b""
    process_id: str = ""
    pid: int = 0
    tag: str = ""
    result: Optional[ExecResult] = None
    stream: str = ""
    dropped: int = 0

    @property
    def text(self) -> str:
        return _decode(self.data)


@dataclass
class FileInfo:
    name: str
    path: str
    size: int
    mode: int
    type: str           # "file", "dir", "symlink" or "other"
    mtime_unix_ms: int = 0
    link_target: str = ""
    uid: int = 0
    gid: int = 0

    @property
    def is_dir(self) -> bool:
        return self.type == "dir"

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "FileInfo":
        return FileInfo(name=d.get("name", ""), path=d.get("path", ""), size=int(d.get("size", 0)),
                        mode=int(d.get("mode", 0)), type=d.get("type", ""),
                        mtime_unix_ms=int(d.get("mtimeUnixMs", 0)), link_target=d.get("linkTarget", ""),
                        uid=int(d.get("uid", 0)), gid=int(d.get("gid", 0)))


@dataclass
class ProcessInfo:
    process_id: str
    pid: int
    tag: str
    argv: List[str]
    running: bool
    result: Optional[ExecResult] = None


@dataclass
class WarmPool:
    """A node's pool of started, idle sandboxes of one shape (see set_warm_pool)."""
    key: str            # the shape's key (a digest of the shape)
    node: str           # the node holding the pool; every node keeps its own
    environment: str
    spec: Dict[str, Any]  # the shape (SandboxSpec as a dict), node defaults filled in
    size: int           # sandboxes kept ready
    ready: int = 0      # started, idle and waiting to be taken
    starting: int = 0   # being started to refill the pool
    taken: int = 0      # creates served from the pool
    missed: int = 0     # creates of this shape that found it empty
    last_error: str = ""  # why the last refill failed; "" when it did not

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "WarmPool":
        spec = dict(d.get("spec") or {})
        return WarmPool(key=d.get("key", ""), node=d.get("node", ""), environment=spec.get("environment", ""),
                        spec=spec, size=int(d.get("size", 0)), ready=int(d.get("ready", 0)),
                        starting=int(d.get("starting", 0)), taken=int(d.get("taken", 0)),
                        missed=int(d.get("missed", 0)), last_error=d.get("lastError", ""))


class Page(tuple):
    """One page of sandboxes (list_page): a tuple (sandboxes, next_token,
    total), so ``page, next_token, total = c.list_page(...)`` unpacks it,
    with those three as attributes too and ``unreachable``: the nodes the
    apiserver could not reach, whose sandboxes are in neither the page nor
    total (docs/cluster.md); empty when every node answered."""

    def __new__(cls, sandboxes: List[Any], next_token: str, total: int,
                unreachable: Iterable[str] = ()) -> "Page":
        page = super().__new__(cls, (sandboxes, next_token, total))
        page.unreachable = list(unreachable)
        return page

    @property
    def sandboxes(self) -> List[Any]:
        return self[0]

    @property
    def next_token(self) -> str:
        return self[1]

    @property
    def total(self) -> int:
        return self[2]

    def __repr__(self) -> str:
        return "Page(sandboxes=%r, next_token=%r, total=%r, unreachable=%r)" % (*self, self.unreachable)


def _phase_name(v: Any) -> Optional[str]:
    """A JSON Phase enum value as "setup", "agent" or "verify"; None when unset."""
    names = {1: "setup", 2: "agent", 3: "verify"}
    if isinstance(v, int):
        return names.get(v)
    if not v or v == "PHASE_UNSPECIFIED":
        return None
    return str(v).removeprefix("PHASE_").lower()


class _Collector:
    """Turns ExecEvent JSON into output buffers and, at the end, an ExecResult."""

    def __init__(self, on_stdout=None, on_stderr=None):
        self.out = bytearray()
        self.err = bytearray()
        self.dropped = {"stdout": 0, "stderr": 0}
        self.truncated = False
        self.process_id = ""
        self.pid = 0
        self.tag = ""
        self.phase: Optional[str] = None
        self.result: Optional[ExecResult] = None
        self.on_stdout = on_stdout
        self.on_stderr = on_stderr
        self.on_started: Optional[Callable[[str], Any]] = None

    def feed(self, ev: Mapping[str, Any]) -> Optional[ExecEvent]:
        if "started" in ev:
            s = ev["started"] or {}
            self.process_id = s.get("processId", "")
            self.pid = int(s.get("pid", 0))
            self.tag = s.get("tag", "")
            self.phase = _phase_name(s.get("phase"))
            if self.on_started:
                self.on_started(self.process_id)
            return ExecEvent("started", process_id=self.process_id, pid=self.pid, tag=self.tag)
        if "stdout" in ev:
            b = _unb64(ev["stdout"])
            self.out += b
            if self.on_stdout:
                self.on_stdout(b)
            return ExecEvent("stdout", data=b, process_id=self.process_id)
        if "stderr" in ev:
            b = _unb64(ev["stderr"])
            self.err += b
            if self.on_stderr:
                self.on_stderr(b)
            return ExecEvent("stderr", data=b, process_id=self.process_id)
        if "dropped" in ev:
            d = ev["dropped"] or {}
            stream = "stderr" if d.get("stderr") else "stdout"
            n = int(d.get("bytes", 0))
            self.dropped[stream] += n
            return ExecEvent("dropped", process_id=self.process_id, stream=stream, dropped=n)
        if "exited" in ev:
            x = ev["exited"] or {}
            for stream, got in (("stdout", self.out), ("stderr", self.err)):
                if x.get(stream + "Truncated"):
                    self.truncated = True
                    self.dropped[stream] = max(self.dropped[stream], int(x.get(stream + "Bytes", 0)) - len(got))
            self.result = self.partial(
                exit_code=int(x.get("exitCode", 0)), duration_s=float(x.get("durationSeconds", 0.0)),
                status=_STATUS.get(x.get("status", ""), "ok" if int(x.get("exitCode", 0)) == 0 else "nonzero"),
                signal=int(x.get("signal", 0)), message=x.get("message", ""),
                infra_fault=errors.fault_of_enum(x.get("fault")), phase=self.phase)
            return ExecEvent("exited", process_id=self.process_id, result=self.result)
        return None  # keepalive or unknown

    def partial(self, **kw) -> ExecResult:
        """A result of the output gathered so far (kw: the exit's fields)."""
        return ExecResult(stdout_bytes=bytes(self.out), stderr_bytes=bytes(self.err),
                          truncated=self.truncated or any(self.dropped.values()),
                          stdout_dropped=self.dropped["stdout"], stderr_dropped=self.dropped["stderr"],
                          process_id=self.process_id, pid=self.pid, **kw)


class _StdinFeed:
    """Streams a large stdin into a started command, then closes it.

    Errors end it quietly: a command that exits or closes its stdin early
    takes no more input, and its exit status tells the rest.
    """

    def __init__(self, sandbox: "Sandbox", data: bytes):
        self.sandbox = sandbox
        self.data = data
        self.task: Optional[asyncio.Task] = None

    def start(self, process_id: str) -> None:
        if self.task is None:
            job = Job(self.sandbox, process_id, 0, "")
            self.task = asyncio.ensure_future(self._write(job))

    async def _write(self, job: "Job") -> None:
        try:
            await job.write_stdin(self.data, close=True)
        except errors.DsecError:
            pass

    async def stop(self) -> None:
        """Ends the feed if it is still writing, and waits for it."""
        if self.task is None:
            return
        if not self.task.done():
            self.task.cancel()
        await asyncio.wait({self.task})
        if not self.task.cancelled() and self.task.exception() is not None:
            raise self.task.exception()


def _whole(res: ExecResult) -> ExecResult:
    """res, unless it lacks output the command wrote: then OutputDropped."""
    if res.truncated:
        raise errors.OutputDropped(res)
    return res


async def _drive(stream: ServerStream, col: _Collector, what: str) -> ExecResult:
    try:
        while col.result is None:
            ev = await stream.next()
            if ev is None:
                raise errors.Unavailable(f"{what}: the stream ended before the command exited")
            col.feed(ev)
        try:
            await stream.next()  # the end message, so the connection can be reused
        except errors.DsecError:
            pass
    finally:
        stream.close()
    return col.result


# --- client ------------------------------------------------------------------------

class AsyncClient(IAMCalls, TrajectoryCalls, EventCalls, UsageCalls):
    """A client of a dsecd, or of a cluster of apiservers.

    addr is one address or a comma-separated list of them, each
    unix:///path, http://host:port, https://host:port or host:port; default
    $DSEC_ADDR, else unix:///var/lib/dsec/dsecd.sock. With several, calls
    fail over from one to the next (see docs/python.md for which calls may be
    sent again). token is the bearer token sent on every call; default
    $DSEC_TOKEN, else the file $DSEC_TOKEN_FILE names, else
    /var/lib/dsec/admin.token when readable. ca_file is a PEM bundle to
    verify https:// servers with; default $DSEC_CA_FILE, else the system's
    roots. Use it from one event loop; close() (or ``async with``) drops its
    connections.
    """

    def __init__(self, addr: Optional[str] = None, *, timeout: float = DEFAULT_TIMEOUT,
                 max_idle_connections: int = 32, token: Optional[str] = None,
                 ca_file: Optional[str] = None):
        self._t = Transport(addr, max_idle=max_idle_connections, token=token, ca_file=ca_file)
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"AsyncClient({self._t.describe()!r})"

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._t.close()

    def _to(self, timeout: Optional[float]) -> Optional[float]:
        return self.timeout if timeout is None else timeout

    async def _call(self, method: str, msg: Dict[str, Any], timeout: Optional[float], *,
                    idempotent: bool = False, service: str = SANDBOX) -> Dict[str, Any]:
        return await self._t.unary(service, method, msg, timeout=self._to(timeout), idempotent=idempotent)

    # --- sandboxes ---

    @staticmethod
    def _spec(env: str, backend: str, cpus, memory_mb, disk_mb, pids, ttl_s, idle_timeout_s, user,
              env_vars, labels, network_rules, hostname, workdir, on_timeout=None,
              auto_resume=None, isolation=None, qos=None, provenance=None) -> Dict[str, Any]:
        if backend not in ("container", ""):
            raise errors.InvalidArgument(f"backend {backend!r} is not known (container)")
        spec: Dict[str, Any] = {"environment": env, "backend": "BACKEND_CONTAINER"}
        if isolation not in (None, "") + ISOLATIONS:
            raise errors.InvalidArgument(
                f"isolation {isolation!r} is not known ({', '.join(ISOLATIONS)})")
        if isolation:
            spec["isolation"] = "ISOLATION_" + isolation.upper()
        if qos not in (None, "", "latency", "best_effort"):
            raise errors.InvalidArgument(f"qos {qos!r} is not known (latency, best_effort)")
        if qos:
            spec["qos"] = qos
        if on_timeout not in (None, "stop", "pause"):
            raise errors.InvalidArgument(f"on_timeout {on_timeout!r}: want 'stop' or 'pause'")
        if on_timeout:
            spec["onTimeout"] = "ON_TIMEOUT_" + on_timeout.upper()
        if auto_resume is not None:
            if not isinstance(auto_resume, bool):
                raise errors.InvalidArgument(f"auto_resume must be True or False, not {auto_resume!r}")
            spec["autoResume"] = auto_resume
        if cpus:
            spec["cpus"] = float(cpus)
        for k, v in (("memoryMb", memory_mb), ("diskMb", disk_mb), ("pids", pids),
                     ("ttlSeconds", ttl_s), ("idleTimeoutSeconds", idle_timeout_s)):
            if v:
                spec[k] = str(int(math.ceil(v)))
        for k, v in (("user", user), ("hostname", hostname), ("workdir", workdir)):
            if v:
                spec[k] = v
        if env_vars:
            spec["env"] = {str(k): str(v) for k, v in env_vars.items()}
        if labels:
            spec["labels"] = {str(k): str(v) for k, v in labels.items()}
        if network_rules:
            spec["networkRules"] = _rules(network_rules)
        if provenance:
            spec["provenance"] = _provenance_paths(provenance)
        return spec

    async def create_many(self, n: int, env: str, *, backend: str = "container",
                          isolation: Optional[str] = None,
                          qos: Optional[str] = None,
                          cpus: Optional[float] = None, memory_mb: Optional[int] = None,
                          disk_mb: Optional[int] = None, pids: Optional[int] = None,
                          ttl_s: Optional[float] = None, idle_timeout_s: Optional[float] = None,
                          user: Optional[str] = None, env_vars: Optional[Mapping[str, str]] = None,
                          labels: Optional[Mapping[str, str]] = None,
                          network_rules: Optional[Mapping[str, bool]] = None,
                          hostname: Optional[str] = None, workdir: Optional[str] = None,
                          timeout: float = DEFAULT_CREATE_TIMEOUT,
                          idempotency_key: Optional[str] = None,
                          on_timeout: Optional[str] = None,
                          auto_resume: Optional[bool] = None,
                          phases: Optional[Mapping[str, float]] = None,
                          provenance: Optional[Mapping[str, Sequence[str]]] = None) -> List["Sandbox"]:
        """Create n sandboxes in one call: all of them, or none.

        The call carries an idempotency key, so retries after a dropped
        connection never make a second batch. timeout covers waiting for the
        sandboxes to run; past it StartupTimeout is raised. on_timeout
        ("stop", the default, or "pause") is what the TTL and idle timeout
        do; a paused sandbox's clocks stand still. auto_resume=False makes
        calls to a paused sandbox fail (FailedPrecondition) instead of
        resuming it first. isolation is what keeps the sandboxes apart from
        their node: "container" (the default: runc on the host's kernel),
        "gvisor" (gVisor's user-space kernel) or "microvm" (a kernel of their
        own under QEMU); a node or cluster without it refuses the create
        (FailedPrecondition or NotSupported) naming what to install.
        qos is the CPU class: "latency" (the default) or "best_effort",
        which runs the sandboxes under SCHED_IDLE (docs/qos.md).
        phases, e.g. {"setup": 60, "agent": 600, "verify": 120} (seconds),
        splits each sandbox's life into budgets: the TTL becomes their sum
        plus 30 s, the agent phase's end (its budget, or end_phase("agent"))
        kills every process in the sandbox but not the sandbox, and verify
        keeps its budget however the agent overran (docs/lifecycle.md).
        provenance marks the task's paths for Sandbox.provenance: a dict
        with any of "workspace", "tests" and "protected", each a list of
        absolute paths in the sandbox.
        """
        if n < 1:
            raise errors.InvalidArgument("n must be at least 1")
        spec = self._spec(env, backend, cpus, memory_mb, disk_mb, pids, ttl_s, idle_timeout_s, user,
                          env_vars, labels, network_rules, hostname, workdir, on_timeout, auto_resume,
                          isolation, qos, provenance)
        if phases:
            unknown = set(phases) - {"setup", "agent", "verify"}
            if unknown:
                raise errors.InvalidArgument(f"phases: {sorted(unknown)} not known (setup, agent, verify)")
            spec["phases"] = {f"{k}Seconds": float(v) for k, v in phases.items()}
        msg = {"spec": spec, "count": n, "idempotencyKey": idempotency_key or str(uuid.uuid4()),
               "waitSeconds": str(max(1, int(timeout)))}
        # A little beyond the server's wait, so its own verdict arrives first.
        resp = await self._t.unary(SANDBOX, "Create", msg, timeout=timeout + 2.0,
                                   idempotent=True, creating=True)
        return [Sandbox(self, d) for d in resp.get("sandboxes", [])]

    async def create(self, env: str, **kw) -> "Sandbox":
        """Create one sandbox from env ("BASE[+LAYER...]"); see create_many for the arguments."""
        return (await self.create_many(1, env, **kw))[0]

    async def run_container(self, env: str, **kw) -> "Sandbox":
        """create(env, isolation="container", ...): a sandbox on the node's
        kernel, behind namespaces, cgroups and seccomp (runc)."""
        return await self.create(env, isolation="container", **kw)

    async def run_gvisor(self, env: str, **kw) -> "Sandbox":
        """create(env, isolation="gvisor", ...): a sandbox whose system calls
        gVisor's user-space kernel serves (runsc), on nodes that offer it."""
        return await self.create(env, isolation="gvisor", **kw)

    async def run_microvm(self, env: str, **kw) -> "Sandbox":
        """create(env, isolation="microvm", ...): the paper's run_microvm, a
        sandbox with a kernel of its own in a QEMU microVM (root, mounts,
        modules, its own firewall), on nodes that offer it."""
        return await self.create(env, isolation="microvm", **kw)

    async def nodes(self, *, timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        """The nodes, each with the kinds of sandbox it offers ("kinds":
        isolation, profile, accelerator), why it lacks the isolations it
        lacks ("missing": name -> reason) and whether its latency sandboxes
        get a core-scheduling cookie ("coreScheduling": "available",
        "reason"); a node the apiserver cannot reach has "healthy" false,
        "lastSeenUnixMs" when it last answered ("live" is as of then) and
        "unreachableReason" why its polls fail."""
        resp = await self._call("GetServerInfo", {}, timeout, idempotent=True)
        return list(resp.get("nodes", []))

    async def get(self, id: str, *, timeout: Optional[float] = None) -> "Sandbox":
        return Sandbox(self, await self._call("Get", {"id": id}, timeout, idempotent=True))

    def sandbox(self, id: str) -> "Sandbox":
        """A handle on an existing sandbox by ID, without a call."""
        return Sandbox(self, {"id": id})

    async def list(self, labels: Optional[Mapping[str, str]] = None,
                   states: Optional[Iterable[str]] = None, *, all: bool = False,
                   timeout: Optional[float] = None) -> List["Sandbox"]:
        """Sandboxes whose labels all match, in any of states ("running" or
        "STATE_RUNNING"...). By default the live ones (creating, running,
        stopping); all=True includes the stopped and failed ones the node
        keeps for its retention period."""
        msg: Dict[str, Any] = {}
        if labels:
            msg["labels"] = dict(labels)
        if states and all:
            raise errors.InvalidArgument("give states or all=True, not both")
        if states:
            msg["states"] = [_state_name(s) for s in states]
        if all:
            msg["all"] = True
        resp = await self._call("List", msg, timeout, idempotent=True)
        return [Sandbox(self, d) for d in resp.get("sandboxes", [])]

    async def list_page(self, labels: Optional[Mapping[str, str]] = None,
                        states: Optional[Iterable[str]] = None, *, all: bool = False,
                        page_size: int = 100, page_token: str = "",
                        timeout: Optional[float] = None) -> Page:
        """One page of list()'s sandboxes: at most page_size (at most 1000),
        newest first, after page_token ("" the first page). Returns a Page:
        the tuple of the page, the next page's token ("" after the last)
        and how many match in all pages, whose unreachable names the nodes
        the apiserver could not reach (their sandboxes are in neither)."""
        if page_size < 1:
            raise errors.InvalidArgument("page_size: want at least 1")
        msg: Dict[str, Any] = {"pageSize": page_size}
        if page_token:
            msg["pageToken"] = page_token
        if labels:
            msg["labels"] = dict(labels)
        if states and all:
            raise errors.InvalidArgument("give states or all=True, not both")
        if states:
            msg["states"] = [_state_name(s) for s in states]
        if all:
            msg["all"] = True
        resp = await self._call("List", msg, timeout, idempotent=True)
        return Page([Sandbox(self, d) for d in resp.get("sandboxes", [])],
                    resp.get("nextPageToken", ""), int(resp.get("total", 0)), resp.get("unreachableNodes", []))

    async def delete(self, id: str, *, timeout: Optional[float] = None) -> None:
        await self._call("Delete", {"id": id}, timeout, idempotent=True)

    async def reap(self, labels: Optional[Mapping[str, str]] = None, *,
                   timeout: Optional[float] = None, concurrency: int = 16) -> int:
        """Delete every live sandbox whose labels match; returns how many."""
        sbs = await self.list(labels, states=_LIVE_STATES, timeout=timeout)
        await _each(sbs, concurrency, lambda sb: self.delete(sb.id, timeout=timeout))
        return len(sbs)

    async def pause(self, id: str, *, keep_memory: bool = False,
                    timeout: Optional[float] = None) -> Dict[str, Any]:
        """Pause a sandbox; see Sandbox.pause."""
        return await self.sandbox(id).pause(keep_memory=keep_memory, timeout=timeout)

    async def resume(self, id: str, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Resume a paused sandbox; see Sandbox.resume."""
        return await self.sandbox(id).resume(timeout=timeout)

    async def pause_all(self, labels: Mapping[str, str], *, keep_memory: bool = False,
                        timeout: Optional[float] = None, concurrency: int = 32) -> List["Sandbox"]:
        """Pause every running sandbox whose labels match (a preempted
        trainer pauses its job's sandboxes this way) and return those it
        paused; one that ended meanwhile is left out."""
        sbs = await self.list(labels, states=["running"], timeout=timeout)
        done = await _each_live(sbs, concurrency, lambda sb: sb.pause(keep_memory=keep_memory, timeout=timeout))
        return done

    async def resume_all(self, labels: Mapping[str, str], *, timeout: Optional[float] = None,
                         concurrency: int = 32) -> List["Sandbox"]:
        """Resume every paused sandbox whose labels match and return those
        it resumed; one that ended meanwhile is left out."""
        sbs = await self.list(labels, states=["paused"], timeout=timeout)
        return await _each_live(sbs, concurrency, lambda sb: sb.resume(timeout=timeout))

    # --- snapshots ---

    async def list_snapshots(self, *, timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        """Every snapshot (the SnapshotInfo message as a dict: name, layer,
        environment, digest, size, sourceSandbox, node, frozenUs, ...)."""
        resp = await self._call("ListSnapshots", {}, timeout, idempotent=True)
        return list(resp.get("snapshots", []))

    async def delete_snapshot(self, name: str, *, timeout: Optional[float] = None) -> None:
        """Remove a snapshot's layer from every node (sandboxes running on
        it keep it until they go)."""
        await self._call("DeleteSnapshot", {"name": name}, timeout, idempotent=True)

    async def share_snapshot(self, name: str, project: str, *, timeout: Optional[float] = None) -> List[str]:
        """Share snapshot name of a project the token holds builder on with
        project, read-only (see share_layer). Returns the projects it is
        shared with now."""
        return await self.share_layer("snap:" + name, project, timeout=timeout)

    async def unshare_snapshot(self, name: str, project: str, *, timeout: Optional[float] = None) -> List[str]:
        """Take a share of snapshot name away."""
        return await self.unshare_layer("snap:" + name, project, timeout=timeout)

    # --- warm pools ---

    async def set_warm_pool(self, env: str, size: int, *, backend: str = "container",
                            isolation: Optional[str] = None,
                            qos: Optional[str] = None,
                            cpus: Optional[float] = None, memory_mb: Optional[int] = None,
                            disk_mb: Optional[int] = None, pids: Optional[int] = None,
                            ttl_s: Optional[float] = None, idle_timeout_s: Optional[float] = None,
                            user: Optional[str] = None, env_vars: Optional[Mapping[str, str]] = None,
                            labels: Optional[Mapping[str, str]] = None,
                            network_rules: Optional[Mapping[str, bool]] = None,
                            hostname: Optional[str] = None, workdir: Optional[str] = None,
                            timeout: Optional[float] = None) -> WarmPool:
        """Keep size sandboxes of env's shape started and idle on the node.

        A create with the same environment and shape then takes one at once
        instead of starting a container; the pool refills in the background.
        The shape is the spec without labels, ttl_s and idle_timeout_s (after
        node defaults), so the arguments are create's and those three are
        accepted but do not matter. size 0 removes the pool and its idle
        sandboxes. Sandboxes with network_rules cannot be pooled
        (InvalidArgument). A pool of an isolation is kept on the nodes that
        offer it. qos is part of the shape: a "best_effort" pool serves
        only best_effort creates.
        """
        if size < 0:
            raise errors.InvalidArgument("warm pool size must not be negative")
        spec = self._spec(env, backend, cpus, memory_mb, disk_mb, pids, ttl_s, idle_timeout_s, user,
                          env_vars, labels, network_rules, hostname, workdir, isolation=isolation,
                          qos=qos)
        resp = await self._call("SetWarmPool", {"spec": spec, "size": int(size)}, timeout, idempotent=True)
        return WarmPool.from_json(resp)

    async def warm_pools(self, *, timeout: Optional[float] = None) -> List[WarmPool]:
        """The warm pools of every node and how full they are."""
        resp = await self._call("ListWarmPools", {}, timeout, idempotent=True)
        return [WarmPool.from_json(d) for d in resp.get("pools", [])]

    # --- layers ---

    async def list_layers(self, *, timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        resp = await self._call("ListLayers", {}, timeout, idempotent=True, service=LAYERS)
        return resp.get("layers", [])

    async def import_layer(self, ref: str, path: str, *, kind: str = "base", allow_setuid: bool = False,
                           upload: bool = False, project: Optional[str] = None,
                           timeout: float = 600.0) -> Dict[str, Any]:
        """Build a layer from a directory or tar archive on the daemon's host,
        or, with upload=True, on this machine: the tree is streamed as a tar
        archive packed as it is sent (an archive file as it is), never held
        whole, as a client of a cluster does. An edge refuses an archive over
        its --max-upload-bytes (ResourceExhausted). The layer belongs to
        project (a path; default the token's), on which the token holds
        builder, and its bytes are charged to that project's quota."""
        header: Dict[str, Any] = {"ref": ref, "kind": "LAYER_KIND_" + kind.upper()}
        if allow_setuid:
            header["allowSetuid"] = True
        if project:
            header["project"] = project
        if upload:
            return await self._t.client_stream(LAYERS, "UploadLayer", _upload_messages(header, path),
                                               timeout=self._to(timeout))
        return await self._call("ImportLayer", dict(header, path=path), timeout, service=LAYERS)

    async def remove_layer(self, ref: str, *, timeout: Optional[float] = None) -> None:
        await self._call("RemoveLayer", {"ref": ref}, timeout, service=LAYERS)

    async def share_layer(self, ref: str, project: str, *, timeout: Optional[float] = None) -> List[str]:
        """Share a layer or image (name:tag) of a project the token holds
        builder on with project, read-only: that project and everything
        under it may list it, make sandboxes from it and fork them, never
        remove, overwrite or share it. Returns the projects it is shared
        with now; sharing again changes nothing."""
        resp = await self._call("ShareLayer", {"ref": ref, "project": project}, timeout,
                                idempotent=True, service=LAYERS)
        return list(resp.get("sharedWith", []))

    async def unshare_layer(self, ref: str, project: str, *, timeout: Optional[float] = None) -> List[str]:
        """Take a share away; one that is not there changes nothing."""
        resp = await self._call("ShareLayer", {"ref": ref, "project": project, "unshare": True}, timeout,
                                idempotent=True, service=LAYERS)
        return list(resp.get("sharedWith", []))

    async def list_environments(self, *, timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        resp = await self._call("ListEnvironments", {}, timeout, idempotent=True, service=LAYERS)
        return resp.get("environments", [])

    async def import_image(self, ref: str, source: str, *, insecure: bool = False,
                           collapse_below: int = 0, allow_setuid: bool = False,
                           project: Optional[str] = None,
                           on_progress: Optional[Callable[[Dict[str, Any]], None]] = None,
                           timeout: Optional[float] = 3600.0) -> Dict[str, Any]:
        """Import an OCI image as the environment ref (name:tag).

        source is ``oci:DIR[:TAG]`` or ``docker-archive:FILE`` (paths on the
        daemon's host) or ``docker://HOST[:PORT]/REPO:TAG``. on_progress gets
        each progress message (phase, layer, layers, bytes, totalBytes, rate).
        Returns the last message: layerDigests (bottom first) and ociLayers.
        """
        msg: Dict[str, Any] = {"ref": ref, "source": source}
        if insecure:
            msg["insecure"] = True
        if collapse_below:
            msg["collapseBelowBytes"] = str(int(collapse_below))
        if allow_setuid:
            msg["allowSetuid"] = True
        if project:
            msg["project"] = project
        stream = await self._t.stream(LAYERS, "ImportImage", msg, timeout=self._to(timeout))
        last: Dict[str, Any] = {}
        try:
            async for m in stream:
                last = m
                if on_progress is not None and not m.get("done"):
                    on_progress(m)
        finally:
            stream.close()
        if not last.get("done"):
            raise errors.Internal(f"import of {ref} ended without a result")
        return last

    async def layer_stats(self, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Per layer and environment: bytes read vs size, chunks fetched,
        cache hits and fan-out (the LayerStats message as a dict)."""
        return await self._call("LayerStats", {}, timeout, idempotent=True, service=LAYERS)

    # --- FnCall: short programs in pooled warm containers ---

    async def run_code(self, language: str, code: str, *, stdin: Optional[Data] = None,
                       files: Optional[Mapping[str, Data]] = None, fetch_files: Optional[Sequence[str]] = None,
                       compile_timeout: Optional[float] = None, run_timeout: Optional[float] = None,
                       memory_mb: Optional[int] = None, cpus: Optional[float] = None,
                       network_rules: Optional[Mapping[str, bool]] = None, environment: Optional[str] = None,
                       timeout: Optional[float] = None) -> RunResult:
        """Compile (for compiled languages) and run one program, as
        SandboxFusion's /run_code does (docs/fncall.md).

        stdin is the run step's input; files ({path: content}) are written
        into the call's scratch directory first and fetch_files read back
        after (RunResult.files). compile_timeout and run_timeout are seconds
        per step (default 10 each); memory_mb (default 1024) and cpus
        (default 1) are the call's limits; network_rules as
        set_network_rules takes them (default: no network). timeout bounds
        the whole call, default both step timeouts plus 30 s.

        A program that fails is a result (status "failed"); errors are for
        calls that could not be run: InvalidArgument (an unknown language, a
        bad path or timeout), Overloaded (every pool that could run it is
        full, its queue too), Unavailable. A call without network rules
        leaves nothing behind, so it is sent again after an Unavailable
        answer as reads are.
        """
        call = RunCode(language, code, stdin=stdin, files=files, fetch_files=fetch_files,
                       compile_timeout=compile_timeout, run_timeout=run_timeout, memory_mb=memory_mb, cpus=cpus,
                       network_rules=network_rules, environment=environment)
        resp = await self._t.unary(FNCALL, "RunCode", call.request(),
                                   timeout=call.deadline() if timeout is None else timeout,
                                   idempotent=call.repeatable)
        return RunResult.from_json(resp)

    async def run_code_batch(self, calls: Sequence[Union[RunCode, Mapping[str, Any]]], *,
                             timeout: Optional[float] = None) -> List[RunResult]:
        """Run many calls at once (RunCodeBatch), as the pools allow, and
        return their results in order.

        Each call is a RunCode or a dict of run_code's arguments. A call
        that could not be run is a result with status "sandbox_error" and
        the reason as message, not an error. Over 4096 calls go as several
        batches at once. timeout defaults to the longest call's plus 10
        minutes, for the calls' wait in the pools' queues.
        """
        specs = [RunCode.of(c) for c in calls]
        if not specs:
            return []
        msgs = [s.request() for s in specs]
        to = timeout if timeout is not None else max(s.deadline() for s in specs) + BATCH_GRACE
        repeatable = all(s.repeatable for s in specs)

        async def one(part: List[Dict[str, Any]]) -> List[RunResult]:
            resp = await self._t.unary(FNCALL, "RunCodeBatch", {"calls": part}, timeout=to, idempotent=repeatable)
            results = resp.get("results", [])
            if len(results) != len(part):
                raise errors.Internal(f"run code batch: {len(results)} results for {len(part)} calls")
            return [RunResult.from_json(r) for r in results]

        parts = await asyncio.gather(*(one(msgs[i:i + MAX_BATCH]) for i in range(0, len(msgs), MAX_BATCH)))
        return [r for part in parts for r in part]

    async def run_tests(self, language: str, code: str, cases: Sequence[Any], *,
                        timeout: Optional[float] = None, **kw) -> List[RunResult]:
        """Run one program once per case, all in one batch, in parallel as
        the pools allow; results come in the cases' order.

        cases is a list of stdins (str or bytes), or of (stdin,
        expected_stdout) pairs, or a mix. For a case with an expected
        output the result's passed says whether it passed as verl judges
        one: the call succeeded and its stdout equals the expected output
        once trailing newlines are cut from both. The other keyword
        arguments are run_code's (files, run_timeout, memory_mb, ...).
        """
        if "stdin" in kw:
            raise errors.InvalidArgument("run tests: each case brings its stdin; stdin= is not taken")
        stdins, expected = split_cases(cases)
        calls = [RunCode.of(dict(kw, language=language, code=code, stdin=s)) for s in stdins]
        results = await self.run_code_batch(calls, timeout=timeout)
        for r, want in zip(results, expected):
            if want is not None:
                r.passed = passed(r, want)
        return results

    async def languages(self, *, timeout: Optional[float] = None) -> List[Language]:
        """The languages run_code takes, with how each is compiled and run."""
        resp = await self._call("ListLanguages", {}, timeout, idempotent=True, service=FNCALL)
        return [Language.from_json(d) for d in resp.get("languages", [])]


class Sandbox:
    """One sandbox. ``async with sb:`` deletes it on exit.

    info is the last Sandbox message seen (protojson dict); refresh() updates it.
    """

    def __init__(self, client: AsyncClient, info: Dict[str, Any]):
        self.client = client
        self.info = info
        self.id: str = info.get("id", "")

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.state or '?'}>"

    @property
    def state(self) -> str:
        return _lower_enum(self.info.get("state"), "STATE_")

    @property
    def reason(self) -> str:
        return _lower_enum(self.info.get("reason"), "REASON_")

    @property
    def message(self) -> str:
        return self.info.get("message", "")

    @property
    def node(self) -> str:
        return self.info.get("node", "")

    @property
    def labels(self) -> Dict[str, str]:
        return dict((self.info.get("spec") or {}).get("labels") or {})

    @property
    def isolation(self) -> str:
        """What isolates the sandbox: "container", "gvisor" or "microvm"
        ("container" where the record does not say)."""
        v = str((self.info.get("spec") or {}).get("isolation") or "ISOLATION_CONTAINER")
        v = v[len("ISOLATION_"):].lower() if v.startswith("ISOLATION_") else v.lower()
        return "container" if v == "unspecified" else v

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.delete()

    @property
    def address(self) -> str:
        """The sandbox's IPv4 address if it has network rules, else ""."""
        return self.info.get("address", "")

    @property
    def warnings(self) -> List[str]:
        """What the node warned about when it made the sandbox, e.g. a network
        rule that allows nothing on that node (the create was not refused)."""
        return list(self.info.get("warnings") or [])

    @property
    def from_warm_pool(self) -> bool:
        """Whether the sandbox was taken from a warm pool rather than started for its create."""
        return bool(self.info.get("fromWarmPool", False))

    async def refresh(self, *, timeout: Optional[float] = None) -> "Sandbox":
        self.info = await self.client._call("Get", {"id": self.id}, timeout, idempotent=True)
        return self

    # --- network ---

    async def set_network_rules(self, rules: Mapping[str, bool], *, cut: bool = False,
                                timeout: Optional[float] = None) -> List[str]:
        """Replace the sandbox's network rules (same mapping as create's
        network_rules). New connections follow them at once; with cut=True
        established connections no longer allowed are broken. Returns the
        node's warnings (e.g. a service it knows no hosts for)."""
        msg: Dict[str, Any] = {"sandboxId": self.id, "rules": _rules(rules)}
        if cut:
            msg["cut"] = True
        resp = await self.client._call("SetNetworkRules", msg, timeout, idempotent=True)
        return list(resp.get("warnings", []))

    async def network_log(self, *, since: Optional[float] = None, limit: Optional[int] = None,
                          timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        """The sandbox's network audit records, oldest first: dicts with time
        (unix seconds), kind (connect|dns), verdict (allow|deny), protocol,
        destination, port, name, bytes_out, bytes_in and rule. since is a unix
        time in seconds."""
        msg: Dict[str, Any] = {"sandboxId": self.id}
        if since:
            msg["sinceUnixMs"] = str(int(since * 1000))
        if limit:
            msg["limit"] = int(limit)
        resp = await self.client._call("NetworkLog", msg, timeout, idempotent=True)
        out = []
        for e in resp.get("events", []):
            out.append({
                "time": int(e.get("timeUnixMs", 0)) / 1000.0, "kind": e.get("kind", ""),
                "verdict": e.get("verdict", ""), "protocol": e.get("protocol", ""),
                "destination": e.get("destination", ""), "port": int(e.get("port", 0)),
                "name": e.get("name", ""), "bytes_out": int(e.get("bytesOut", 0)),
                "bytes_in": int(e.get("bytesIn", 0)), "rule": e.get("rule", ""),
            })
        return out

    async def trajectory(self, offset: int = 0, *, timeout: Optional[float] = None):
        """The sandbox's trajectory from offset (docs/trajectories.md): a
        Trajectory of its lines, next_offset, ended and sha256."""
        return await self.client.trajectory(self.id, offset, timeout=timeout)

    async def provenance(self, *, flags_only: bool = False,
                         timeout: Optional[float] = None) -> Dict[str, Any]:
        """How the sandbox's state came to be (docs/provenance.md): a dict
        with flags (a dict of the flags by name: files_outside_workspace,
        tests_modified, interpreter_replaced, protected_read,
        network_allowed, network_denied, leftover_processes,
        packages_installed, syscalls_denied), flags_set (the names of
        those set), files_written, replaced, tests_changed,
        protected_reads, network, processes, packages, syscalls_denied
        (one per syscall: name, count, the first call's pid, command and
        time_unix_ms), syscall_samples (the first 32 calls) (lists of
        dicts, keys in snake_case), files_written_total,
        syscall_samples_dropped, syscall_records_lost, isolation, paths
        and unseen (what this sandbox's backend cannot see). flags_only leaves out the
        list of files written. May be sent again."""
        msg: Dict[str, Any] = {"sandboxId": self.id}
        if flags_only:
            msg["flagsOnly"] = True
        resp = await self.client._call("Provenance", msg, timeout, idempotent=True)
        return _provenance(resp)

    async def set_provenance_paths(self, *, workspace: Sequence[str] = (), tests: Sequence[str] = (),
                                   protected: Sequence[str] = (),
                                   timeout: Optional[float] = None) -> List[str]:
        """Replace the provenance paths the sandbox was made with; its
        protected paths are watched from now on. Returns the protected
        paths that cannot be watched, with why."""
        msg = {"sandboxId": self.id, "paths": _provenance_paths(
            {"workspace": workspace, "tests": tests, "protected": protected})}
        resp = await self.client._call("SetProvenancePaths", msg, timeout, idempotent=True)
        return list(resp.get("unwatched", []))

    async def delete(self, *, timeout: Optional[float] = None) -> None:
        await self.client.delete(self.id, timeout=timeout)

    # --- lifecycle ---

    async def pause(self, *, keep_memory: bool = False, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Freeze the sandbox and push its memory out of RAM (page cache
        dropped, anonymous memory to swap where the node has it;
        keep_memory=True only freezes). It stays paused across a restart of
        its node; any call that runs in it resumes it first (unless it was
        made with auto_resume=False). Returns what the pause did:
        already_paused, frozen_ms, reclaim_ms, resident_bytes,
        released_bytes, swapped_bytes; kept_bytes, what stayed in RAM, by
        kind (kept_anon_bytes, kept_shmem_bytes for files in /dev/shm and
        other tmpfs, kept_cache_bytes, kept_kernel_bytes), and kept_reason,
        why in words where the node can tell ("" when no kind of memory
        left as much as 1 MiB)."""
        msg: Dict[str, Any] = {"sandboxId": self.id}
        if keep_memory:
            msg["keepMemory"] = True
        resp = await self.client._call("Pause", msg, timeout, idempotent=True)
        self.info = resp.get("sandbox", self.info)
        st = self.info.get("lastPause") or {}
        return {
            "already_paused": bool(resp.get("alreadyPaused", False)),
            "frozen_ms": int(st.get("frozenUs", 0)) / 1000.0,
            "reclaim_ms": int(st.get("reclaimMs", 0)),
            "resident_bytes": int(st.get("residentBytes", 0)),
            "released_bytes": int(st.get("releasedBytes", 0)),
            "swapped_bytes": int(st.get("swappedBytes", 0)),
            "kept_bytes": int(st.get("keptBytes", 0)),
            "kept_anon_bytes": int(st.get("keptAnonBytes", 0)),
            "kept_shmem_bytes": int(st.get("keptShmemBytes", 0)),
            "kept_cache_bytes": int(st.get("keptCacheBytes", 0)),
            "kept_kernel_bytes": int(st.get("keptKernelBytes", 0)),
            "kept_reason": st.get("keptReason", ""),
        }

    async def resume(self, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Bring a paused sandbox's memory back and let it run. Returns
        already_running and prefetch_ms."""
        resp = await self.client._call("Resume", {"sandboxId": self.id}, timeout, idempotent=True)
        self.info = resp.get("sandbox", self.info)
        return {"already_running": bool(resp.get("alreadyRunning", False)),
                "prefetch_ms": int(resp.get("prefetchMs", 0))}

    @property
    def phase(self) -> Optional[str]:
        """The phase ("setup", "agent", "verify") as last read; None without phase budgets."""
        return _phase_name(self.info.get("phase"))

    async def end_phase(self, phase: str, *, timeout: Optional[float] = None) -> None:
        """End the sandbox's "setup" or "agent" phase now, as its budget running
        out would; the agent phase's end kills every process in the sandbox. A
        phase already over is left alone."""
        if phase not in ("setup", "agent"):
            raise errors.InvalidArgument(f"phase {phase!r}: want 'setup' or 'agent'")
        resp = await self.client._call("EndPhase", {"sandboxId": self.id, "phase": "PHASE_" + phase.upper()},
                                       timeout, idempotent=True)
        self.info = resp.get("sandbox", self.info)

    async def set_timeout(self, seconds: float, *, extend_only: bool = False,
                          timeout: Optional[float] = None) -> None:
        """End the sandbox's TTL ``seconds`` from now, later or sooner (0
        ends it); with extend_only an end further away stays. A paused
        sandbox gets that much running time once resumed."""
        msg: Dict[str, Any] = {"sandboxId": self.id, "timeoutSeconds": str(int(seconds))}
        if extend_only:
            msg["extendOnly"] = True
        resp = await self.client._call("SetTimeout", msg, timeout, idempotent=True)
        self.info = resp.get("sandbox", self.info)

    async def metrics(self, *, since: When = None, timeout: Optional[float] = None) -> Dict[str, Any]:
        """The sandbox's resource use now, as a dict of SandboxMetrics:
        cpuUsedPct (percent of cpuCount cores), memoryUsedBytes,
        memoryLimitBytes, memoryCacheBytes, diskUsedBytes, diskLimitBytes
        (int64 fields as strings, as proto3 JSON has them). With since (a
        datetime or seconds since the epoch), also its use over time:
        "samples", the samples its node took after since, oldest first
        (one each dsecd --ledger-interval, the last 10 minutes at most),
        each with timeUnixMs, cpuUsedCores (CPU used since the sample
        before, in cores), cpuUsedUsec, memoryUsedBytes, memoryLimitBytes,
        diskUsedBytes and netEgressBytes."""
        msg: Dict[str, Any] = {"sandboxId": self.id}
        if since is not None:
            msg["sinceUnixMs"] = str(max(_ms(since), 1))
        resp = await self.client._call("Metrics", msg, timeout, idempotent=True)
        if since is not None:
            resp.setdefault("samples", [])
        return resp

    async def snapshot(self, name: str, *, exclude: Optional[Iterable[str]] = None,
                       project: Optional[str] = None,
                       timeout: Optional[float] = 600) -> Dict[str, Any]:
        """Pack the sandbox's file system into layer snap:NAME (the paper's
        pack_diff). The sandbox stands still only while its writable layer
        is captured; exclude leaves out its changes under those paths.
        Returns the SnapshotInfo as a dict; its "environment" restores it:
        client.create(info["environment"]). It belongs to project (a path;
        default the token's), on which the token holds builder, and its
        bytes are charged to that project's quota (snapshot_bytes)."""
        msg: Dict[str, Any] = {"sandboxId": self.id, "name": name}
        if exclude:
            msg["exclude"] = list(exclude)
        if project:
            msg["project"] = project
        return await self.client._call("Snapshot", msg, timeout)

    async def grade(self, paths: Iterable[str], *, command: Optional[Command] = None,
                    tests: Optional[Mapping[str, Data]] = None, tests_layer: Optional[str] = None,
                    tests_paths: Optional[Iterable[str]] = None, user: Optional[str] = None,
                    cwd: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
                    grader_timeout: Optional[float] = None, output_limit: Optional[int] = None,
                    cpus: Optional[float] = None, memory_mb: Optional[int] = None, keep: bool = False,
                    isolation: Optional[str] = None, timeout: Optional[float] = 1800) -> GradeResult:
        """Grade this sandbox in a clean room (docs/grading.md): capture
        only paths, start a fresh sandbox from its layers, that capture and
        the trusted tests on top (tests: {path: content} written by root;
        tests_layer: a layer stacked above; tests_paths: what they own, the
        sandbox's version left out whole; each tests path is added), with no
        network and none of its processes, run the grader (command: a shell
        line or an argv) as nobody unless user, and return its GradeResult.
        isolation is the clean room's (container, gvisor, microvm; None =
        the sandbox's own).
        An error means no grade happened (the platform failed): mask the
        rollout rather than score it 0. Not sent again on a broken
        connection."""
        if command is None:
            raise errors.InvalidArgument("grade needs the grader's command")
        msg: Dict[str, Any] = {"sandboxId": self.id, "paths": [str(p) for p in paths], "keep": bool(keep)}
        if isinstance(command, str):
            msg["command"] = command
        else:
            msg["argv"] = [str(a) for a in command]
        t: Dict[str, Any] = {}
        if tests:
            t["files"] = {p: base64.b64encode(_bytes(d)).decode() for p, d in tests.items()}
        if tests_layer:
            t["layer"] = tests_layer
        if tests_paths:
            t["paths"] = [str(p) for p in tests_paths]
        if t:
            msg["tests"] = t
        for k, v in (("user", user), ("cwd", cwd)):
            if v:
                msg[k] = v
        if env:
            msg["env"] = dict(env)
        if grader_timeout:
            msg["timeoutSeconds"] = float(grader_timeout)
        if output_limit:
            msg["outputLimitBytes"] = int(output_limit)
        if cpus:
            msg["cpus"] = float(cpus)
        if memory_mb:
            msg["memoryMb"] = int(memory_mb)
        if isolation not in (None, "") + ISOLATIONS:
            raise errors.InvalidArgument(f"isolation {isolation!r} is not known ({', '.join(ISOLATIONS)})")
        if isolation:
            msg["isolation"] = "ISOLATION_" + isolation.upper()
        return GradeResult._from(await self.client._call("Grade", msg, timeout))

    async def fork(self, n: int, *, exclude: Optional[Iterable[str]] = None, name: Optional[str] = None,
                   idempotency_key: Optional[str] = None,
                   timeout: Optional[float] = 600) -> List[Union["Sandbox", errors.DsecError]]:
        """One snapshot, then n (at most 16) new sandboxes from it with this
        sandbox's spec: one result per child, a Sandbox or the error that
        kept it from being made. A file-system fork: the children start
        fresh processes; of a microVM a memory fork, the children go on from
        its running state on its node, each with its own identity (exclude
        is refused). idempotency_key makes a microVM's fork safe to send
        again: a repeat with the same key gets the children the first made,
        and makes no more (the call is then retried after a dropped
        connection, as a create is); a file-system fork refuses one."""
        msg: Dict[str, Any] = {"sandboxId": self.id, "count": int(n)}
        if exclude:
            msg["exclude"] = list(exclude)
        if name:
            msg["name"] = name
        if idempotency_key:
            msg["idempotencyKey"] = idempotency_key
        resp = await self.client._call("Fork", msg, timeout, idempotent=bool(idempotency_key))
        out: List[Union["Sandbox", errors.DsecError]] = []
        for c in resp.get("children", []):
            if c.get("error"):
                out.append(errors.DsecError(c["error"]))
            else:
                out.append(Sandbox(self.client, c.get("sandbox", {})))
        return out

    @property
    def pause_releases(self) -> str:
        """What a pause can release on the sandbox's node, in words (from the last refresh())."""
        return self.info.get("pauseReleases", "")

    # --- commands ---

    def _exec_msg(self, cmd: Command, timeout, cwd, env, user, stdin,
                  shell=None) -> Tuple[Dict[str, Any], Optional[_StdinFeed]]:
        """The Exec request, and the feed for a stdin too large to carry."""
        msg: Dict[str, Any] = {"sandboxId": self.id}
        if isinstance(cmd, str):
            msg["command"] = cmd
            if shell:
                msg["shell"] = shell
        else:
            msg["argv"] = [str(a) for a in cmd]
            if not msg["argv"]:
                raise errors.InvalidArgument("argv is empty")
        if timeout:
            msg["timeoutSeconds"] = float(timeout)
        if cwd:
            msg["cwd"] = cwd
        if env:
            msg["env"] = {str(k): str(v) for k, v in env.items()}
        if user:
            msg["user"] = user
        feed = None
        if stdin is not None:
            data = _bytes(stdin)
            if len(data) > STDIN_INLINE:
                feed = _StdinFeed(self, data)
                msg["keepStdinOpen"] = True
            else:
                msg["stdin"] = _b64(data)
        return msg, feed

    @staticmethod
    def _deadline(timeout: Optional[float]) -> Optional[float]:
        return None if not timeout else timeout + EXEC_GRACE

    async def exec(self, cmd: Command, *, timeout: Optional[float] = None, cwd: Optional[str] = None,
                   env: Optional[Mapping[str, str]] = None, user: Optional[str] = None,
                   stdin: Optional[Data] = None, check: bool = False, shell: Optional[str] = None,
                   on_stdout: Optional[Callable[[bytes], Any]] = None,
                   on_stderr: Optional[Callable[[bytes], Any]] = None) -> ExecResult:
        """Run cmd (a str runs under a shell, a list is argv) and wait for it.

        timeout (seconds) is enforced inside the sandbox: the whole process
        tree is killed and status is "timeout". A non-zero exit is a result,
        not an error, unless check=True (then CommandFailed). on_stdout and
        on_stderr are called with each chunk of output as it arrives. stdin
        over 1 MiB is streamed once the command has started.
        """
        msg, feed = self._exec_msg(cmd, timeout, cwd, env, user, stdin, shell)
        stream = await self.client._t.stream(SANDBOX, "Exec", msg, timeout=self._deadline(timeout))
        col = _Collector(on_stdout, on_stderr)
        if feed:
            col.on_started = feed.start
        try:
            res = await _drive(stream, col, "Exec")
        finally:
            if feed:
                await feed.stop()
        if check and res.status != "ok":
            raise errors.CommandFailed(res)
        return _whole(res)

    async def exec_stream(self, cmd: Command, *, timeout: Optional[float] = None, cwd: Optional[str] = None,
                          env: Optional[Mapping[str, str]] = None, user: Optional[str] = None,
                          stdin: Optional[Data] = None, shell: Optional[str] = None) -> AsyncIterator[ExecEvent]:
        """Run cmd and yield its events: started, stdout/stderr chunks, exited.

        Every byte the command writes comes, however much: a reader slower
        than the command slows it. Leaving the loop early cancels the call,
        which kills the command. Should the stream lack output (it never
        does for a command it follows from its start), OutputDropped is
        raised after the exited event.
        """
        msg, feed = self._exec_msg(cmd, timeout, cwd, env, user, stdin, shell)
        stream = await self.client._t.stream(SANDBOX, "Exec", msg, timeout=self._deadline(timeout))
        col = _Collector()
        if feed:
            col.on_started = feed.start
        try:
            async for ev in stream:
                out = col.feed(ev)
                if out is not None:
                    yield out
                if col.result is not None:
                    _whole(col.result)
                    return
            raise errors.Unavailable("Exec: the stream ended before the command exited")
        finally:
            stream.close()
            if feed:
                await feed.stop()

    async def spawn(self, cmd: Command, *, tag: Optional[str] = None, cwd: Optional[str] = None,
                    env: Optional[Mapping[str, str]] = None, user: Optional[str] = None,
                    stdin: Optional[Data] = None, timeout: Optional[float] = None,
                    shell: Optional[str] = None, start_timeout: Optional[float] = None) -> "Job":
        """Start cmd in the background and return once it runs.

        The process keeps running when this connection goes away; Job.wait()
        and Job.output() reattach to it. timeout, if set, limits the command.
        Its stdin stays open for Job.write_stdin until written with close=True.
        """
        msg, feed = self._exec_msg(cmd, timeout, cwd, env, user, stdin, shell)
        msg["background"] = True
        msg["keepStdinOpen"] = True
        if tag:
            msg["tag"] = tag
        stream = await self.client._t.stream(SANDBOX, "Exec", msg, timeout=self.client._to(start_timeout))
        col = _Collector()
        try:
            async for ev in stream:
                col.feed(ev)
                if col.process_id or col.result is not None:
                    break
        finally:
            stream.close()
        if not col.process_id:
            raise errors.Unavailable("Exec: the stream ended before the process started")
        job = Job(self, col.process_id, col.pid, col.tag or (tag or ""))
        if feed:
            # The request carried none of it; the process's stdin stays open.
            await job.write_stdin(feed.data)
        return job

    def job(self, process_id: str = "", *, tag: str = "") -> "Job":
        """A handle on a background process by process_id or tag."""
        return Job(self, process_id, 0, tag)

    async def processes(self, *, timeout: Optional[float] = None) -> List[ProcessInfo]:
        resp = await self.client._call("ListProcesses", {"sandboxId": self.id}, timeout, idempotent=True)
        out = []
        for p in resp.get("processes", []):
            res = None
            if p.get("exited") is not None:
                col = _Collector()
                col.process_id = p.get("processId", "")
                col.feed({"exited": p["exited"]})
                res = col.result
            out.append(ProcessInfo(process_id=p.get("processId", ""), pid=int(p.get("pid", 0)),
                                   tag=p.get("tag", ""), argv=list(p.get("argv", [])),
                                   running=bool(p.get("running")), result=res))
        return out

    def session(self, name: str = "default", *, shell: Optional[str] = None,
                user: Optional[str] = None) -> "Session":
        """A named shell session: cwd and exported variables persist between runs."""
        return Session(self, name, shell, user)

    # --- files ---

    def _fmsg(self, path: str, user: Optional[str], **extra) -> Dict[str, Any]:
        msg: Dict[str, Any] = {"sandboxId": self.id, "path": path}
        if user:
            msg["user"] = user
        for k, v in extra.items():
            if v:
                msg[k] = v
        return msg

    async def read_file(self, path: str, *, user: Optional[str] = None,
                        timeout: Optional[float] = None) -> bytes:
        """The whole content of a file (read in pieces of up to 64 MiB)."""
        parts: List[bytes] = []
        offset = 0
        while True:
            msg = self._fmsg(path, user, offset=str(offset) if offset else None)
            resp = await self.client._call("ReadFile", msg, timeout, idempotent=True)
            data = _unb64(resp.get("data"))
            parts.append(data)
            offset += len(data)
            if not resp.get("truncated") or not data:
                return b"".join(parts)

    async def write_file(self, path: str, data: Data, *, mode: int = 0o644, append: bool = False,
                         make_parents: bool = True, user: Optional[str] = None,
                         timeout: Optional[float] = None) -> int:
        """Write (or append) data to a file; returns the bytes written."""
        msg = self._fmsg(path, user, data=_b64(data), mode=mode, append=append, makeParents=make_parents)
        resp = await self.client._call("WriteFile", msg, timeout)
        return int(resp.get("written", 0))

    async def list_dir(self, path: str, *, user: Optional[str] = None,
                       timeout: Optional[float] = None) -> List[FileInfo]:
        resp = await self.client._call("ListDir", self._fmsg(path, user), timeout, idempotent=True)
        return [FileInfo.from_json(e) for e in resp.get("entries", [])]

    async def stat(self, path: str, *, user: Optional[str] = None,
                   timeout: Optional[float] = None) -> FileInfo:
        resp = await self.client._call("Stat", self._fmsg(path, user), timeout, idempotent=True)
        return FileInfo.from_json(resp.get("info") or {})

    async def exists(self, path: str, *, user: Optional[str] = None, timeout: Optional[float] = None) -> bool:
        try:
            await self.stat(path, user=user, timeout=timeout)
            return True
        except errors.NotFound:
            return False

    async def remove(self, path: str, *, recursive: bool = False, user: Optional[str] = None,
                     timeout: Optional[float] = None) -> None:
        await self.client._call("Remove", self._fmsg(path, user, recursive=recursive), timeout, idempotent=True)

    async def mkdir(self, path: str, *, parents: bool = True, mode: int = 0o755, user: Optional[str] = None,
                    timeout: Optional[float] = None) -> None:
        await self.client._call("MakeDir", self._fmsg(path, user, parents=parents, mode=mode), timeout,
                                idempotent=True)

    async def upload(self, local_path: str, path: str, *, user: Optional[str] = None,
                     timeout: Optional[float] = 300.0) -> int:
        """Copy a local directory's content (or one file) into directory path; returns files written."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            if os.path.isdir(local_path):
                for name in sorted(os.listdir(local_path)):
                    tf.add(os.path.join(local_path, name), arcname=name)
            else:
                tf.add(local_path, arcname=os.path.basename(local_path))
        msg = self._fmsg(path, user, tar=_b64(buf.getvalue()))
        resp = await self.client._call("Upload", msg, timeout)
        return int(resp.get("files", 0))

    async def upload_bytes(self, files: Mapping[str, Data], path: str, *, user: Optional[str] = None,
                           timeout: Optional[float] = 300.0) -> int:
        """Write several files (relative name -> content) under directory path in one call."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            for name, data in files.items():
                b = data.encode() if isinstance(data, str) else bytes(data)
                ti = tarfile.TarInfo(name)
                ti.size, ti.mode = len(b), 0o644
                tf.addfile(ti, io.BytesIO(b))
        resp = await self.client._call("Upload", self._fmsg(path, user, tar=_b64(buf.getvalue())), timeout)
        return int(resp.get("files", 0))

    async def download_tar(self, path: str, *, user: Optional[str] = None,
                           timeout: Optional[float] = 300.0) -> bytes:
        """path (file or directory) as an uncompressed tar archive."""
        stream = await self.client._t.stream(SANDBOX, "Download", self._fmsg(path, user),
                                             timeout=self.client._to(timeout), idempotent=True)
        parts = []
        try:
            async for chunk in stream:
                parts.append(_unb64(chunk.get("data")))
        finally:
            stream.close()
        return b"".join(parts)

    async def download(self, path: str, local_dir: str, *, user: Optional[str] = None,
                       timeout: Optional[float] = 300.0) -> List[str]:
        """Copy path (file or directory) into local_dir; returns the names extracted.

        Entries that would land outside local_dir, and device files, are refused.
        """
        data = await self.download_tar(path, user=user, timeout=timeout)
        return extract_tar(data, local_dir)


def extract_tar(data: bytes, dest: str) -> List[str]:
    """Extract a tar archive into dest, refusing anything that escapes it."""
    os.makedirs(dest, exist_ok=True)
    root = os.path.realpath(dest)
    names = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
        members = tf.getmembers()
        for m in members:
            target = os.path.realpath(os.path.join(root, m.name))
            if target != root and not target.startswith(root + os.sep):
                raise errors.InvalidArgument(f"tar entry {m.name!r} leaves the destination")
            if m.isdev():
                raise errors.InvalidArgument(f"tar entry {m.name!r} is a device")
            if m.issym() or m.islnk():
                link = m.linkname if m.issym() else os.path.join(root, m.linkname)
                base = os.path.dirname(target) if m.issym() else root
                lt = os.path.realpath(os.path.join(base, link))
                if lt != root and not lt.startswith(root + os.sep):
                    raise errors.InvalidArgument(f"tar link {m.name!r} -> {m.linkname!r} leaves the destination")
            names.append(m.name)
        if hasattr(tarfile, "data_filter"):
            tf.extractall(root, members=members, filter="data")
        else:  # pragma: no cover - Python without extraction filters
            for m in members:
                m.mode &= 0o777
            tf.extractall(root, members=members)
    return names


class Job:
    """A background process in a sandbox (see Sandbox.spawn)."""

    def __init__(self, sandbox: Sandbox, process_id: str, pid: int, tag: str):
        self.sandbox = sandbox
        self.process_id = process_id
        self.pid = pid
        self.tag = tag

    def __repr__(self) -> str:
        return f"<Job {self.process_id or self.tag} pid={self.pid}>"

    def _ref(self) -> Dict[str, Any]:
        msg: Dict[str, Any] = {"sandboxId": self.sandbox.id}
        if self.process_id:
            msg["processId"] = self.process_id
        else:
            msg["tag"] = self.tag
        return msg

    async def wait(self, timeout: Optional[float] = None) -> ExecResult:
        """Wait for the process to exit; returns its result with its output.

        The output is what the node kept (the first 16 MiB of each stream)
        and all the process wrote from the moment this follows it; should
        some have been dropped in between, OutputDropped is raised with the
        result. A broken connection is retried (Attach replays from the
        start), so a daemon restart does not lose the result. Raises Timeout
        after timeout.
        """
        from ._transport import Deadline
        deadline = Deadline(timeout)
        attempt = 0
        while True:
            try:
                stream = await self.sandbox.client._t.stream(SANDBOX, "Attach", self._ref(),
                                                             timeout=deadline.remaining(), idempotent=True)
                res = await _drive(stream, _Collector(), "Attach")
            except errors.Unavailable:
                attempt += 1
                rem = deadline.remaining()
                if attempt > 8 or (rem is not None and rem < 0.5):
                    raise
                await asyncio.sleep(min(2.0, 0.1 * 2 ** attempt))
                continue
            return _whole(res)

    async def output(self, *, timeout: Optional[float] = None) -> ExecResult:
        """The output retained so far, at once: the process may still run.

        The result's status is "running" (exit_code -1) while it runs; once
        it has exited, its result as wait() gives it. Output the node dropped
        raises OutputDropped with the result.
        """
        msg = self._ref()
        msg["noFollow"] = True
        stream = await self.sandbox.client._t.stream(SANDBOX, "Attach", msg,
                                                     timeout=self.sandbox.client._to(timeout), idempotent=True)
        col = _Collector()
        try:
            async for ev in stream:
                col.feed(ev)
        finally:
            stream.close()
        if col.process_id:
            self.process_id, self.pid = col.process_id, col.pid or self.pid
        if col.result is not None:
            return _whole(col.result)
        res = col.partial(exit_code=-1, status="running")
        res.process_id, res.pid = self.process_id, self.pid
        return _whole(res)

    async def running(self, *, timeout: Optional[float] = None) -> bool:
        for p in await self.sandbox.processes(timeout=timeout):
            if p.process_id == self.process_id or (not self.process_id and p.tag == self.tag):
                return p.running
        return False

    async def kill(self, signal: int = 0, *, timeout: Optional[float] = None) -> None:
        """Send signal to the process; 0 (the default) kills its whole tree."""
        if not self.process_id:
            await self.output(timeout=timeout)
        msg = {"sandboxId": self.sandbox.id, "processId": self.process_id}
        if signal:
            msg["signal"] = int(signal)
        await self.sandbox.client._call("Signal", msg, timeout)

    async def write_stdin(self, data: Data, *, close: bool = False, timeout: Optional[float] = None) -> None:
        """Write data to the process's stdin (in calls of at most 1 MiB), then close it if asked."""
        data = _bytes(data)
        off = 0
        while True:
            chunk = data[off:off + STDIN_CHUNK]
            off += len(chunk)
            last = off >= len(data)
            msg: Dict[str, Any] = {"sandboxId": self.sandbox.id, "processId": self.process_id,
                                   "data": _b64(chunk)}
            if close and last:
                msg["close"] = True
            await self.sandbox.client._call("WriteStdin", msg, timeout)
            if last:
                return


class Session:
    """A named, stateful shell session in a sandbox."""

    def __init__(self, sandbox: Sandbox, name: str, shell: Optional[str], user: Optional[str]):
        self.sandbox = sandbox
        self.name = name
        self.shell = shell
        self.user = user

    async def __aenter__(self) -> "Session":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def run(self, cmd: str, *, timeout: Optional[float] = None, stdin: Optional[Data] = None,
                  check: bool = False) -> ExecResult:
        """Run cmd in the session's shell; its cwd and exports stay for the next run."""
        msg: Dict[str, Any] = {"sandboxId": self.sandbox.id, "session": self.name, "command": cmd}
        if timeout:
            msg["timeoutSeconds"] = float(timeout)
        if stdin is not None:
            msg["stdin"] = _b64(stdin)
        if self.shell:
            msg["shell"] = self.shell
        if self.user:
            msg["user"] = self.user
        stream = await self.sandbox.client._t.stream(SANDBOX, "SessionRun", msg,
                                                     timeout=Sandbox._deadline(timeout))
        res = await _drive(stream, _Collector(), "SessionRun")
        if check and res.status != "ok":
            raise errors.CommandFailed(res)
        return _whole(res)

    async def interrupt(self, *, timeout: Optional[float] = None) -> None:
        """Send SIGINT to the command running in the session."""
        await self.sandbox.client._call("SessionInterrupt", {"sandboxId": self.sandbox.id, "session": self.name},
                                        timeout)

    async def close(self, *, timeout: Optional[float] = None) -> None:
        await self.sandbox.client._call("SessionClose", {"sandboxId": self.sandbox.id, "session": self.name},
                                        timeout)


PROVENANCE_FLAGS = ("files_outside_workspace", "tests_modified", "interpreter_replaced", "protected_read",
                    "network_allowed", "network_denied", "leftover_processes", "packages_installed",
                    "syscalls_denied")


def _provenance_paths(p: Mapping[str, Sequence[str]]) -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {}
    for k in p:
        if k not in ("workspace", "tests", "protected"):
            raise errors.InvalidArgument(f"provenance key {k!r}: want workspace, tests or protected")
        if isinstance(p[k], str):
            raise errors.InvalidArgument(f"provenance {k}: a list of paths, not a string")
        if p[k]:
            out[k] = [str(x) for x in p[k]]
    return out


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


def _snake_dict(d: Any) -> Any:
    if isinstance(d, dict):
        return {_snake(k): _snake_dict(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_snake_dict(v) for v in d]
    return d


def _provenance(resp: Dict[str, Any]) -> Dict[str, Any]:
    out = _snake_dict(resp)
    flags = {f: bool(out.get("flags", {}).get(f, False)) for f in PROVENANCE_FLAGS}
    out["flags"] = flags
    out["flags_set"] = [f for f in PROVENANCE_FLAGS if flags[f]]
    for k in ("files_written", "replaced", "tests_changed", "protected_reads", "network", "processes",
              "packages", "syscalls_denied", "syscall_samples", "unseen"):
        out.setdefault(k, [])
    for k in ("files_written_total", "syscall_samples_dropped", "syscall_records_lost"):
        out[k] = int(out.get(k, 0))
    for s in out["syscalls_denied"] + out["syscall_samples"]:
        for k in ("count", "time_unix_ms"):
            s[k] = int(s.get(k, 0))
    return out
