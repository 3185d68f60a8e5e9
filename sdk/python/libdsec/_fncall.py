"""FnCall's types and their wire form: RunCode, RunResult, CommandResult, Language.

FnCallService runs short programs (reward code, test cases) in pooled warm
containers (docs/fncall.md). The client methods that use these live on
AsyncClient (run_code, run_code_batch, run_tests, languages).
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import errors

FNCALL = "dsec.v1.FnCallService"

# The runner's defaults for a step's timeout (RunCodeRequest: 0 = 10 s).
DEFAULT_STEP_TIMEOUT = 10.0
# Beyond a call's own compile and run timeouts, for its wait in the node's
# queue and for its answer to arrive.
CALL_GRACE = 30.0
# Beyond the longest call of a batch: its calls wait for the node's pools.
BATCH_GRACE = 600.0
# The most calls an apiserver takes in one RunCodeBatch; longer batches are
# sent as several, at once.
MAX_BATCH = 4096

Data = Union[bytes, bytearray, memoryview, str]

_RUN_STATUS = {"RUN_STATUS_SUCCESS": "success", "RUN_STATUS_FAILED": "failed",
               "RUN_STATUS_SANDBOX_ERROR": "sandbox_error"}
_COMMAND_STATUS = {"COMMAND_STATUS_FINISHED": "finished", "COMMAND_STATUS_ERROR": "error",
                   "COMMAND_STATUS_TIME_LIMIT_EXCEEDED": "time_limit_exceeded"}


def _bytes(data: Data) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


def _b64(data: Data) -> str:
    return base64.b64encode(_bytes(data)).decode("ascii")


def _unb64(s: Optional[str]) -> bytes:
    if not s:
        return b""
    s = s.replace("-", "+").replace("_", "/")
    return base64.b64decode(s + "=" * (-len(s) % 4))


def _text(b: bytes) -> str:
    return b.decode("utf-8", errors="replace")


@dataclass
class CommandResult:
    """One step (compile or run) of a call.

    status is "finished" (it exited, whatever its code, or was killed),
    "error" (it could not be started) or "time_limit_exceeded" (killed at
    its timeout; the output so far is kept). return_code is None after a
    timeout and the negative signal number when the step was killed.
    stdout/stderr are text decoded as UTF-8 with errors="replace";
    stdout_bytes/stderr_bytes are the raw bytes (each capped at 1 MiB).
    """
    status: str
    return_code: Optional[int] = None
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    execution_time: float = 0.0      # wall seconds
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    memory_limit_exceeded: bool = False  # the call's memory cgroup OOM-killed it

    @property
    def stdout(self) -> str:
        return _text(self.stdout_bytes)

    @property
    def stderr(self) -> str:
        return _text(self.stderr_bytes)

    @property
    def truncated(self) -> bool:
        return self.stdout_truncated or self.stderr_truncated

    @staticmethod
    def from_json(d: Optional[Mapping[str, Any]]) -> Optional["CommandResult"]:
        if d is None:
            return None
        rc = d.get("returnCode")
        return CommandResult(
            status=_COMMAND_STATUS.get(d.get("status", ""), d.get("status", "").lower()),
            return_code=None if rc is None else int(rc),
            stdout_bytes=_unb64(d.get("stdout")), stderr_bytes=_unb64(d.get("stderr")),
            execution_time=float(d.get("executionTimeSeconds", 0.0)),
            stdout_truncated=bool(d.get("stdoutTruncated")), stderr_truncated=bool(d.get("stderrTruncated")),
            memory_limit_exceeded=bool(d.get("memoryLimitExceeded")))


@dataclass
class RunResult:
    """What one call did. A program that fails is a result, not an error.

    status is "success" (every step exited 0), "failed" (a step exited
    non-zero, was killed or timed out) or "sandbox_error" (the call could not
    be run as asked; message says why). compile is None for interpreted
    languages, run is None when the compile step failed. files holds the
    fetch_files that existed, by the path asked for. passed is set by
    run_tests for a case with an expected output, else None. infra_fault is
    the platform's fault when the call could not be run for the platform's
    sake (status "sandbox_error"), None when its code or request decided it.
    """
    status: str
    message: str = ""
    compile: Optional[CommandResult] = None
    run: Optional[CommandResult] = None
    files: Dict[str, bytes] = field(default_factory=dict)
    node: str = ""
    container: str = ""
    passed: Optional[bool] = None
    infra_fault: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.status == "success"

    @property
    def stdout(self) -> str:
        """The run step's stdout as text; "" without a run step."""
        return self.run.stdout if self.run else ""

    @property
    def stderr(self) -> str:
        """The run step's stderr as text; "" without a run step."""
        return self.run.stderr if self.run else ""

    @property
    def return_code(self) -> Optional[int]:
        """The run step's return code; None without one (a failed compile, a timeout)."""
        return self.run.return_code if self.run else None

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "RunResult":
        return RunResult(
            status=_RUN_STATUS.get(d.get("status", ""), (d.get("status") or "sandbox_error").lower()),
            message=d.get("message", ""),
            compile=CommandResult.from_json(d.get("compileResult")),
            run=CommandResult.from_json(d.get("runResult")),
            files={k: _unb64(v) for k, v in (d.get("files") or {}).items()},
            node=d.get("node", ""), container=d.get("container", ""),
            infra_fault=errors.fault_of_enum(d.get("fault")))


