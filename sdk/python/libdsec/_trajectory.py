"""Trajectories and replay (docs/trajectories.md): what was done to a
sandbox, read as JSON lines from an offset, and a replay of its calls in a
fresh sandbox that reports, step by step, where exits and outputs diverge."""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from . import errors

SANDBOX = "dsec.v1.SandboxService"

# The calls a replay redoes: the trajectory's call name -> the RPC, and
# whether it streams a command's events.
_REPLAYED = {
    "exec": ("Exec", True), "session_run": ("SessionRun", True),
    "write_file": ("WriteFile", False), "upload": ("Upload", False), "remove": ("Remove", False),
    "make_dir": ("MakeDir", False), "move": ("Move", False), "write_stdin": ("WriteStdin", False),
    "signal": ("Signal", False), "session_interrupt": ("SessionInterrupt", False),
    "session_close": ("SessionClose", False), "set_network_rules": ("SetNetworkRules", False),
}

_EMPTY = hashlib.sha256(b"").hexdigest()


@dataclass
class Trajectory:
    """A read of a sandbox's trajectory from an offset.

    lines are the JSON lines as dicts (raw: their bytes); next_offset is
    where to read from next; ended says the sandbox is gone and the
    trajectory complete, when sha256 (of its first size bytes) is its hash.
    """
    lines: List[Dict[str, Any]]
    raw: bytes
    next_offset: int
    size: int
    ended: bool
    sha256: str


@dataclass
class ReplayStep:
    """One recorded call as replayed: verdict "match", "diverged" or
    "skipped", detail saying what differs or why skipped; for commands the
    exits and the SHA-256 of stdout and stderr, recorded and now."""
    seq: int
    call: str
    verdict: str
    detail: str = ""
    want_exit: Optional[int] = None
    got_exit: Optional[int] = None
    want_stdout_sha256: str = ""
    got_stdout_sha256: str = ""
    want_stderr_sha256: str = ""
    got_stderr_sha256: str = ""


@dataclass
class ReplayReport:
    sandbox: str
    steps: List[ReplayStep] = field(default_factory=list)
    matched: int = 0
    diverged: int = 0
    skipped: int = 0

    @property
    def deterministic(self) -> bool:
        """Every replayed step matched."""
        return self.diverged == 0


def parse_trajectory(data: Union[bytes, str]) -> List[Dict[str, Any]]:
    """The lines of a trajectory's JSON lines."""
    if isinstance(data, bytes):
        data = data.decode()
    return [json.loads(line) for line in data.splitlines() if line.strip()]


