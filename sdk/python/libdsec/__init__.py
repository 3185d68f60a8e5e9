"""libdsec: the Python client of dsec, the sandbox infrastructure for agentic RL.

Async first::

    import libdsec

    async with libdsec.AsyncClient() as client:          # $DSEC_ADDR or the local socket
        async with await client.create("busybox:test", memory_mb=256) as sb:
            r = await sb.exec("echo hello", timeout=30)
            print(r.exit_code, r.stdout)

Short programs (reward code, test cases) run in pooled warm containers::

    with libdsec.Client() as client:
        r = client.run_code("python", "print(input()[::-1])", stdin="abc")
        print(r.status, r.stdout)                          # success cba

The blocking twin has the same names: ``libdsec.Client``. Errors are typed,
see :mod:`libdsec.errors`. The paper's names (``DSecClient``,
``DSecContainerRunArgs``, ``DSecMicroVMRunArgs``, ``DSecGVisorRunArgs``,
``DSecSandbox``) are importable from here too; they
live in :mod:`libdsec.compat`.
"""

from . import errors
from ._aio import (AsyncClient, ExecEvent, ExecResult, FileInfo, GradeResult, Job as AsyncJob, Page, ProcessInfo,
                   Sandbox as AsyncSandbox, Session as AsyncSession, WarmPool, extract_tar)
from ._events import Event, Webhook, verify_webhook, webhook_events
from ._usage import Usage, UsageReport
from ._fncall import CommandResult, Language, RunCode, RunResult
from ._iam import (ADMIN, BUILDER, PROJECT_LABEL, RUNNER, VIEWER, AuditRecord, Principal, Project, ProjectQuota, QuotaItem,
                   RoleBinding, TokenInfo)
from ._sync import Client, Job, Sandbox, Session
from ._trajectory import ReplayReport, ReplayStep, Trajectory, parse_trajectory
from ._transport import DEFAULT_ADDR, DEFAULT_TOKEN_FILE, resolve_addr, resolve_addrs
from .compat import DSecClient, DSecContainerRunArgs, DSecGVisorRunArgs, DSecMicroVMRunArgs, DSecSandbox
from .errors import (AlreadyExists, CommandFailed, DsecError, FailedPrecondition, InvalidArgument, NotFound,
                     OutputDropped, Overloaded, PermissionDenied, SandboxGone, StartupTimeout, Timeout,
                     Unauthenticated, Unavailable)

__version__ = "0.1.0"

__all__ = [
    "AsyncClient", "AsyncSandbox", "AsyncJob", "AsyncSession", "Client", "Sandbox", "Job", "Session",
    "ExecResult", "ExecEvent", "GradeResult", "FileInfo", "Page", "ProcessInfo", "WarmPool", "extract_tar", "errors",
    "RunCode", "RunResult", "CommandResult", "Language",
    "Trajectory", "ReplayReport", "ReplayStep", "parse_trajectory", "Event", "Webhook", "verify_webhook", "webhook_events", "Usage", "UsageReport",
    "Project", "Principal", "RoleBinding", "TokenInfo", "QuotaItem", "ProjectQuota", "AuditRecord",
    "VIEWER", "RUNNER", "BUILDER", "ADMIN", "PROJECT_LABEL", "PermissionDenied", "AlreadyExists", "FailedPrecondition",
    "DEFAULT_ADDR", "DEFAULT_TOKEN_FILE", "resolve_addr", "resolve_addrs", "DsecError", "NotFound", "SandboxGone", "Overloaded", "StartupTimeout",
    "InvalidArgument", "Unauthenticated", "Unavailable", "Timeout", "CommandFailed", "OutputDropped",
    "DSecClient", "DSecContainerRunArgs", "DSecGVisorRunArgs", "DSecMicroVMRunArgs", "DSecSandbox",
]
