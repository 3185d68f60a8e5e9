"""Projects, quotas, principals, role bindings, tokens and the audit trail.

The calls of dsec.v1.IAMService (docs/iam.md), mixed into AsyncClient.
Projects are named by their path below the root ("ml/rl-run-42"; the root
is "/"). Every call acts with the client's token: no one grants a role,
mints a token or hands down a quota they do not hold (PermissionDenied); a
project the token cannot see is NotFound; a quota past what is left is
Overloaded (ResourceExhausted).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

IAM = "dsec.v1.IAMService"

# Roles, each holding every right of the ones before it.
VIEWER, RUNNER, BUILDER, ADMIN = "viewer", "runner", "builder", "admin"

# The label that puts a sandbox in a project: create(..., labels={PROJECT_LABEL:
# "ml/rl-run-42"}) makes it there, charged to that project's quota (runner
# there); without it, in the token's project.
PROJECT_LABEL = "dsec.dev/project"

When = Union[None, float, int, datetime.datetime]


def _secs(ms: Any) -> float:
    """A message's *_unix_ms (protojson sends int64 as a string) in seconds; 0 for unset."""
    return int(ms or 0) / 1000.0


def _ms(t: When) -> int:
    if t is None:
        return 0
    if isinstance(t, datetime.datetime):
        return int(t.timestamp() * 1000)
    return int(float(t) * 1000)


@dataclass
class Project:
    path: str          # "" for the root
    id: str
    depth: int         # the root's is 0
    created: float     # seconds since the epoch

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "Project":
        return Project(path=d.get("path", ""), id=d.get("id", ""), depth=int(d.get("depth", 0)),
                       created=_secs(d.get("createdUnixMs")))


@dataclass
class Principal:
    name: str
    kind: str          # "user" or "service"
    project: str       # its home project, whose admins manage it
    id: str
    created: float

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "Principal":
        return Principal(name=d.get("name", ""), kind=d.get("kind", ""), project=d.get("project", ""),
                         id=d.get("id", ""), created=_secs(d.get("createdUnixMs")))


@dataclass
class RoleBinding:
    principal: str
    project: str
    role: str


@dataclass
class TokenInfo:
    """A token's description; its secret is shown once, by create_token."""
    id: str
    principal: str
    project: str
    role: str
    parent: str        # the token that minted it; "" the node's administrator
    created: float
    expires: float     # 0: never
    revoked: float     # 0: not revoked

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "TokenInfo":
        return TokenInfo(id=d.get("id", ""), principal=d.get("principal", ""), project=d.get("project", ""),
                         role=d.get("role", ""), parent=d.get("parent", ""), created=_secs(d.get("createdUnixMs")),
                         expires=_secs(d.get("expiresUnixMs")), revoked=_secs(d.get("revokedUnixMs")))


@dataclass
class QuotaItem:
    resource: str      # sandboxes, vcpus, memory_mb, disk_mb, snapshot_bytes, layer_bytes, fncall_inflight, creates_per_second
    limit: Optional[int]  # None: no limit of its own (its ancestors' bound it)
    used: int          # by the project and everything under it


@dataclass
class ProjectQuota:
    project: str
    items: List[QuotaItem]

    def item(self, resource: str) -> QuotaItem:
        for it in self.items:
            if it.resource == resource:
                return it
        raise KeyError(resource)


@dataclass
class AuditRecord:
    id: int
    at: float
    principal: str
    token_id: str
    project: str
    operation: str
    object: str
    code: str          # "ok", or the error's code (permission_denied...)
    peer: str
    message: str

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "AuditRecord":
        return AuditRecord(id=int(d.get("id", 0)), at=_secs(d.get("atUnixMs")), principal=d.get("principal", ""),
                           token_id=d.get("tokenId", ""), project=d.get("project", ""),
                           operation=d.get("operation", ""), object=d.get("object", ""), code=d.get("code", ""),
                           peer=d.get("peer", ""), message=d.get("message", ""))


def _opt(msg: Dict[str, Any], key: str, v: Optional[str]) -> Dict[str, Any]:
    if v is not None:
        msg[key] = v
    return msg