class TrajectoryCalls:
    """The trajectory calls of AsyncClient (mixed in)."""

    async def read_trajectory(self, id: str, offset: int = 0, *,
                              timeout: Optional[float] = None) -> Trajectory:
        """One read of sandbox id's trajectory from offset (bytes already
        read), up to the node's bound per read: a trainer re-attaching reads
        what it missed from where it stopped."""
        resp = await self._call("Trajectory", {"sandboxId": id, "offset": str(int(offset))}, timeout,
                                idempotent=True)
        raw = base64.b64decode(resp.get("lines", ""))
        return Trajectory(lines=parse_trajectory(raw), raw=raw, next_offset=int(resp.get("nextOffset", 0)),
                          size=int(resp.get("size", 0)), ended=bool(resp.get("ended", False)),
                          sha256=resp.get("sha256", ""))

    async def trajectory(self, id: str, offset: int = 0, *, timeout: Optional[float] = None) -> Trajectory:
        """Sandbox id's trajectory from offset to what is recorded now, in
        as many reads as it takes."""
        raw, t = b"", None
        while True:
            t = await self.read_trajectory(id, offset, timeout=timeout)
            raw += t.raw
            offset = t.next_offset
            if offset >= t.size or not t.raw:
                break
        return Trajectory(lines=parse_trajectory(raw), raw=raw, next_offset=t.next_offset, size=t.size,
                          ended=t.ended, sha256=t.sha256)

    async def replay(self, trajectory: Union[Trajectory, List[Dict[str, Any]], bytes, str], *,
                     env: Optional[str] = None) -> ReplayReport:
        """Run a trajectory's calls in order in a fresh sandbox of the same
        environment (or env) and network rules, and compare each with its
        record: a command's exit code and the SHA-256 of its stdout and
        stderr, another call's success. Calls on the sandbox as a whole
        (pause, resume, snapshot, fork, shell, delete) and calls whose
        arguments were kept only as a hash are skipped. The sandbox is
        deleted at the end. trajectory is a Trajectory, its lines, or its
        JSON lines (bytes or str)."""
        if isinstance(trajectory, Trajectory):
            lines = trajectory.lines
        elif isinstance(trajectory, (bytes, str)):
            lines = parse_trajectory(trajectory)
        else:
            lines = list(trajectory)
        begin = next((l.get("sandbox") for l in lines if l.get("type") == "begin"), None)
        if not begin:
            raise errors.InvalidArgument("replay: the trajectory has no begin line")
        sb = await self.create(env or begin.get("environment", ""), isolation=begin.get("isolation") or None,
                               network_rules=begin.get("network_rules") or None)
        rep = ReplayReport(sandbox=sb.id)
        try:
            for line in lines:
                if line.get("type") != "call":
                    continue
                st = await self._replay_step(sb.id, line)
                if st.verdict == "match":
                    rep.matched += 1
                elif st.verdict == "diverged":
                    rep.diverged += 1
                else:
                    rep.skipped += 1
                rep.steps.append(st)
        finally:
            try:
                await self.delete(sb.id)
            except errors.DsecError:
                pass
        return rep

    async def _replay_step(self, id: str, line: Dict[str, Any]) -> ReplayStep:
        from ._aio import _Collector, _drive  # the exec machinery lives there

        call = line.get("call", "")
        st = ReplayStep(seq=int(line.get("seq", 0)), call=call, verdict="skipped")
        if call not in _REPLAYED:
            st.detail = "not replayed: it acts on the sandbox as a whole"
            return st
        if "args" not in line:
            st.detail = "not replayed: the trajectory kept only a hash of its arguments"
            return st
        method, streams = _REPLAYED[call]
        msg = dict(line["args"])
        msg.pop("sandbox_id", None)
        msg["sandboxId"] = id
        err: Optional[Exception] = None
        res = None
        try:
            if streams:
                stream = await self._t.stream(SANDBOX, method, msg, timeout=600.0)
                res = await _drive(stream, _Collector(), method)
            else:
                await self._call(method, msg, None)
        except errors.DsecError as e:
            err = e
        st.verdict = "match"
        if (err is not None) != bool(line.get("error")):
            st.verdict = "diverged"
            st.detail = f"recorded error {line.get('error', '')!r}, now {err}"
            return st
        if not streams or res is None:
            return st
        st.want_exit, st.got_exit = line.get("exit"), res.exit_code
        st.got_stdout_sha256 = hashlib.sha256(res.stdout_bytes).hexdigest()
        st.got_stderr_sha256 = hashlib.sha256(res.stderr_bytes).hexdigest()
        st.want_stdout_sha256 = (line.get("stdout") or {}).get("sha256", _EMPTY)
        st.want_stderr_sha256 = (line.get("stderr") or {}).get("sha256", _EMPTY)
        diffs = []
        if st.want_exit != st.got_exit:
            diffs.append(f"exit {st.want_exit}, now {st.got_exit}")
        if st.want_stdout_sha256 != st.got_stdout_sha256:
            diffs.append("stdout differs")
        if st.want_stderr_sha256 != st.got_stderr_sha256:
            diffs.append("stderr differs")
        if diffs:
            st.verdict = "diverged"
            st.detail = "; ".join(diffs)
        return st
