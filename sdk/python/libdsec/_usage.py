"""The cost ledger (docs/usage.md): what the sandboxes of a project and the
projects under it used — CPU-seconds, memory GiB-seconds, disk GiB-hours,
snapshot and egress bytes, FnCall calls — grouped by project, sandbox, node
or a label (label:run, label:task), deleted sandboxes included."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from ._iam import When, _ms


@dataclass
class Usage:
    """The ledger's figures of one group of sandboxes."""
    sandboxes: int = 0
    cpu_seconds: float = 0.0
    memory_gib_seconds: float = 0.0
    disk_gib_hours: float = 0.0
    disk_peak_bytes: int = 0
    snapshot_bytes: int = 0
    egress_bytes: int = 0
    fncall_calls: int = 0

    @staticmethod
    def from_json(d: Optional[Mapping[str, Any]]) -> "Usage":
        d = d or {}
        return Usage(sandboxes=int(d.get("sandboxes", 0)), cpu_seconds=int(d.get("cpuUsec", 0)) / 1e6,
                     memory_gib_seconds=float(d.get("memoryGibSeconds", 0.0)),
                     disk_gib_hours=float(d.get("diskGibHours", 0.0)), disk_peak_bytes=int(d.get("diskPeakBytes", 0)),
                     snapshot_bytes=int(d.get("snapshotBytes", 0)), egress_bytes=int(d.get("egressBytes", 0)),
                     fncall_calls=int(d.get("fncallCalls", 0)))


@dataclass
class UsageReport:
    """usage()'s answer: by is the grouping, groups maps each key (a
    project's path, a sandbox's ID, a node, or a label's value; "" for
    sandboxes without the label) to its figures, total adds them up."""
    by: str
    groups: Dict[str, Usage] = field(default_factory=dict)
    total: Usage = field(default_factory=Usage)

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "UsageReport":
        return UsageReport(by=d.get("by", ""),
                           groups={g.get("key", ""): Usage.from_json(g.get("usage")) for g in d.get("groups", [])},
                           total=Usage.from_json(d.get("total")))


def _usage_msg(project: Optional[str], by: Optional[str], since: When, until: When) -> Dict[str, Any]:
    msg: Dict[str, Any] = {}
    if project is not None:
        msg["project"] = project
    if by:
        msg["by"] = by
    if since is not None:
        msg["sinceUnixMs"] = str(_ms(since))
    if until is not None:
        msg["untilUnixMs"] = str(_ms(until))
    return msg


class UsageCalls:
    """Usage, mixed into AsyncClient."""

    async def usage(self, *, project: Optional[str] = None, by: Optional[str] = None, since: When = None,
                    until: When = None, timeout: Optional[float] = None) -> UsageReport:
        """What the sandboxes of a project (default: the token's) and the
        projects under it used, grouped by by: "project" (the default),
        "sandbox", "node" or "label:KEY". since and until select the
        sandboxes alive in that window, each counting whole."""
        resp = await self._call("Usage", _usage_msg(project, by, since, until),  # type: ignore[attr-defined]
                                timeout, idempotent=True)
        return UsageReport.from_json(resp)
