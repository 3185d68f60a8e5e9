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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from ._aio import AsyncClient, ExecResult, Sandbox

__all__ = ["DSecClient", "DSecContainerRunArgs", "DSecSandbox"]


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


class DSecSandbox:
    """A container sandbox made by DSecClient.run_container."""

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
        if self._client is None:
            await self.open()
        sb = await self._client.create(
            args.container_image, backend="container", cpus=args.cpu_cores_limit,
            memory_mb=args.memory_limit_mb, disk_mb=args.disk_limit_mb, ttl_s=args.ttl_seconds,
            idle_timeout_s=args.ttl_running_stop, user=args.init_user, env_vars=args.env or None,
            labels=args.labels or None, network_rules=args.network_rules or None, timeout=timeout)
        return DSecSandbox(sb)
