"""An in-memory imitation of dsecd's SandboxService on top of FakeServer,
enough for protocol, concurrency and compat tests without a daemon."""

import hashlib
import itertools
import json
import shlex
import threading

from fakeconnect import FakeServer, b64


_NOT_SHAPE = ("labels", "ttlSeconds", "idleTimeoutSeconds")


def _shape_key(spec):
    shape = {k: v for k, v in spec.items() if k not in _NOT_SHAPE}
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()


class FakeDsecd:
    def __init__(self, unix_path=None):
        self.server = FakeServer(unix_path=unix_path)
        self.lock = threading.Lock()
        self.sandboxes = {}
        self.keys = {}
        self.creates = 0
        self.ids = itertools.count(1)
        self.pools = {}
        for m in ("Create", "Get", "List", "Delete", "Exec", "ReadFile", "WriteFile", "SetWarmPool",
                  "ListWarmPools"):
            self.server.route(m, getattr(self, m.lower()))
        self.server.route("ListLayers", lambda c: c.reply({"layers": []}), service="dsec.v1.LayerService")

    @property
    def addr(self):
        return self.server.addr

    def close(self):
        self.server.close()

    def create(self, call):
        key = call.msg.get("idempotencyKey", "")
        with self.lock:
            self.creates += 1
            if key and key in self.keys:
                call.reply({"sandboxes": [self.sandboxes[i] for i in self.keys[key]]})
                return
            out = []
            for _ in range(int(call.msg.get("count", 1) or 1)):
                sid = "sb-fake-%06d" % next(self.ids)
                sb = {"id": sid, "node": "fake", "spec": call.msg.get("spec", {}), "state": "STATE_RUNNING",
                      "createdUnixMs": "1700000000000", "files": {}}
                pool = self.pools.get(_shape_key(sb["spec"]))
                if pool is not None:
                    # The fake's pools refill at once, so a pool of size > 0 is never empty.
                    pool["taken"] = str(int(pool["taken"]) + 1)
                    sb["fromWarmPool"] = True
                self.sandboxes[sid] = sb
                out.append(sb)
            if key:
                self.keys[key] = [s["id"] for s in out]
        call.reply({"sandboxes": out})

    def setwarmpool(self, call):
        spec = call.msg.get("spec", {})
        size = int(call.msg.get("size", 0))
        if not spec.get("environment"):
            call.error("invalid_argument", "spec.environment is required (BASE[+LAYER...])")
            return
        if spec.get("networkRules"):
            call.error("invalid_argument", "warm pools hold sandboxes without network rules")
            return
        key = _shape_key(spec)
        shape = {k: v for k, v in spec.items() if k not in _NOT_SHAPE}
        with self.lock:
            pool = self.pools.get(key) or {"key": key, "node": "fake", "spec": shape, "taken": "0", "missed": "0"}
            pool = dict(pool, size=size, ready=size)
            if size == 0:
                self.pools.pop(key, None)
            else:
                self.pools[key] = pool
        call.reply(pool)

    def listwarmpools(self, call):
        with self.lock:
            call.reply({"pools": list(self.pools.values())})

    def _sb(self, call, id_field="sandboxId"):
        sid = call.msg.get(id_field, "")
        with self.lock:
            sb = self.sandboxes.get(sid)
        if sb is None:
            call.error("not_found", f"sandbox {sid}: not found")
        elif sb["state"] != "STATE_RUNNING":
            call.error("failed_precondition", f"sandbox {sid} is stopped (deleted): deleted by request")
            return None
        return sb

    def get(self, call):
        sb = self._sb(call, "id")
        if sb:
            call.reply(sb)

    def list(self, call):
        labels = call.msg.get("labels", {})
        states = call.msg.get("states", [])
        if not states and not call.msg.get("all"):
            states = ["STATE_CREATING", "STATE_RUNNING", "STATE_STOPPING"]  # as dsecd: the live ones
        with self.lock:
            out = [s for s in self.sandboxes.values()
                   if all(s["spec"].get("labels", {}).get(k) == v for k, v in labels.items())
                   and (not states or s["state"] in states)]
        call.reply({"sandboxes": out})

    def delete(self, call):
        with self.lock:
            sb = self.sandboxes.get(call.msg.get("id", ""))
            if sb:
                sb["state"] = "STATE_STOPPED"
                sb["reason"] = "REASON_DELETED"
        call.reply({})

    def exec(self, call):
        sb = self._sb(call)
        if not sb:
            return
        argv = call.msg.get("argv") or shlex.split(call.msg.get("command", ""))
        call.send({"started": {"processId": "p1", "pid": 42}})
        code = 0
        if argv[:1] == ["echo"]:
            call.send({"stdout": b64(" ".join(argv[1:]) + "\n")})
        elif argv[:1] == ["exit"]:
            code = int(argv[1])
        elif argv[:1] == ["cat"]:
            call.send({"stdout": call.msg.get("stdin", "")})
        ex = {"status": "EXIT_STATUS_OK" if code == 0 else "EXIT_STATUS_NONZERO", "durationSeconds": 0.001}
        if code:
            ex["exitCode"] = code
        call.send({"exited": ex})
        call.end()

    def readfile(self, call):
        sb = self._sb(call)
        if sb:
            data = sb["files"].get(call.msg["path"])
            if data is None:
                call.error("not_found", "open %s: no such file" % call.msg["path"])
            else:
                call.reply({"data": data, "size": "%d" % len(data)})

    def writefile(self, call):
        sb = self._sb(call)
        if sb:
            sb["files"][call.msg["path"]] = call.msg.get("data", "")
            call.reply({"written": "1"})
