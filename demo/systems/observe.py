"""The systems task's end state, as JSON on stdout: what the trainer reads
out of a sandbox (as root) once the candidate's script has run. It only
looks; check.py, run through FnCall, decides what the state earns."""

import json
import os
import socket
import subprocess


def run(*argv):
    r = subprocess.run(argv, capture_output=True, text=True)
    return {"rc": r.returncode, "out": r.stdout, "err": r.stderr[-300:]}


def run_json(*argv):
    r = run(*argv)
    try:
        return json.loads(r["out"]) if r["rc"] == 0 else None
    except ValueError:
        return None


def probe(port):
    """A TCP connect from here to lab's address: refused means the SYN got
    in (nothing listens), timeout that something dropped it."""
    s = socket.socket()
    s.settimeout(1.0)
    try:
        s.connect(("198.18.100.2", port))
        return "open"
    except ConnectionRefusedError:
        return "refused"
    except socket.timeout:
        return "timeout"
    except OSError as e:
        return "error: " + (e.strerror or str(e))
    finally:
        s.close()


def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


netns = sorted(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else []
state = {
    "modules": [line.split()[0] for line in open("/proc/modules")],
    "mounts": [line.split()[:4] for line in open("/proc/mounts")],
    "hello": read("/mnt/data/hello"),
    "netns": netns,
    "addr": run_json("ip", "-j", "addr"),
    "lab_addr": run_json("ip", "-n", "lab", "-j", "addr") if "lab" in netns else None,
    "lab_nft": run_json("ip", "netns", "exec", "lab", "nft", "-j", "list", "ruleset") if "lab" in netns else None,
    "probe": {str(p): probe(p) for p in (23, 24)},
}
print(json.dumps(state))
