"""Lifecycle events (docs/events.md): what happened to the sandboxes of a
project and the projects under it — created, paused, resumed, phase_ended,
forked, snapshot, deleted, expired, failed with its reason — listed from a
cursor, or followed as they come."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, List, Mapping, Optional, Sequence, Tuple

from ._iam import When, _ms, _secs

SANDBOX = "dsec.v1.SandboxService"

KINDS = ("created", "paused", "resumed", "phase_ended", "forked", "snapshot", "deleted", "expired", "failed")


@dataclass
class Event:
    """One step of a sandbox's life, as its node saw it. id is the cursor
    (pass it as after); at is seconds since the epoch."""
    id: int
    key: str
    at: float
    project: str
    sandbox_id: str
    kind: str
    node: str = ""
    reason: str = ""
    message: str = ""

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "Event":
        return Event(id=int(d.get("id", 0)), key=d.get("key", ""), at=_secs(d.get("atUnixMs")),
                     project=d.get("project", ""), sandbox_id=d.get("sandboxId", ""), kind=d.get("kind", ""),
                     node=d.get("node", ""), reason=d.get("reason", ""), message=d.get("message", ""))


def _events_msg(project: Optional[str], after: int, since: When, sandbox_id: Optional[str],
                kinds: Optional[Sequence[str]], limit: Optional[int]) -> Dict[str, Any]:
    msg: Dict[str, Any] = {}
    if project is not None:
        msg["project"] = project
    if after:
        msg["after"] = str(int(after))
    if since is not None:
        msg["sinceUnixMs"] = str(_ms(since))
    if sandbox_id:
        msg["sandboxId"] = sandbox_id
    if kinds:
        msg["kinds"] = list(kinds)
    if limit:
        msg["limit"] = int(limit)
    return msg


class EventCalls:
    """ListEvents and FollowEvents, mixed into AsyncClient."""

    async def events(self, *, project: Optional[str] = None, after: int = 0, since: When = None,
                     sandbox_id: Optional[str] = None, kinds: Optional[Sequence[str]] = None,
                     limit: Optional[int] = None, timeout: Optional[float] = None) -> Tuple[List[Event], int]:
        """A page of the events of a project (default: the token's) and the
        projects under it, oldest first, after the cursor after; returns the
        events and the cursor after them (after, when there are none). limit
        defaults to the server's page of 1,000."""
        resp = await self._call("ListEvents", _events_msg(project, after, since, sandbox_id, kinds, limit),  # type: ignore[attr-defined]
                                timeout, idempotent=True)
        return [Event.from_json(e) for e in resp.get("events", [])], int(resp.get("next", after) or 0)

    async def follow_events(self, *, project: Optional[str] = None, after: int = 0, since: When = None,
                            sandbox_id: Optional[str] = None, kinds: Optional[Sequence[str]] = None,
                            limit: Optional[int] = None, timeout: Optional[float] = None) -> AsyncIterator[Event]:
        """Yield the events events() would, then each new one as the server
        stores it (about a second after its node saw it), until limit events
        came (None: never), timeout seconds passed (None: never), or the loop
        is left. After a broken stream, follow again with after the last
        event's id: nothing is missed or seen twice."""
        stream = await self._t.stream(SANDBOX, "FollowEvents",  # type: ignore[attr-defined]
                                      _events_msg(project, after, since, sandbox_id, kinds, limit),
                                      timeout=timeout, idempotent=True)
        try:
            async for e in stream:
                yield Event.from_json(e)
        finally:
            stream.close()