def _audit_msg(project: Optional[str], since: When, until: When, principal: Optional[str],
               limit: Optional[int]) -> Dict[str, Any]:
    msg = _opt({}, "project", project)
    if since is not None:
        msg["sinceUnixMs"] = _ms(since)
    if until is not None:
        msg["untilUnixMs"] = _ms(until)
    if principal:
        msg["principal"] = principal
    if limit:
        msg["limit"] = int(limit)
    return msg


class IAMCalls:
    """The IAM calls of AsyncClient (it provides _call, _t and _to)."""

    async def _iam(self, method: str, msg: Dict[str, Any], timeout: Optional[float],
                   idempotent: bool = False) -> Dict[str, Any]:
        return await self._call(method, msg, timeout, idempotent=idempotent, service=IAM)  # type: ignore[attr-defined]

    async def create_project(self, path: str, *, timeout: Optional[float] = None) -> Project:
        """Make the project at path under its existing parent (admin there)."""
        return Project.from_json(await self._iam("CreateProject", {"path": path}, timeout))

    async def project(self, path: str, *, timeout: Optional[float] = None) -> Project:
        return Project.from_json(await self._iam("GetProject", {"path": path}, timeout, True))

    async def projects(self, path: Optional[str] = None, *, subtree: bool = False,
                       timeout: Optional[float] = None) -> List[Project]:
        """The children of the project at path (default: the token's project),
        or with subtree every project under it."""
        resp = await self._iam("ListProjects", _opt({"subtree": subtree}, "path", path), timeout, True)
        return [Project.from_json(p) for p in resp.get("projects", [])]

    async def delete_project(self, path: str, *, objects_to_parent: bool = False,
                             timeout: Optional[float] = None) -> None:
        """Delete an empty project; one in use is FailedPrecondition saying what uses it.

        objects_to_parent hands its layers, images and snapshots (names, shares and
        their bytes' charge) to its parent instead of refusing while it owns any.
        """
        req: dict = {"path": path}
        if objects_to_parent:
            req["objectsToParent"] = True
        await self._iam("DeleteProject", req, timeout)

    async def quota(self, project: Optional[str] = None, *, timeout: Optional[float] = None) -> List[ProjectQuota]:
        """Use and limits of a project (default: the token's) and of each of its children, the project first."""
        resp = await self._iam("GetQuota", _opt({}, "project", project), timeout, True)
        out = []
        for p in resp.get("projects", []):
            items = []
            for it in p.get("items", []):
                lim = int(it.get("limit", 0))
                items.append(QuotaItem(resource=it.get("resource", ""), limit=None if lim < 0 else lim,
                                       used=int(it.get("used", 0))))
            out.append(ProjectQuota(project=p.get("project", ""), items=items))
        return out

    async def set_quota(self, project: str, resource: str, limit: Optional[int], *,
                        timeout: Optional[float] = None) -> None:
        """Set a project's limit on resource (None removes its own), carved from
        its nearest limited ancestor's: past what that has left is Overloaded,
        below what is in use FailedPrecondition."""
        await self._iam("SetQuota", {"project": project, "resource": resource,
                                     "limit": -1 if limit is None else int(limit)}, timeout, True)

    async def create_principal(self, name: str, *, kind: str = "user", project: Optional[str] = None,
                               timeout: Optional[float] = None) -> Principal:
        """Make a person ("user") or a service account ("service": a harness,
        an agent, a builder) at home in project (None: the token's), whose
        admins manage it."""
        msg = {"name": name, "kind": kind}
        if project:
            msg["project"] = project
        return Principal.from_json(await self._iam("CreatePrincipal", msg, timeout))

    async def principals(self, project: Optional[str] = None, *,
                         timeout: Optional[float] = None) -> List[Principal]:
        """The principals at home in a project (default: the token's) or under it that the token administers."""
        resp = await self._iam("ListPrincipals", _opt({}, "project", project), timeout, True)
        return [Principal.from_json(p) for p in resp.get("principals", [])]

    async def delete_principal(self, name: str, *, timeout: Optional[float] = None) -> None:
        """Delete a principal, its role bindings, its tokens and the tokens minted from them."""
        await self._iam("DeletePrincipal", {"name": name}, timeout)

    async def grant(self, principal: str, project: str, role: str, *, timeout: Optional[float] = None) -> None:
        """Give principal role on project and everything under it (admin there and at least role)."""
        await self._iam("Grant", {"principal": principal, "project": project, "role": role}, timeout, True)

    async def ungrant(self, principal: str, project: str, *, timeout: Optional[float] = None) -> None:
        """Remove principal's role binding on project."""
        await self._iam("Ungrant", {"principal": principal, "project": project}, timeout)

    async def bindings(self, principal: Optional[str] = None, *,
                       timeout: Optional[float] = None) -> List[RoleBinding]:
        """A principal's role bindings (default: the token's own principal)."""
        resp = await self._iam("ListBindings", {"principal": principal or ""}, timeout, True)
        return [RoleBinding(principal=b.get("principal", ""), project=b.get("project", ""), role=b.get("role", ""))
                for b in resp.get("bindings", [])]

    async def create_token(self, *, principal: Optional[str] = None, project: Optional[str] = None,
                           role: Optional[str] = None, ttl_s: Optional[float] = None,
                           timeout: Optional[float] = None) -> Tuple[str, TokenInfo]:
        """Mint a token; returns it (shown once) and its description.

        Unset arguments take the minting token's own (principal, project,
        role); none may exceed it: a project in its subtree, a role at most
        its own, an expiry no later (ttl_s None: no expiry, which only a token
        without one may mint). An agent mints a narrower token for a
        sub-agent this way; revoking the agent's token revokes it too.
        """
        msg: Dict[str, Any] = {"principal": principal or "", "project": project or "", "role": role or ""}
        if ttl_s is not None:
            if ttl_s < 0:
                from . import errors
                raise errors.InvalidArgument("token ttl_s must not be negative")
            msg["ttlSeconds"] = max(1, int(-(-ttl_s // 1)))
        resp = await self._iam("CreateToken", msg, timeout)
        return resp.get("token", ""), TokenInfo.from_json(resp.get("info") or {})

    async def revoke_token(self, id: str, *, timeout: Optional[float] = None) -> int:
        """Revoke a token and every token minted from it; returns how many were revoked now."""
        resp = await self._iam("RevokeToken", {"id": id}, timeout, True)
        return int(resp.get("revoked", 0))

    async def tokens(self, principal: Optional[str] = None, *,
                     timeout: Optional[float] = None) -> List[TokenInfo]:
        """A principal's tokens (default: the token's own principal), oldest first, without secrets."""
        resp = await self._iam("ListTokens", {"principal": principal or ""}, timeout, True)
        return [TokenInfo.from_json(t) for t in resp.get("tokens", [])]

    async def audit(self, *, project: Optional[str] = None, since: When = None, until: When = None,
                    principal: Optional[str] = None, limit: Optional[int] = None,
                    timeout: Optional[float] = None) -> List[AuditRecord]:
        """Audit records of a project (default: the token's) and everything
        under it, oldest first; since and until (exclusive) are datetimes or
        seconds since the epoch; limit defaults to the server's 1,000."""
        resp = await self._iam("QueryAudit", _audit_msg(project, since, until, principal, limit), timeout, True)
        return [AuditRecord.from_json(r) for r in resp.get("records", [])]

    async def export_audit(self, out, *, project: Optional[str] = None, since: When = None, until: When = None,
                           principal: Optional[str] = None, limit: Optional[int] = None,
                           timeout: Optional[float] = 300.0) -> int:
        """Write every record selected (all, unless limit) to out, a binary file
        (open(..., "wb"), sys.stdout.buffer), as JSON lines streamed from the
        server; returns how many lines were written."""
        import base64
        stream = await self._t.stream(IAM, "ExportAudit",  # type: ignore[attr-defined]
                                      _audit_msg(project, since, until, principal, limit),
                                      timeout=self._to(timeout), idempotent=True)  # type: ignore[attr-defined]
        n = 0
        try:
            async for chunk in stream:
                data = base64.b64decode(chunk.get("data") or "")
                out.write(data)
                n += data.count(b"\n")
        finally:
            stream.close()
        return n
