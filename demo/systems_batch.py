"""The demo's systems batch: tasks a container forbids, in microVMs.

A training loop for agents that administer machines gives each rollout a
task a shared kernel cannot be trusted with: its own network namespace
with a veth pair and nftables rules, a tmpfs and a loop-mounted ext4 file
system, kernel modules loaded (demo/systems/layer/task/TASK.md). In a
container these are refused (no CAP_SYS_ADMIN, no CAP_NET_ADMIN over the
node's kernel, no module loading); in a microVM the sandbox's root is root
of a kernel of its own, and whatever it does to that kernel stays in the VM.

Each rollout creates a microVM sandbox from the systems environment (the
Debian base with ip, nft and modprobe, the guest kernel's modules as a
layer, the task), runs one candidate script (a policy's action), records
the end state in the VM (observe.py, as root, to /observed/state.json),
grades it in a clean room as the coding batch's is, and deletes the VM.
The grade captures only /observed out of the microVM (through fuse2fs) and
runs the trusted checker (check.py, laid pristine) over it in a container
of the same layers (the state is a file: no kernel of its own is needed to
read it), with no network, as nobody; 1 when the end state is the task's,
else 0.
"""

import asyncio
import json
import os
import time

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "systems")
CANDIDATES = sorted(
    os.path.join(HERE, "candidates", c) for c in os.listdir(os.path.join(HERE, "candidates")) if c.endswith(".sh")
)
# The clean room's grader: the trusted checker over the observed state.
CHECK = "python3 /opt/dsec-check/check.py /observed/state.json /tmp/result.json"
# What every microVM asks for: a guest of 256 MiB, one vCPU; best-effort,
# as the coding batch's rollouts are (its QEMU under SCHED_IDLE), while
# the clean rooms that grade them run at the latency class.
VM_SHAPE = {"memory_mb": 256, "cpus": 1, "qos": "best_effort"}


def _read(name):
    with open(os.path.join(HERE, name), "rb") as f:
        return f.read()


def accelerator(nodes):
    """The accelerator the microVMs run under (kvm or tcg), or None and why
    no node offers microVMs."""
    reasons = []
    for node in nodes:
        for kind in node.get("kinds", []):
            if kind.get("isolation") == "ISOLATION_MICROVM":
                return kind.get("accelerator") or "unknown", ""
        missing = node.get("missing", {})
        reasons.append(f"{node.get('name', '?')}: {missing.get('microvm') or missing.get('ISOLATION_MICROVM') or missing}")
    return None, "; ".join(reasons) or "no nodes"


async def container_refuses(client, env, labels):
    """Runs the first candidate (a whole solution) once in a container of
    the same environment and returns its first complaint."""
    sb = await client.create(env, isolation="container", **VM_SHAPE, ttl_s=300, labels=labels, timeout=120)
    try:
        await sb.write_file("/tmp/solution.sh", open(CANDIDATES[0], "rb").read())
        res = await sb.exec("sh /tmp/solution.sh", timeout=60)
    finally:
        await sb.delete()
    if res.exit_code == 0:
        return "nothing: the whole task ran in a container (this node's containers are not confined)"
    lines = [ln for ln in (res.stderr or res.stdout).splitlines() if ln.strip()]
    return f"{lines[0] if lines else 'no message'} (exit {res.exit_code})"


async def rollout(client, env, i, sem, labels, state):
    path = CANDIDATES[i % len(CANDIDATES)]
    row = {"rollout": i, "candidate": os.path.basename(path)[: -len(".sh")], "reward": 0.0, "failed": [],
           "create_ms": 0.0, "task_ms": 0.0, "score_ms": 0.0, "exit": None, "error": "",
           "task_start": 0.0, "task_end": 0.0}
    async with sem:
        t0 = time.monotonic()
        sb = await client.create(env, isolation="microvm", **VM_SHAPE, ttl_s=600,
                                 labels={**labels, "rollout": f"sys-{i}"}, timeout=180)
        row["create_ms"] = (time.monotonic() - t0) * 1000
        state["up"] += 1
        try:
            await sb.write_file("/tmp/solution.sh", open(path, "rb").read())
            await sb.write_file("/tmp/observe.py", _read("observe.py"))
            t = time.monotonic()
            row["task_start"] = t
            state["in_task"] += 1  # the trainer's preemption may come now (rollout.py)
            try:
                res = await sb.exec("sh /tmp/solution.sh", timeout=120)
            finally:
                state["in_task"] -= 1
            row["task_end"] = time.monotonic()
            row["task_ms"] = (row["task_end"] - t) * 1000
            row["exit"] = res.exit_code
            obs = await sb.exec("mkdir -p /observed && python3 /tmp/observe.py > /observed/state.json", timeout=60)
            if obs.exit_code != 0:
                raise RuntimeError(f"observe.py exited {obs.exit_code}: {obs.stderr[-200:]}")
            t = time.monotonic()
            g = await sb.grade(["/observed"], command=CHECK, tests={"/opt/dsec-check/check.py": _read("check.py")},
                               isolation="container", memory_mb=256, grader_timeout=60, timeout=180)
            row["score_ms"] = (time.monotonic() - t) * 1000
            if g.status != "ok":
                raise RuntimeError(f"the checker failed ({g.status}, exit {g.exit_code}): {g.stderr[-200:]}")
            row["reward"] = g.reward
            row["failed"] = json.loads(g.stdout.strip().splitlines()[-1])["failed"]
        except Exception as exc:  # one broken rollout must not stop the batch
            _mask_or_fail(row, exc)
        finally:
            await sb.delete()
    return row


