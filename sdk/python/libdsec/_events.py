"""Lifecycle events (docs/events.md): what happened to the sandboxes of a
project and the projects under it — created, paused, resumed, phase_ended,
forked, snapshot, deleted, expired, failed with its reason — listed from a
cursor, or followed as they come."""

from __future__ import annotations

import calendar
import hashlib
import hmac
import json
import time
from dataclasses import dataclass, field
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


@dataclass
class Webhook:
    """An endpoint a project registered for its events. delivered is the ID
    of the last event its endpoint acknowledged; last_ok and last_failure are
    seconds since the epoch (0: never), failures the failed attempts since the
    last success; secret is set in add_webhook's and rotate_webhook_secret's
    answers only; previous_secret_until, after a rotation, is when the
    previous secret stops signing beside the current one (0: no rotation
    under way)."""
    id: str
    project: str
    url: str
    kinds: List[str] = field(default_factory=list)
    created: float = 0.0
    delivered: int = 0
    last_ok: float = 0.0
    last_failure: float = 0.0
    failures: int = 0
    last_error: str = ""
    secret: str = ""
    previous_secret_until: float = 0.0
    batch: int = 0

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "Webhook":
        return Webhook(id=d.get("id", ""), project=d.get("project", ""), url=d.get("url", ""),
                       kinds=list(d.get("kinds", [])), created=_secs(d.get("createdUnixMs")),
                       delivered=int(d.get("delivered", 0)), last_ok=_secs(d.get("lastOkUnixMs")),
                       last_failure=_secs(d.get("lastFailureUnixMs")), failures=int(d.get("failures", 0)),
                       last_error=d.get("lastError", ""), secret=d.get("secret", ""),
                       previous_secret_until=_secs(d.get("previousSecretUntilUnixMs")),
                       batch=int(d.get("batch", 0)))


def verify_webhook(secret: str, header: str, body: bytes, *, tolerance: float = 300.0,
                   now: Optional[float] = None) -> bool:
    """Whether a delivery's Dsec-Signature header (t=UNIX,v1=HEX) signs body
    (its exact bytes) with secret, at a time within tolerance seconds of now.
    Any of the header's v1 entries may match: while a webhook's secret is
    rotated, deliveries carry one for the new secret and one for the old."""
    ts, sigs = None, []
    for part in header.split(","):
        k, _, v = part.strip().partition("=")
        if k == "t" and v.isdigit():
            ts = int(v)
        elif k == "v1":
            sigs.append(v)
    if ts is None or not sigs:
        return False
    if abs((time.time() if now is None else now) - ts) > tolerance:
        return False
    want = hmac.new(secret.encode(), str(ts).encode() + b"." + body, hashlib.sha256).hexdigest()
    return any(hmac.compare_digest(want, s) for s in sigs)


def _rfc3339(v: str) -> float:
    """Seconds since the epoch of a UTC RFC 3339 time (as a delivery's at:
    up to nanoseconds, ending in Z)."""
    v = v.rstrip("Z")
    whole, _, frac = v.partition(".")
    secs = calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S"))
    return secs + (float("0." + frac) if frac else 0.0)


def webhook_events(body: bytes) -> List[Event]:
    """The events of a webhook delivery's body (verify it first with
    verify_webhook): a batch's {"webhook": ..., "events": [...]} in order, or
    a single event's delivery (a webhook added with single=True) as one."""
    d = json.loads(body)
    items = d["events"] if isinstance(d, dict) and "events" in d else [d]
    return [Event(id=int(e["id"]), key=e.get("key", ""), at=_rfc3339(e["at"]) if e.get("at") else 0.0,
                  project=e.get("project", ""), sandbox_id=e.get("sandbox_id", ""), kind=e.get("kind", ""),
                  node=e.get("node", ""), reason=e.get("reason", ""), message=e.get("message", ""))
            for e in items]


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

    async def add_webhook(self, url: str, *, project: Optional[str] = None, kinds: Optional[Sequence[str]] = None,
                          secret: Optional[str] = None, batch: Optional[int] = None, single: bool = False,
                          timeout: Optional[float] = None) -> Webhook:
        """Register url for the events of a project (default: the token's; an
        admin's) and those under it, from now on; the answer's secret (made by
        the server unless given) is shown this once. Each delivery carries up
        to batch of the events waiting (None: 100; at most 1,000) as
        {"webhook": ..., "events": [...]}, or with single=True one event, the
        event object itself; webhook_events reads either."""
        msg: Dict[str, Any] = {"url": url}
        if batch:
            msg["batch"] = int(batch)
        if single:
            msg["single"] = True
        if project is not None:
            msg["project"] = project
        if kinds:
            msg["kinds"] = list(kinds)
        if secret:
            msg["secret"] = secret
        return Webhook.from_json(await self._call("AddWebhook", msg, timeout))  # type: ignore[attr-defined]

    async def webhooks(self, *, project: Optional[str] = None, timeout: Optional[float] = None) -> List[Webhook]:
        """The webhooks of a project (default: the token's) and those under it."""
        msg: Dict[str, Any] = {} if project is None else {"project": project}
        resp = await self._call("ListWebhooks", msg, timeout, idempotent=True)  # type: ignore[attr-defined]
        return [Webhook.from_json(w) for w in resp.get("webhooks", [])]

    async def remove_webhook(self, id: str, *, project: Optional[str] = None, timeout: Optional[float] = None) -> None:
        msg: Dict[str, Any] = {"id": id}
        if project is not None:
            msg["project"] = project
        await self._call("RemoveWebhook", msg, timeout, idempotent=True)  # type: ignore[attr-defined]

    async def update_webhook(self, id: str, *, project: Optional[str] = None, url: Optional[str] = None,
                             kinds: Optional[Sequence[str]] = None, batch: Optional[int] = None,
                             single: bool = False, timeout: Optional[float] = None) -> Webhook:
        """Change webhook id in place and return it as it now is: its url,
        its kinds ([]: every kind), its batch (0: 100; at most 1,000) or
        single=True (one event a delivery, bare); what is None stays. It
        keeps its cursor (no event skipped or sent twice for the change),
        secret and history, so a webhook added before batches (batch 0)
        moves to them without losing an event, as removing and adding it
        again would."""
        msg: Dict[str, Any] = {"id": id}
        if project is not None:
            msg["project"] = project
        if url is not None:
            msg["url"] = url
        if kinds is not None:
            msg["setKinds"] = True
            msg["kinds"] = list(kinds)
        if batch is not None:
            msg["batch"] = int(batch)
        if single:
            msg["single"] = True
        return Webhook.from_json(await self._call("UpdateWebhook", msg, timeout, idempotent=True))  # type: ignore[attr-defined]

    async def rotate_webhook_secret(self, id: str, *, project: Optional[str] = None, secret: Optional[str] = None,
                                    overlap: Optional[float] = None, timeout: Optional[float] = None) -> Webhook:
        """Give webhook id a new signing secret (made by the server unless
        given; the answer's secret, shown this once). For overlap seconds
        (None: 24 hours; 0: none) the old secret signs each delivery beside
        the new one, so receivers can move over without refusing one."""
        msg: Dict[str, Any] = {"id": id}
        if project is not None:
            msg["project"] = project
        if secret:
            msg["secret"] = secret
        if overlap is not None:
            msg["overlapSeconds"] = str(max(1, int(overlap)) if overlap > 0 else -1)
        return Webhook.from_json(await self._call("RotateWebhookSecret", msg, timeout))  # type: ignore[attr-defined]
