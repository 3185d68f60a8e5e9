"""Typed errors raised by libdsec.

Every error the SDK raises is a :class:`DsecError`. The subclasses say what
happened, so callers can catch what they can handle::

    try:
        await sb.exec("make test", timeout=600)
    except libdsec.errors.SandboxGone as e:
        print("sandbox ended:", e.reason)      # "oom", "ttl", "idle", ...
    except libdsec.errors.Timeout:
        ...

``code`` is the Connect error code the daemon answered with ("not_found",
"unavailable", ...), or "unavailable" / "deadline_exceeded" for failures of
the connection itself.

``infra_fault`` says whether the platform, not the caller or the task, caused
the error, and how: "node_lost", "edge_unreachable", "preempted",
"admission_refused", "start_timeout", "node_memory_pressure", "sandbox_ttl",
"sandbox_deleted" or "agent_lost"; None for the caller's own errors. A trainer
masks such a rollout rather than scoring it 0 (docs/outcomes.md)::

    try:
        r = await sb.exec("pytest -q", timeout=600)
    except libdsec.DsecError as e:
        if e.infra_fault:
            return None          # masked: the platform ended it
        raise
"""

from __future__ import annotations

import re
from typing import Any, Optional

__all__ = [
    "DsecError", "NotFound", "AlreadyExists", "SandboxGone", "FailedPrecondition",
    "Overloaded", "StartupTimeout", "InvalidArgument", "Unauthenticated",
    "PermissionDenied", "Unavailable", "Timeout", "NotSupported", "Cancelled",
    "Internal", "CommandFailed", "OutputDropped", "from_code", "INFRA_FAULTS", "fault_of_reason",
]

# Every platform fault, as the API's Fault enum names them (lower case,
# without FAULT_).
INFRA_FAULTS = ("node_lost", "edge_unreachable", "preempted", "admission_refused", "start_timeout",
                "node_memory_pressure", "sandbox_ttl", "sandbox_deleted", "agent_lost")


def fault_of_reason(reason: str) -> Optional[str]:
    """The fault of a call whose sandbox ended for reason (a SandboxGone's)
    while it ran; None for the task's own ends (an OOM at its memory limit)."""
    return {"deleted": "sandbox_deleted", "ttl": "sandbox_ttl", "idle": "sandbox_ttl",
            "node_lost": "node_lost", "agent_lost": "agent_lost", "start_error": "agent_lost",
            "paused_too_long": "preempted"}.get(reason)


def fault_of_enum(v: Any) -> Optional[str]:
    """A JSON Fault enum value ("FAULT_SANDBOX_TTL" or its number) as a name; None when unset."""
    if isinstance(v, int):
        return INFRA_FAULTS[v - 1] if 0 < v <= len(INFRA_FAULTS) else None
    if not v or v == "FAULT_UNSPECIFIED":
        return None
    return str(v).removeprefix("FAULT_").lower()


class DsecError(Exception):
    """Base class of every libdsec error."""

    code = "unknown"

    def __init__(self, message: str = "", *, code: Optional[str] = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.message}" if self.message else self.code

    @property
    def infra_fault(self) -> Optional[str]:
        """The platform's fault behind this error, or None (see the module's doc)."""
        return None


class NotFound(DsecError):
    """The sandbox, process, session, file or layer does not exist."""
    code = "not_found"


class AlreadyExists(DsecError):
    code = "already_exists"


class FailedPrecondition(DsecError):
    """The call does not fit the current state (e.g. a sandbox still starting)."""
    code = "failed_precondition"


class SandboxGone(FailedPrecondition):
    """The sandbox stopped or failed; ``reason`` says why.

    reason is one of "deleted", "ttl", "idle", "oom", "agent_lost",
    "start_error", "node_lost" or "" when the daemon did not say.
    """

    def __init__(self, message: str = "", *, code: Optional[str] = None,
                 sandbox_id: str = "", state: str = "", reason: str = ""):
        super().__init__(message, code=code)
        self.sandbox_id = sandbox_id
        self.state = state
        self.reason = reason

    @property
    def infra_fault(self) -> Optional[str]:
        return fault_of_reason(self.reason)


class Overloaded(DsecError):
    """The daemon refused the work for lack of capacity; retry later.

    retry_after is the daemon's hint in seconds, or None.
    """
    code = "resource_exhausted"

    def __init__(self, message: str = "", *, code: Optional[str] = None,
                 retry_after: Optional[float] = None):
        super().__init__(message, code=code)
        self.retry_after = retry_after

    @property
    def infra_fault(self) -> Optional[str]:
        return "admission_refused"


class InvalidArgument(DsecError, ValueError):
    code = "invalid_argument"