def _mask_or_fail(row, exc):
    """The platform's fault masks a rollout (left out, never scored 0), and
    masked_by says what the platform answered; anything else is an error."""
    fault = getattr(exc, "infra_fault", None)
    if fault:
        row["masked"] = fault
        row["masked_by"] = f"{type(exc).__name__}: {exc}"
    else:
        row["error"] = f"{type(exc).__name__}: {exc}"


async def run(client, env, n, concurrency, labels, state):
    """The whole batch: the container's refusal, then n microVM rollouts at
    most concurrency at a time. Returns a report for print_report. state
    tells the trainer how many microVMs have started ("up"), how many tasks
    run now ("in_task") and when the batch is over ("done")."""
    report = {"env": env, "n": n, "concurrency": concurrency, "rows": []}
    try:
        report["accelerator"], report["missing"] = accelerator(await client.nodes())
        if report["accelerator"] is None:
            return report
        t0 = time.monotonic()
        report["refusal"] = await container_refuses(client, env, labels)
        sem = asyncio.Semaphore(concurrency)
        report["rows"] = await asyncio.gather(*(rollout(client, env, i, sem, labels, state)
                                                for i in range(n)))
        report["wall_s"] = time.monotonic() - t0
        return report
    finally:
        state["done"] = True


def print_report(report, pct):
    """The batch's rewards table and latencies (pct(values, q) as the
    coding batch's)."""
    print()
    if report["accelerator"] is None:
        print(f"systems batch: skipped, no node offers microVMs ({report['missing']})")
        return
    rows = report["rows"]
    print(f"systems batch: {report['n']} tasks a container forbids (netns + veth + nftables, tmpfs, "
          f"loop ext4, modules) in microVMs, {report['concurrency']} at a time, accelerator {report['accelerator']}")
    print(f"container refuses: {report['refusal']}")
    print(f"{'#':>3}  {'candidate':<24} {'exit':>4}  {'reward':>6}  {'create':>8}  {'task':>7}  note")
    for r in rows:
        note = r["error"] or (r.get("masked") and "masked: " + r["masked"]) or ("failed: " + ", ".join(r["failed"]) if r["failed"] else "")
        ex = "-" if r["exit"] is None else str(r["exit"])
        print(f"{r['rollout']:>3}  {r['candidate']:<24} {ex:>4}  {r['reward']:>6.2f}  {r['create_ms']:>6.0f}ms  "
              f"{r['task_ms']:>5.0f}ms  {note[:60]}")
    creates = [r["create_ms"] for r in rows if r["create_ms"]]
    tasks = [r["task_ms"] for r in rows if r["task_ms"]]
    scores = [r["score_ms"] for r in rows if r["score_ms"]]
    scored = [r for r in rows if not r.get("masked")]
    print(f"microVM create latency ({report['accelerator']}): p50 {pct(creates, .5):.0f} ms, "
          f"max {max(creates, default=0):.0f} ms; task script p50 {pct(tasks, .5):.0f} ms")
    if scores:
        print(f"rewards graded in clean rooms (containers): {len(scores)} grades, p50 {pct(scores, .5):.0f} ms; "
              f"mean reward {sum(r['reward'] for r in scored) / max(1, len(scored)):.2f}"
              + (f" ({len(rows) - len(scored)} masked: infrastructure faults)" if len(scored) < len(rows) else ""))
    print(f"{len(rows)} microVM rollouts in {report['wall_s']:.1f}s; errors: {sum(1 for r in rows if r['error'])}")
