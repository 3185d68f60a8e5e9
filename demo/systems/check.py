"""The systems task's checker: reads state.json (observe.py's output),
writes result.json (and stdout) with each check and the reward, 1 when the
end state is the task's (TASK.md) and 0 otherwise, and the reward to
$DSEC_REWARD_FILE: run in a clean room by dsec's grade, as the coding
batch's grader is."""

import json
import os
import sys


def addr_of(links, name):
    for link in links or []:
        if link.get("ifname") == name:
            up = "UP" in link.get("flags", [])
            addrs = [f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", []) if a.get("family") == "inet"]
            return up, addrs
    return False, []


def nft_drops_23(ruleset):
    """Table inet guard has an input chain hooked on input, with a rule
    matching TCP destination port 23 and dropping."""
    items = (ruleset or {}).get("nftables", [])
    chains = [i["chain"] for i in items if "chain" in i and i["chain"].get("table") == "guard"
              and i["chain"].get("family") == "inet" and i["chain"].get("hook") == "input"]
    for rule in (i["rule"] for i in items if "rule" in i):
        if rule.get("table") != "guard" or rule.get("chain") not in {c["name"] for c in chains}:
            continue
        exprs = rule.get("expr", [])
        port = any(e.get("match", {}).get("left", {}).get("payload", {}).get("field") == "dport"
                   and e["match"].get("right") == 23 for e in exprs)
        if port and any("drop" in e for e in exprs):
            return True
    return False


def main(state_path, result_path):
    s = json.load(open(state_path))
    mounts = {m[1]: m for m in s["mounts"]}
    scratch = mounts.get("/mnt/scratch")
    data = mounts.get("/mnt/data")
    lab0_up, lab0 = addr_of(s["addr"], "lab0")
    eth0_up, eth0 = addr_of(s["lab_addr"], "eth0")
    checks = {
        "modules": all(m in s["modules"] for m in ("veth", "nf_tables", "loop")),
        "tmpfs": bool(scratch) and scratch[2] == "tmpfs" and "size=16384k" in scratch[3].split(","),
        "loop_ext4": bool(data) and data[2] == "ext4" and data[0].startswith("/dev/loop"),
        "hello": (s["hello"] or "").strip() == "ok",
        "netns": "lab" in s["netns"],
        "veth": lab0_up and "198.18.100.1/30" in lab0 and eth0_up and "198.18.100.2/30" in eth0,
        "nft_rule": nft_drops_23(s["lab_nft"]),
        # The rule works: port 23 dropped, port 24 reaches lab (refused).
        "firewall": s["probe"] == {"23": "timeout", "24": "refused"},
    }
    failed = [k for k, ok in checks.items() if not ok]
    result = {"checks": checks, "failed": failed, "reward": 0.0 if failed else 1.0}
    json.dump(result, open(result_path, "w"))
    if os.environ.get("DSEC_REWARD_FILE"):
        with open(os.environ["DSEC_REWARD_FILE"], "w") as f:
            f.write(f"{result['reward']}\n")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
