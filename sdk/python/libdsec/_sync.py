"""The blocking client: the same names as the async one, for code without asyncio.

A Client runs an AsyncClient on a private event-loop thread and waits for
each call. Callbacks (on_stdout, on_stderr) run on that thread.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from . import _aio
from ._aio import Command, Data, ExecEvent, ExecResult, FileInfo, Page, ProcessInfo, WarmPool
from ._fncall import Language, RunCode, RunResult
from ._events import Event, Webhook
from ._usage import UsageReport
from ._iam import AuditRecord, Principal, Project, ProjectQuota, RoleBinding, TokenInfo


class _Loop:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="libdsec-loop", daemon=True)
        self.thread.start()

    def run(self, coro):
        if self.loop.is_closed():
            coro.close()
            raise RuntimeError("libdsec: the client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self):
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.loop.close()


class Client:
    """Blocking twin of AsyncClient; see it for the arguments."""

    def __init__(self, addr: Optional[str] = None, *, timeout: float = _aio.DEFAULT_TIMEOUT,
                 max_idle_connections: int = 32, token: Optional[str] = None,
                 ca_file: Optional[str] = None):
        self._a = _aio.AsyncClient(addr, timeout=timeout, max_idle_connections=max_idle_connections,
                                   token=token, ca_file=ca_file)
        self._loop = _Loop()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._loop.run(self._a.close())
        except RuntimeError:
            pass
        self._loop.stop()

    def _run(self, coro):
        return self._loop.run(coro)

    def create(self, env: str, **kw) -> "Sandbox":
        return Sandbox(self, self._run(self._a.create(env, **kw)))

    def read_trajectory(self, id: str, offset: int = 0, **kw):
        return self._run(self._a.read_trajectory(id, offset, **kw))

    def trajectory(self, id: str, offset: int = 0, **kw):
        return self._run(self._a.trajectory(id, offset, **kw))

    def replay(self, trajectory, **kw):
        return self._run(self._a.replay(trajectory, **kw))

    def create_many(self, n: int, env: str, **kw) -> List["Sandbox"]:
        return [Sandbox(self, s) for s in self._run(self._a.create_many(n, env, **kw))]

    def run_container(self, env: str, **kw) -> "Sandbox":
        """create(env, isolation="container", ...)."""
        return Sandbox(self, self._run(self._a.run_container(env, **kw)))

    def run_gvisor(self, env: str, **kw) -> "Sandbox":
        """create(env, isolation="gvisor", ...)."""
        return Sandbox(self, self._run(self._a.run_gvisor(env, **kw)))

    def run_microvm(self, env: str, **kw) -> "Sandbox":
        """create(env, isolation="microvm", ...): the paper's run_microvm."""
        return Sandbox(self, self._run(self._a.run_microvm(env, **kw)))

    def nodes(self, *, timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        """The nodes with the kinds each offers and why it lacks the rest."""
        return self._run(self._a.nodes(timeout=timeout))

    def get(self, id: str, *, timeout: Optional[float] = None) -> "Sandbox":
        return Sandbox(self, self._run(self._a.get(id, timeout=timeout)))

    def sandbox(self, id: str) -> "Sandbox":
        return Sandbox(self, self._a.sandbox(id))

    def list(self, labels: Optional[Mapping[str, str]] = None, states=None, *, all: bool = False,
             timeout: Optional[float] = None) -> List["Sandbox"]:
        return [Sandbox(self, s) for s in self._run(self._a.list(labels, states, all=all, timeout=timeout))]

    def list_page(self, labels: Optional[Mapping[str, str]] = None, states=None, *, all: bool = False,
                  page_size: int = 100, page_token: str = "",
                  timeout: Optional[float] = None) -> Page:
        page = self._run(self._a.list_page(labels, states, all=all, page_size=page_size,
                                           page_token=page_token, timeout=timeout))
        return Page([Sandbox(self, s) for s in page.sandboxes], page.next_token, page.total, page.unreachable)

    def delete(self, id: str, *, timeout: Optional[float] = None) -> None:
        self._run(self._a.delete(id, timeout=timeout))

    def reap(self, labels: Optional[Mapping[str, str]] = None, *, timeout: Optional[float] = None) -> int:
        return self._run(self._a.reap(labels, timeout=timeout))

    def list_snapshots(self, **kw) -> List[Dict[str, Any]]:
        return self._run(self._a.list_snapshots(**kw))

    def delete_snapshot(self, name: str, **kw) -> None:
        self._run(self._a.delete_snapshot(name, **kw))

    def share_snapshot(self, name: str, project: str, **kw) -> List[str]:
        return self._run(self._a.share_snapshot(name, project, **kw))

    def unshare_snapshot(self, name: str, project: str, **kw) -> List[str]:
        return self._run(self._a.unshare_snapshot(name, project, **kw))

    def pause(self, id: str, **kw) -> Dict[str, Any]:
        return self._run(self._a.pause(id, **kw))

    def resume(self, id: str, **kw) -> Dict[str, Any]:
        return self._run(self._a.resume(id, **kw))

    def pause_all(self, labels: Mapping[str, str], **kw) -> List["Sandbox"]:
        return [Sandbox(self, s) for s in self._run(self._a.pause_all(labels, **kw))]

    def resume_all(self, labels: Mapping[str, str], **kw) -> List["Sandbox"]:
        return [Sandbox(self, s) for s in self._run(self._a.resume_all(labels, **kw))]

    def set_warm_pool(self, env: str, size: int, **kw) -> WarmPool:
        return self._run(self._a.set_warm_pool(env, size, **kw))

    def warm_pools(self, *, timeout: Optional[float] = None) -> List[WarmPool]:
        return self._run(self._a.warm_pools(timeout=timeout))

    # --- projects, quotas, principals, bindings, tokens, audit (see _iam.py) ---

    def create_project(self, path: str, **kw) -> Project:
        return self._run(self._a.create_project(path, **kw))

    def project(self, path: str, **kw) -> Project:
        return self._run(self._a.project(path, **kw))

    def projects(self, path: Optional[str] = None, **kw) -> List[Project]:
        return self._run(self._a.projects(path, **kw))

    def delete_project(self, path: str, **kw) -> None:
        return self._run(self._a.delete_project(path, **kw))

    def quota(self, project: Optional[str] = None, **kw) -> List[ProjectQuota]:
        return self._run(self._a.quota(project, **kw))

    def set_quota(self, project: str, resource: str, limit: Optional[int], **kw) -> None:
        return self._run(self._a.set_quota(project, resource, limit, **kw))

    def create_principal(self, name: str, **kw) -> Principal:
        return self._run(self._a.create_principal(name, **kw))

    def principals(self, project: Optional[str] = None, **kw) -> List[Principal]:
        return self._run(self._a.principals(project, **kw))

    def delete_principal(self, name: str, **kw) -> None:
        return self._run(self._a.delete_principal(name, **kw))

    def grant(self, principal: str, project: str, role: str, **kw) -> None:
        return self._run(self._a.grant(principal, project, role, **kw))

    def ungrant(self, principal: str, project: str, **kw) -> None:
        return self._run(self._a.ungrant(principal, project, **kw))

    def bindings(self, principal: Optional[str] = None, **kw) -> List[RoleBinding]:
        return self._run(self._a.bindings(principal, **kw))

    def create_token(self, **kw) -> Tuple[str, TokenInfo]:
        return self._run(self._a.create_token(**kw))

    def revoke_token(self, id: str, **kw) -> int:
        return self._run(self._a.revoke_token(id, **kw))

    def tokens(self, principal: Optional[str] = None, **kw) -> List[TokenInfo]:
        return self._run(self._a.tokens(principal, **kw))

    def audit(self, **kw) -> List[AuditRecord]:
        return self._run(self._a.audit(**kw))

    def export_audit(self, out, **kw) -> int:
        return self._run(self._a.export_audit(out, **kw))

    # --- the cost ledger (see _usage.py) ---

    def usage(self, **kw) -> UsageReport:
        return self._run(self._a.usage(**kw))

    # --- lifecycle events (see _events.py) ---

    def events(self, **kw) -> Tuple[List[Event], int]:
        return self._run(self._a.events(**kw))

    def add_webhook(self, url: str, **kw) -> Webhook:
        return self._run(self._a.add_webhook(url, **kw))

    def webhooks(self, **kw) -> List[Webhook]:
        return self._run(self._a.webhooks(**kw))

    def remove_webhook(self, id: str, **kw) -> None:
        return self._run(self._a.remove_webhook(id, **kw))

    def update_webhook(self, id: str, **kw) -> Webhook:
        return self._run(self._a.update_webhook(id, **kw))

    def rotate_webhook_secret(self, id: str, **kw) -> Webhook:
        return self._run(self._a.rotate_webhook_secret(id, **kw))

    def follow_events(self, **kw) -> Iterator[Event]:
        """Yield events as they come (a generator); leaving the loop ends the stream."""
        agen = self._a.follow_events(**kw)
        try:
            while True:
                try:
                    ev = self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield ev
        finally:
            try:
                self._run(agen.aclose())
            except RuntimeError:
                pass

    def list_layers(self, *, timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        return self._run(self._a.list_layers(timeout=timeout))

    def import_layer(self, ref: str, path: str, **kw) -> Dict[str, Any]:
        return self._run(self._a.import_layer(ref, path, **kw))

    def remove_layer(self, ref: str, *, timeout: Optional[float] = None) -> None:
        self._run(self._a.remove_layer(ref, timeout=timeout))

    def share_layer(self, ref: str, project: str, **kw) -> List[str]:
        return self._run(self._a.share_layer(ref, project, **kw))

    def unshare_layer(self, ref: str, project: str, **kw) -> List[str]:
        return self._run(self._a.unshare_layer(ref, project, **kw))

    def list_environments(self, *, timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        return self._run(self._a.list_environments(timeout=timeout))

    def import_image(self, ref: str, source: str, **kw) -> Dict[str, Any]:
        return self._run(self._a.import_image(ref, source, **kw))

    def layer_stats(self, *, timeout: Optional[float] = None) -> Dict[str, Any]:
        return self._run(self._a.layer_stats(timeout=timeout))

    def run_code(self, language: str, code: str, **kw) -> RunResult:
        return self._run(self._a.run_code(language, code, **kw))

    def run_code_batch(self, calls: Sequence[Union[RunCode, Mapping[str, Any]]], **kw) -> List[RunResult]:
        return self._run(self._a.run_code_batch(calls, **kw))

    def run_tests(self, language: str, code: str, cases: Sequence[Any], **kw) -> List[RunResult]:
        return self._run(self._a.run_tests(language, code, cases, **kw))

    def languages(self, *, timeout: Optional[float] = None) -> List[Language]:
        return self._run(self._a.languages(timeout=timeout))


class Sandbox:
    """Blocking twin of the async Sandbox. ``with sb:`` deletes it on exit."""

    def __init__(self, client: Client, a: _aio.Sandbox):
        self.client = client
        self._a = a
        self.id = a.id

    def __repr__(self) -> str:
        return repr(self._a)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.delete()

    info = property(lambda self: self._a.info)
    state = property(lambda self: self._a.state)
    reason = property(lambda self: self._a.reason)
    message = property(lambda self: self._a.message)
    node = property(lambda self: self._a.node)
    labels = property(lambda self: self._a.labels)
    isolation = property(lambda self: self._a.isolation)
    address = property(lambda self: self._a.address)
    from_warm_pool = property(lambda self: self._a.from_warm_pool)
    warnings = property(lambda self: self._a.warnings)
    pause_releases = property(lambda self: self._a.pause_releases)
    phase = property(lambda self: self._a.phase)

    def _run(self, coro):
        return self.client._run(coro)

    def refresh(self, **kw) -> "Sandbox":
        self._run(self._a.refresh(**kw))
        return self

    def delete(self, **kw) -> None:
        self._run(self._a.delete(**kw))

    def pause(self, **kw) -> Dict[str, Any]:
        return self._run(self._a.pause(**kw))

    def resume(self, **kw) -> Dict[str, Any]:
        return self._run(self._a.resume(**kw))

    def end_phase(self, phase: str, **kw) -> None:
        self._run(self._a.end_phase(phase, **kw))

    def set_timeout(self, seconds: float, **kw) -> None:
        self._run(self._a.set_timeout(seconds, **kw))

    def metrics(self, **kw) -> Dict[str, Any]:
        return self._run(self._a.metrics(**kw))

    def snapshot(self, name: str, **kw) -> Dict[str, Any]:
        return self._run(self._a.snapshot(name, **kw))

    def grade(self, paths, **kw) -> "_aio.GradeResult":
        return self._run(self._a.grade(paths, **kw))

    def fork(self, n: int, **kw) -> list:
        return [Sandbox(self.client, c) if isinstance(c, _aio.Sandbox) else c
                for c in self._run(self._a.fork(n, **kw))]

    def set_network_rules(self, rules: Mapping[str, bool], **kw) -> List[str]:
        return self._run(self._a.set_network_rules(rules, **kw))

    def network_log(self, **kw) -> List[Dict[str, Any]]:
        return self._run(self._a.network_log(**kw))

    def trajectory(self, offset: int = 0, **kw):
        return self._run(self._a.trajectory(offset, **kw))

    def provenance(self, **kw) -> Dict[str, Any]:
        return self._run(self._a.provenance(**kw))

    def set_provenance_paths(self, **kw) -> List[str]:
        return self._run(self._a.set_provenance_paths(**kw))

    def exec(self, cmd: Command, **kw) -> ExecResult:
        return self._run(self._a.exec(cmd, **kw))

    def exec_stream(self, cmd: Command, **kw) -> Iterator[ExecEvent]:
        """Yield the command's events; leaving the loop early kills the command."""
        agen = self._a.exec_stream(cmd, **kw)
        try:
            while True:
                try:
                    ev = self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield ev
        finally:
            try:
                self._run(agen.aclose())
            except RuntimeError:
                pass

    def spawn(self, cmd: Command, **kw) -> "Job":
        return Job(self, self._run(self._a.spawn(cmd, **kw)))

    def job(self, process_id: str = "", *, tag: str = "") -> "Job":
        return Job(self, _aio.Job(self._a, process_id, 0, tag))

    def processes(self, **kw) -> List[ProcessInfo]:
        return self._run(self._a.processes(**kw))

    def session(self, name: str = "default", **kw) -> "Session":
        return Session(self, self._a.session(name, **kw))

    def read_file(self, path: str, **kw) -> bytes:
        return self._run(self._a.read_file(path, **kw))

    def write_file(self, path: str, data: Data, **kw) -> int:
        return self._run(self._a.write_file(path, data, **kw))

    def list_dir(self, path: str, **kw) -> List[FileInfo]:
        return self._run(self._a.list_dir(path, **kw))

    def stat(self, path: str, **kw) -> FileInfo:
        return self._run(self._a.stat(path, **kw))

    def exists(self, path: str, **kw) -> bool:
        return self._run(self._a.exists(path, **kw))

    def remove(self, path: str, **kw) -> None:
        self._run(self._a.remove(path, **kw))

    def mkdir(self, path: str, **kw) -> None:
        self._run(self._a.mkdir(path, **kw))

    def upload(self, local_path: str, path: str, **kw) -> int:
        return self._run(self._a.upload(local_path, path, **kw))

    def upload_bytes(self, files: Mapping[str, Data], path: str, **kw) -> int:
        return self._run(self._a.upload_bytes(files, path, **kw))

    def download_tar(self, path: str, **kw) -> bytes:
        return self._run(self._a.download_tar(path, **kw))

    def download(self, path: str, local_dir: str, **kw) -> List[str]:
        return self._run(self._a.download(path, local_dir, **kw))


class Job:
    """Blocking twin of the async Job."""

    def __init__(self, sandbox: Sandbox, a: _aio.Job):
        self.sandbox = sandbox
        self._a = a

    process_id = property(lambda self: self._a.process_id)
    pid = property(lambda self: self._a.pid)
    tag = property(lambda self: self._a.tag)

    def __repr__(self) -> str:
        return repr(self._a)

    def wait(self, timeout: Optional[float] = None) -> ExecResult:
        return self.sandbox._run(self._a.wait(timeout))

    def output(self, **kw) -> ExecResult:
        return self.sandbox._run(self._a.output(**kw))

    def running(self, **kw) -> bool:
        return self.sandbox._run(self._a.running(**kw))

    def kill(self, signal: int = 0, **kw) -> None:
        self.sandbox._run(self._a.kill(signal, **kw))

    def write_stdin(self, data: Data, **kw) -> None:
        self.sandbox._run(self._a.write_stdin(data, **kw))


class Session:
    """Blocking twin of the async Session."""

    def __init__(self, sandbox: Sandbox, a: _aio.Session):
        self.sandbox = sandbox
        self._a = a
        self.name = a.name

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, cmd: str, **kw) -> ExecResult:
        return self.sandbox._run(self._a.run(cmd, **kw))

    def interrupt(self, **kw) -> None:
        self.sandbox._run(self._a.interrupt(**kw))

    def close(self, **kw) -> None:
        self.sandbox._run(self._a.close(**kw))