class Unauthenticated(DsecError):
    """The server refused the token, or wanted one.

    token says where the token sent came from ("token from $DSEC_TOKEN"),
    or why none was sent; never the token itself.
    """
    code = "unauthenticated"

    def __init__(self, message: str = "", *, code: Optional[str] = None, token: str = ""):
        super().__init__(message, code=code)
        self.token = token

    def __str__(self) -> str:
        s = super().__str__()
        return f"{s} ({self.token})" if self.token else s


class PermissionDenied(DsecError):
    code = "permission_denied"


class Unavailable(DsecError, ConnectionError):
    """The daemon cannot be reached: refused, reset, gone mid-call."""
    code = "unavailable"

    @property
    def infra_fault(self) -> Optional[str]:
        # The edge answered, the sandbox's agent did not.
        return "agent_lost" if "agent channel" in self.message else "edge_unreachable"


class Timeout(DsecError, TimeoutError):
    """The call's own timeout passed before the daemon answered."""
    code = "deadline_exceeded"


class StartupTimeout(Timeout):
    """A sandbox did not become ready within the create call's timeout."""

    @property
    def infra_fault(self) -> Optional[str]:
        return "start_timeout"


class NotSupported(DsecError):
    code = "unimplemented"


class Cancelled(DsecError):
    code = "canceled"


class Internal(DsecError):
    code = "internal"


class CommandFailed(DsecError):
    """Raised by exec(..., check=True) when the command did not succeed.

    result is the :class:`libdsec.ExecResult`.
    """
    code = "command_failed"

    def __init__(self, result):
        msg = f"command exited with {result.status} (exit code {result.exit_code})"
        if result.message:
            msg += f": {result.message}"
        tail = result.stderr[-2000:].strip()
        if tail:
            msg += f"\nstderr: {tail}"
        super().__init__(msg)
        self.result = result


class OutputDropped(DsecError):
    """The result lacks output the command wrote.

    The node keeps the first 16 MiB (``dsecd --output-limit``) of each of a
    command's streams for a later attach; what came past that while nothing
    read the command's output was dropped. A stream that follows the command
    from its start (``exec``, ``exec_stream``, ``Session.run``) gets all of
    it and never raises this; ``Job.wait`` and ``Job.output`` do when the
    node dropped some. ``result`` is the :class:`libdsec.ExecResult` with what
    there was (``stdout_dropped``/``stderr_dropped`` say how much is missing);
    catch this to accept it.
    """
    code = "output_dropped"

    def __init__(self, result):
        missing = []
        if result.stdout_dropped:
            missing.append(f"{result.stdout_dropped} bytes of stdout")
        if result.stderr_dropped:
            missing.append(f"{result.stderr_dropped} bytes of stderr")
        super().__init__(f"the result lacks {' and '.join(missing) or 'output'} the command wrote: "
                         "the node dropped them, past what it keeps of a command's output, as nothing read them")
        self.result = result


_BY_CODE = {
    "not_found": NotFound,
    "already_exists": AlreadyExists,
    "failed_precondition": FailedPrecondition,
    "resource_exhausted": Overloaded,
    "invalid_argument": InvalidArgument,
    "out_of_range": InvalidArgument,
    "unauthenticated": Unauthenticated,
    "permission_denied": PermissionDenied,
    "unavailable": Unavailable,
    "deadline_exceeded": Timeout,
    "unimplemented": NotSupported,
    "canceled": Cancelled,
    "internal": Internal,
    "data_loss": Internal,
}

# "sandbox sb-n1-abc is stopped (oom): ..." (edge) or
# "sandbox sb-n1-abc is STATE_FAILED: ..." (apiserver).
_GONE = re.compile(
    r"sandbox (\S+) is (?:STATE_)?(stopped|stopping|failed|STOPPED|STOPPING|FAILED)"
    r"(?: \((\w+)\))?")


def from_code(code: str, message: str, *, retry_after: Optional[float] = None,
              creating: bool = False) -> DsecError:
    """Build the typed error for a Connect error code and message."""
    code = code or "unknown"
    if code == "failed_precondition":
        m = _GONE.search(message)
        if m:
            return SandboxGone(message, code=code, sandbox_id=m.group(1),
                               state=m.group(2).lower(), reason=(m.group(3) or "").lower())
    if code == "deadline_exceeded" and creating:
        return StartupTimeout(message, code=code)
    if code == "resource_exhausted" or (code == "unavailable" and retry_after is not None):
        return Overloaded(message, code=code, retry_after=retry_after)
    cls = _BY_CODE.get(code, DsecError)
    return cls(message, code=code)
