"""The paper's SDK names (DSec, arXiv 2609.22978, Listing 1) on top of libdsec.

Code written against the paper runs unchanged::

    from libdsec.compat import DSecClient, DSecContainerRunArgs

    client = DSecClient(); await client.open()
    args = DSecContainerRunArgs(container_image="busybox:test",
        memory_limit_mb=4096, cpu_cores_limit=4, ttl_running_stop=300,   # idle timeout
        network_rules={"npm": False, "pypi": True}, init_user="root")
    sandbox = await client.run_container(args, timeout=120)
    result = await sandbox.run_shell("echo hello world")
    await sandbox.stop()

container_image names a dsec environment ("BASE[+LAYER...]"); ttl_running_stop
is the idle timeout in seconds.

As in the paper, the args type and the run method choose the backend:
run_microvm(DSecMicroVMRunArgs(...)) makes a sandbox with a kernel of its own
(isolation "microvm", QEMU), run_gvisor(DSecGVisorRunArgs(...)) one under
gVisor (isolation "gvisor"); the fields are run_container's, and a node
without the isolation refuses, naming what to install.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from ._aio import AsyncClient, ExecResult, Sandbox

__all__ = ["DSecClient", "DSecContainerRunArgs", "DSecGVisorRunArgs", "DSecMicroVMRunArgs", "DSecSandbox"]


@dataclass
class DSecContainerRunArgs:
    container_image: str
    memory_limit_mb: Optional[int] = None
    cpu_cores_limit: Optional[float] = None
    ttl_running_stop: Optional[float] = None  # idle timeout, seconds
    network_rules: Dict[str, bool] = field(default_factory=dict)
    init_user: Optional[str] = None
    disk_limit_mb: Optional[int] = None
    ttl_seconds: Optional[float] = None       # hard lifetime
    env: Dict[str, str] = field(default_factory=dict)
    labels: Dict[str, str] = field(default_factory=dict)


@dataclass
class DSecMicroVMRunArgs(DSecContainerRunArgs):
    """run_container's arguments, for DSecClient.run_microvm."""


@dataclass
class DSecGVisorRunArgs(DSecContainerRunArgs):
    """run_container's arguments, for DSecClient.run_gvisor."""


class DSecSandbox:
    """A sandbox made by DSecClient.run_container, run_gvisor or run_microvm."""

    def __init__(self, sb: Sandbox):
        self.sandbox = sb
        self.id = sb.id

    async def run_shell(self, cmd: str, timeout: Optional[float] = None) -> ExecResult:
        """Run cmd under the shell; the result has exit_code, stdout, stderr (and .output)."""
        return await self.sandbox.exec(cmd, timeout=timeout)

    async def stop(self) -> None:
        await self.sandbox.delete()

    async def pause(self) -> None:
        await self.sandbox.pause()

    async def resume(self) -> None:
        await self.sandbox.resume()

    async def pack_diff(self, name: str, exclude=None) -> str:
        """The paper's pack_diff: an incremental snapshot of the sandbox's
        file system as layer snap:NAME, residue under exclude wiped first.
        Returns the container_image that restores it."""
        info = await self.sandbox.snapshot(name, exclude=exclude)
        return info["environment"]


class DSecClient:
    def __init__(self, addr: Optional[str] = None):
        self._addr = addr
        self._client: Optional[AsyncClient] = None

    async def open(self) -> "DSecClient":
        if self._client is None:
            self._client = AsyncClient(self._addr)
        return self

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def run_container(self, args: DSecContainerRunArgs, timeout: float = 120) -> DSecSandbox:
        """A sandbox on the node's kernel (isolation "container", runc)."""
        return await self._run(args, None, timeout)

    async def run_gvisor(self, args: DSecGVisorRunArgs, timeout: float = 120) -> DSecSandbox:
        """A sandbox under gVisor's user-space kernel (isolation "gvisor")."""
        return await self._run(args, "gvisor", timeout)

    async def run_microvm(self, args: DSecMicroVMRunArgs, timeout: float = 120) -> DSecSandbox:
        """The paper's run_microvm: a sandbox with a kernel of its own in a
        QEMU microVM (isolation "microvm")."""
        return await self._run(args, "microvm", timeout)

    async def _run(self, args: DSecContainerRunArgs, isolation: Optional[str], timeout: float) -> DSecSandbox:
        if self._client is None:
            await self.open()
        sb = await self._client.create(
            args.container_image, backend="container", isolation=isolation, cpus=args.cpu_cores_limit,
            memory_mb=args.memory_limit_mb, disk_mb=args.disk_limit_mb, ttl_s=args.ttl_seconds,
            idle_timeout_s=args.ttl_running_stop, user=args.init_user, env_vars=args.env or None,
            labels=args.labels or None, network_rules=args.network_rules or None, timeout=timeout)
        return DSecSandbox(sb)