@dataclass
class RunCode:
    """One call of run_code_batch; the fields are run_code's arguments."""
    language: str
    code: str
    stdin: Optional[Data] = None
    files: Optional[Mapping[str, Data]] = None
    fetch_files: Optional[Sequence[str]] = None
    compile_timeout: Optional[float] = None
    run_timeout: Optional[float] = None
    memory_mb: Optional[int] = None
    cpus: Optional[float] = None
    network_rules: Optional[Mapping[str, bool]] = None
    environment: Optional[str] = None

    def request(self) -> Dict[str, Any]:
        """The RunCodeRequest message as sent."""
        if not self.language:
            raise errors.InvalidArgument("run code: language is required (see languages())")
        if not isinstance(self.code, str):
            raise errors.InvalidArgument(f"run code: code must be a str, not {type(self.code).__name__}")
        msg: Dict[str, Any] = {"language": self.language, "code": self.code}
        if self.stdin is not None and len(self.stdin):
            msg["stdin"] = _b64(self.stdin)
        if self.files:
            msg["files"] = {str(k): _b64(v) for k, v in self.files.items()}
        if self.fetch_files:
            if isinstance(self.fetch_files, str):
                raise errors.InvalidArgument("run code: fetch_files is a list of paths, not one str")
            msg["fetchFiles"] = [str(p) for p in self.fetch_files]
        for k, v in (("compileTimeoutSeconds", self.compile_timeout), ("runTimeoutSeconds", self.run_timeout)):
            if v is not None:
                if v < 0 or not math.isfinite(v):
                    raise errors.InvalidArgument(f"run code: {k} {v!r}: want a number of seconds >= 0")
                if v:
                    msg[k] = float(v)
        if self.memory_mb:
            msg["memoryMb"] = str(int(self.memory_mb))
        if self.cpus:
            msg["cpus"] = float(self.cpus)
        if self.network_rules:
            from ._aio import _rules  # the SDK's one check of rule values
            msg["networkRules"] = _rules(self.network_rules)
        if self.environment:
            msg["environment"] = self.environment
        return msg

    def deadline(self) -> float:
        """How long a client waits for this call by default: its steps' timeouts plus CALL_GRACE."""
        return (self.compile_timeout or DEFAULT_STEP_TIMEOUT) + (self.run_timeout or DEFAULT_STEP_TIMEOUT) + CALL_GRACE

    @property
    def repeatable(self) -> bool:
        """A call may be sent again after an Unavailable answer: it leaves
        nothing behind, unless its network rules let it reach out."""
        return not self.network_rules

    @staticmethod
    def of(call: Union["RunCode", Mapping[str, Any]]) -> "RunCode":
        if isinstance(call, RunCode):
            return call
        if not isinstance(call, Mapping):
            raise errors.InvalidArgument(f"run code batch: a call is a RunCode or a dict, not {type(call).__name__}")
        known = {f.name for f in fields(RunCode)}
        unknown = sorted(set(call) - known)
        if unknown:
            raise errors.InvalidArgument(f"run code batch: unknown field(s) {', '.join(unknown)} "
                                         f"(known: {', '.join(sorted(known))})")
        try:
            return RunCode(**call)
        except TypeError as e:
            raise errors.InvalidArgument(f"run code batch: {e}") from None


@dataclass
class Language:
    """A language the runner knows (ListLanguages)."""
    name: str
    environment: str = ""
    compiled: bool = False
    source_file: str = ""
    compile_argv: List[str] = field(default_factory=list)
    run_argv: List[str] = field(default_factory=list)
    zygote: bool = False  # served by a warm interpreter

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "Language":
        return Language(name=d.get("name", ""), environment=d.get("environment", ""),
                        compiled=bool(d.get("compiled")), source_file=d.get("sourceFile", ""),
                        compile_argv=list(d.get("compileArgv") or []), run_argv=list(d.get("runArgv") or []),
                        zygote=bool(d.get("zygote")))


Case = Union[Data, Tuple[Data, Data], List[Data]]


def split_cases(cases: Sequence[Case]) -> Tuple[List[Data], List[Optional[str]]]:
    """run_tests' cases as stdins and expected outputs (None: not compared)."""
    if isinstance(cases, (str, bytes)):
        raise errors.InvalidArgument("run tests: cases is a list of stdins or (stdin, expected) pairs, not one str")
    stdins: List[Data] = []
    expected: List[Optional[str]] = []
    for i, c in enumerate(cases):
        if isinstance(c, (tuple, list)):
            if len(c) != 2:
                raise errors.InvalidArgument(f"run tests: case {i} has {len(c)} items, want (stdin, expected_stdout)")
            stdin, want = c
            if want is not None and not isinstance(want, str):
                want = _text(_bytes(want))
            stdins.append(stdin if stdin is not None else b"")
            expected.append(want)
        elif c is None or isinstance(c, (str, bytes, bytearray, memoryview)):
            stdins.append(c if c is not None else b"")
            expected.append(None)
        else:
            raise errors.InvalidArgument(f"run tests: case {i} is a {type(c).__name__}, want a stdin or a pair")
    return stdins, expected


def passed(r: RunResult, expected: str) -> bool:
    """Whether r passes a case as verl judges one: the call succeeded and
    its stdout equals expected once trailing newlines are cut from both."""
    return r.ok and r.stdout.rstrip("\n") == expected.rstrip("\n")
