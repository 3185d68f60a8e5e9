"""dsec's main job: a batch of RL-style rollouts in real container sandboxes.

Each rollout starts a sandbox from a layered environment (a Debian base with
Python, a workspace holding a small project whose median() is wrong for
even-length lists, and a toolkit holding the grader), applies one candidate
patch (standing in for a policy's action), grades it in a clean room and
deletes the sandbox. The grade (dsec's Grade, docs/grading.md) captures
only the patched package (/project/textstats), starts a fresh sandbox from
the same layers with that capture, the project's tests and the grader laid
on top from the trusted copy on this host (so a patch that edits the tests,
adds a conftest or replaces the interpreter earns nothing), no network,
none of the rollout's processes, and runs the grader there as nobody; the
reward is the number the grader writes to the reward file, never anything
the code printed.

Midway the trainer is preempted (as GPU jobs are): it pauses every sandbox
of the batch by label, which freezes them and releases their memory, and
resumes them a moment later; rollouts caught mid-command carry on where
they were.

At the end it prints what the batch cost, from dsec's cost ledger
(docs/usage.md): every rollout's sandbox is labelled with the run and its
candidate patch, and the ledger's sums by label:patch say what each
candidate's rollouts used (CPU-seconds, memory GiB-seconds, the writable
layer at its largest, egress), the run's total beside them, as a lab prices
a task.

The trainer follows the project's lifecycle events as they come (dsec's
FollowEvents, docs/events.md), as a real one would to learn of a sandbox
OOM-killed, expired by its TTL or lost with its node without polling each
one, and reports them at the end: each kind counted, every failure and
expiry with its reason.

With --systems-env, a batch of systems tasks runs beside the coding batch,
in microVMs: tasks a container forbids (a network namespace with a veth
pair and nftables rules, a tmpfs and a loop file system, kernel modules),
graded the same way (demo/systems_batch.py). It is part of the same job:
the preemption waits for one of its tasks to be running and pauses its
microVMs with the containers (to disk: QEMU ends), and the tasks caught
mid-command carry on after the resume.

    python3 demo/rollout.py --env BASE+WORKSPACE+TOOLKIT [-n 32] [--no-preempt]
        [--systems-env BASE+MODULES+TASK [--systems 4] [--systems-concurrency 2]]
"""

import argparse
import asyncio
import dataclasses
import collections
import json
import os
import statistics
import sys
import time

import libdsec
from libdsec import AsyncClient

import systems_batch

HERE = os.path.dirname(os.path.abspath(__file__))
PATCHES = sorted(
    os.path.join(HERE, "patches", p) for p in os.listdir(os.path.join(HERE, "patches")) if p.endswith(".patch")
)
PRISTINE_TESTS = os.path.join(HERE, "workspace", "project", "tests")
GRADER = os.path.join(HERE, "toolkit", "opt", "dsec-harness", "grade.py")
# What the clean room keeps of a rollout's sandbox: the package a patch is
# meant to change. The tests, the grader and everything else come from the
# environment's layers and the trusted files below.
WORKSPACE = ["/project/textstats"]
GRADE = "python3 /opt/dsec-harness/grade.py /project /tmp/result.json"


def trusted_files():
    """The grader and the project's tests, from this host, at their paths
    in the clean room."""
    files = {"/opt/dsec-harness/grade.py": open(GRADER, "rb").read()}
    for dirpath, _, names in os.walk(PRISTINE_TESTS):
        for n in names:
            if n.endswith(".py"):
                full = os.path.join(dirpath, n)
                files["/project/tests/" + os.path.relpath(full, PRISTINE_TESTS)] = open(full, "rb").read()
    return files


def last_json(text):
    """The grader's result: the last line of its stdout that is a JSON
    object (for the table; the reward is the reward file's)."""
    for line in reversed(text.splitlines()):
        try:
            v = json.loads(line)
        except ValueError:
            continue
        if isinstance(v, dict):
            return v
    return {}


def pct(values, q):
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * len(s))) - 1))]


class Progress:
    """One status line, redrawn as rollouts finish."""

    def __init__(self, total):
        self.total, self.done, self.started, self.reward = total, 0, 0, 0.0
        self.applied = 0  # rollouts whose patch is applied (their sandboxes at work)
        self.tty = sys.stdout.isatty()
        self.t0 = time.monotonic()

    def draw(self, note=""):
        width = 30
        filled = int(width * self.done / self.total)
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} done, "
                f"{self.started - self.done} running, mean reward {self.reward / max(1, self.done):.2f}, "
                f"{time.monotonic() - self.t0:.1f}s {note}")
        if self.tty:
            print("\r" + line.ljust(110), end="", flush=True)
        else:
            print(line, flush=True)


# The systems batch's labels: the same job as the coding batch's, so the
# preemption pauses its microVMs too (each saved to disk, its QEMU ended and
# all its memory out of the host's RAM, resumed in a new QEMU); a command
# running in a VM as it pauses carries on after the resume, its stream open,
# as a frozen container's does.
SYSTEMS_LABELS = {"job": "dsec-demo", "batch": "systems"}

# What every rollout's sandbox asks for; a warm pool of this shape serves them.
# Rollouts are best-effort work: under SCHED_IDLE (docs/qos.md) they take
# only the CPU nothing latency-sensitive wants, here the clean rooms that
# grade them, which run at the latency class since the trainer waits on
# their rewards. --qos latency runs them at the latency class too: on a
# machine busy with other work, best-effort rollouts wait for all of it.
SHAPE = {"memory_mb": 256, "cpus": 0.5, "qos": "best_effort"}


async def fill_warm_pool(client, args):
    """Keeps args.warm_pool sandboxes of the rollouts' shape started, and
    waits (up to a minute) until they are."""
    await client.set_warm_pool(args.env, args.warm_pool, **SHAPE)
    deadline = time.monotonic() + 60
    while True:
        pools = [p for p in await client.warm_pools() if p.environment == args.env]
        ready = pools[0].ready if pools else 0
        print(f"\rwarm pool: {ready}/{args.warm_pool} sandboxes started", end="", flush=True)
        if ready >= args.warm_pool or time.monotonic() > deadline:
            print()
            return
        await asyncio.sleep(0.2)


async def rollout(client, args, i, progress, sem):
    patch_path = PATCHES[i % len(PATCHES)]
    name = os.path.basename(patch_path)[: -len(".patch")]
    row = {"rollout": i, "patch": name, "applied": False, "passed": 0, "total": 0, "reward": 0.0,
           "create_ms": 0.0, "score_ms": 0.0, "grade_ms": {}, "warm": False, "node": "", "exec_ms": [], "error": "", "note": "",
           "masked": "", "sandbox": ""}
    async with sem:
        progress.started += 1
        t0 = time.monotonic()
        try:
            sb = await client.create(args.env, **SHAPE, ttl_s=600, timeout=120,
                                     labels={"job": "dsec-demo", "rollout": str(i), "run": RUN, "patch": name})
        except libdsec.DsecError as exc:
            if not exc.infra_fault:
                raise
            row["masked"] = exc.infra_fault  # no room, a start that timed out: not the policy's doing
            progress.done += 1
            return row
        row["create_ms"] = (time.monotonic() - t0) * 1000
        row["warm"] = sb.from_warm_pool
        row["node"] = sb.node
        row["sandbox"] = sb.id
        try:
            async def run(cmd, timeout=60):
                t = time.monotonic()
                res = await sb.exec(cmd, timeout=timeout)
                row["exec_ms"].append((time.monotonic() - t) * 1000)
                return res

            with open(patch_path, "rb") as f:
                await sb.write_file("/tmp/candidate.patch", f.read())
            res = await run("cd /project && patch -p1 --batch < /tmp/candidate.patch")
            row["applied"] = res.exit_code == 0
            progress.applied += 1
            # The policy looks at its work the way an agent would, by running
            # the project's tests in its sandbox: an observation, not the
            # reward (a patch may have edited these tests).
            await run("cd /project && python3 -m unittest -q 2>&1 | tail -1", timeout=120)
            # The reward, graded in a clean room while the sandbox still
            # runs: only /project/textstats is taken from it.
            t = time.monotonic()
            g = await sb.grade(WORKSPACE, command=GRADE, tests=trusted_files(),
                               tests_paths=["/project/tests"], grader_timeout=60, timeout=180)
            row["score_ms"] = (time.monotonic() - t) * 1000
            row["grade_ms"] = g.times
            result = last_json(g.stdout)
            if g.status != "ok" or not result:
                raise RuntimeError(f"the grader failed ({g.status}, exit {g.exit_code}): {g.stderr[-200:]}")
            score_result(row, result)
            row["reward"] = g.reward  # the reward file's, never what the code printed
        except Exception as exc:  # one broken rollout must not stop the batch
            mask_or_fail(row, exc)
        finally:
            await sb.delete()
    progress.done += 1
    progress.reward += row["reward"]
    progress.draw()
    return row


def mask_or_fail(row, exc):
    """Record what ended a rollout: the platform's fault masks it (the
    trainer leaves it out of the batch rather than scoring it 0), anything
    else is an error."""
    fault = getattr(exc, "infra_fault", None)
    if fault:
        row["masked"] = fault
    else:
        row["error"] = f"{type(exc).__name__}: {exc}"


def score_result(row, result):
    """Set the row's reward from the grader's result.json."""
    row["passed"], row["total"] = result["passed"], result["total"]
    if result["load_error"]:
        row["note"] = "tests did not load"
    elif result["total"] == 0:
        raise RuntimeError("the grader found no tests")
    else:
        row["reward"] = result["passed"] / result["total"]


async def preempt(client, progress, args, report, systems_state):
    """Once a quarter of the batch has applied its patch (and, with a
    systems batch, once one of its microVMs runs its task, or that batch
    is done), pause every sandbox of the job (the trainer's preemption),
    hold a second, and resume them."""
    while progress.applied < max(1, args.rollouts // 4):
        await asyncio.sleep(0.05)
    if systems_state is not None:
        while not systems_state["in_task"] and not systems_state["done"]:
            await asyncio.sleep(0.05)
    t0 = time.monotonic()
    report["t0"] = t0
    paused = await client.pause_all({"job": "dsec-demo"})
    report["paused"] = len(paused)
    report["paused_vms"] = sum(1 for sb in paused if (sb.info.get("spec") or {}).get("isolation") == "ISOLATION_MICROVM")
    report["pause_s"] = time.monotonic() - t0
    report["released_mib"] = sum(int((sb.info.get("lastPause") or {}).get("releasedBytes", 0)) for sb in paused) / (1 << 20)
    progress.draw(f"(preempted: {len(paused)} sandboxes paused)")
    await asyncio.sleep(1.0)
    t1 = time.monotonic()
    report["resumed"] = len(await client.resume_all({"job": "dsec-demo"}))
    report["resume_s"] = time.monotonic() - t1
    report["t1"] = time.monotonic()


async def follow_events(client, since, seen, problems):
    """Collect the project's lifecycle events from since on, as they are
    stored, until cancelled: the trainer learns of failures and expiries
    (with their reasons) from the stream instead of polling sandboxes."""
    try:
        async for ev in client.follow_events(since=since):
            seen.append(ev)
    except libdsec.DsecError as exc:
        problems.append(str(exc))


async def stop_following(task, seen, rows):
    """Wait (a few seconds at most) until the stream brought every
    rollout's delete (its node saw it; the store has it about 0.3 s later),
    then stop following."""
    ours = {r["sandbox"] for r in rows if r["sandbox"]}
    deadline = time.monotonic() + 5
    while not task.done() and time.monotonic() < deadline:
        if ours <= {e.sandbox_id for e in seen if e.kind == "deleted"}:
            break
        await asyncio.sleep(0.1)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


# Names this run in its sandboxes' labels, for the cost ledger's sums.
RUN = f"demo-{int(time.time())}"


async def batch_cost(client, since, want):
    """What the run's sandboxes used, by candidate patch and in all, from
    the cost ledger; the last figures of the sandboxes deleted last reach
    it within a pull or two, so it waits (up to 10 s) for want of them."""
    deadline = time.monotonic() + 10
    while True:
        by_run = await client.usage(by="label:run", since=since)
        run = by_run.groups.get(RUN)
        if (run and run.sandboxes >= want) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.25)
    by_patch = await client.usage(by="label:patch", since=since)
    patches = {k: u for k, u in by_patch.groups.items() if k}
    return patches, run


def print_cost(patches, run):
    """The batch's cost by candidate patch, as `dsec usage --by label:patch`
    would print it, and the run's total."""
    if run is None:
        print("cost: the ledger has no figures for this run (dsecd --no-ledger?)")
        return
    print(f"cost by patch (the cost ledger; dsec usage --by label:patch --since 1h):")
    print(f"  {'patch':<22} {'sandboxes':>9} {'CPU-s':>7} {'GiB-s':>7} {'disk peak':>10} {'egress':>8}")
    for name in sorted(patches):
        u = patches[name]
        print(f"  {name:<22} {u.sandboxes:>9} {u.cpu_seconds:>7.2f} {u.memory_gib_seconds:>7.3f} "
              f"{u.disk_peak_bytes / 2**20:>8.1f}Mi {u.egress_bytes:>8}")
    print(f"  {'run ' + RUN:<22} {run.sandboxes:>9} {run.cpu_seconds:>7.2f} {run.memory_gib_seconds:>7.3f} "
          f"{run.disk_peak_bytes / 2**20:>8.1f}Mi {run.egress_bytes:>8}"
          f"  ({run.cpu_seconds / max(1, run.sandboxes):.2f} CPU-s a rollout; clean rooms and the warm pool not counted)")


def print_events(seen, problems, rows):
    """The events the trainer followed: each kind counted, the batch's own
    sandboxes apart, and every failure and expiry with its reason."""
    if problems:
        print(f"events: not followed ({problems[0]})")
        return
    kinds = collections.Counter(e.kind for e in seen)
    ours = {r["sandbox"] for r in rows if r["sandbox"]}
    mine = collections.Counter(e.kind for e in seen if e.sandbox_id in ours)
    order = ["created", "paused", "resumed", "phase_ended", "forked", "snapshot", "deleted", "expired", "failed"]
    fmt = lambda c: ", ".join(f"{k} {c[k]}" for k in order if c[k]) or "none"
    print(f"events, followed as they came: {fmt(kinds)} "
          f"(the rollouts' own {len(ours)} sandboxes: {fmt(mine)}; the rest: clean rooms, microVMs)")
    bad = [e for e in seen if e.kind in ("failed", "expired")]
    if not bad:
        print("  no sandbox failed or expired")
    for e in bad[:10]:
        print(f"  {e.kind} {e.sandbox_id} ({e.reason}): {e.message}")


async def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", required=True, help="BASE[+LAYER...] environment")
    ap.add_argument("-n", "--rollouts", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=32, help="sandboxes alive at once")
    ap.add_argument("--addr", default=None, help="dsecd address (default $DSEC_ADDR)")
    ap.add_argument("--json", action="store_true",
                    help='print the rows as JSON at the end: {"coding": rows, "systems": report or null, "events": {kind: count}, "cost": {patch: usage}}')
    ap.add_argument("--warm-pool", type=int, default=8,
                    help="sandboxes of the rollouts' shape kept started beforehand (0: none)")
    ap.add_argument("--no-preempt", action="store_true",
                    help="do not pause and resume the batch midway")
    ap.add_argument("--systems-env", default=None,
                    help="environment of the systems batch in microVMs (none: no systems batch)")
    ap.add_argument("--systems", type=int, default=4, help="rollouts of the systems batch")
    ap.add_argument("--systems-concurrency", type=int, default=2,
                    help="microVMs alive at once (each boot takes a core for seconds under TCG)")
    ap.add_argument("--qos", choices=["best_effort", "latency"], default="best_effort",
                    help="CPU class of the rollouts, both batches (the clean rooms grading them are latency)")
    args = ap.parse_args()
    SHAPE["qos"] = systems_batch.VM_SHAPE["qos"] = args.qos

    async with AsyncClient(args.addr) as client:
        await client.reap(labels={"job": "dsec-demo"})  # orphans of an interrupted earlier run
        seen, problems = [], []
        t_start = time.time() - 1
        events_task = asyncio.create_task(follow_events(client, t_start, seen, problems))
        if args.warm_pool > 0:
            await fill_warm_pool(client, args)
        try:
            pre = {}
            # The systems batch runs beside the coding batch, in the same
            # job: the preemption pauses its microVMs too (SYSTEMS_LABELS).
            sys_task, sys_state = None, None
            if args.systems_env:
                sys_state = {"up": 0, "in_task": 0, "done": False}
                sys_task = asyncio.create_task(systems_batch.run(
                    client, args.systems_env, args.systems, args.systems_concurrency,
                    SYSTEMS_LABELS, sys_state))
                # MicroVMs boot for seconds (under TCG), containers in
                # milliseconds: the coding batch starts once the first VM
                # is up, so the preemption finds both batches at work.
                print(f"systems batch: {args.systems} microVMs of {args.systems_env}; the coding batch starts once the first is up")
                while not sys_state["up"] and not sys_state["done"]:
                    await asyncio.sleep(0.05)
            progress = Progress(args.rollouts)
            sem = asyncio.Semaphore(args.concurrency)
            t0 = time.monotonic()
            print(f"{args.rollouts} rollouts over {len(PATCHES)} candidate patches in {args.env}")
            pre_task = None if args.no_preempt else asyncio.create_task(preempt(client, progress, args, pre, sys_state))
            rows = await asyncio.gather(*(rollout(client, args, i, progress, sem) for i in range(args.rollouts)))
            wall = time.monotonic() - t0
            systems = await sys_task if sys_task is not None else None
            if pre_task is not None:
                if not pre_task.done():
                    pre_task.cancel()
                try:
                    await pre_task
                except asyncio.CancelledError:
                    pass
        finally:
            if args.warm_pool > 0:
                await client.set_warm_pool(args.env, 0, **SHAPE)
        left = await client.list(labels={"job": "dsec-demo"}, states=["running", "creating"])
        await stop_following(events_task, seen, rows)
        patches, run_cost = await batch_cost(client, t_start, sum(1 for r in rows if r["sandbox"]))
    print()
    print()
    print(f"{'#':>3}  {'patch':<22} {'applied':<8} {'tests':>7}  {'reward':>6}  {'create':>8}  note")
    for r in rows:
        print(f"{r['rollout']:>3}  {r['patch']:<22} {str(r['applied']).lower():<8} "
              f"{r['passed']:>3}/{r['total']:<3}  {r['reward']:>6.2f}  {r['create_ms']:>6.0f}ms  "
              f"{(r['error'] or (r['masked'] and 'masked: ' + r['masked']) or r['note'])[:60]}")
    creates = [r["create_ms"] for r in rows if r["create_ms"]]
    execs = [e for r in rows for e in r["exec_ms"]]
    # Rollouts the platform ended are masked: left out, never scored 0.
    scored = [r for r in rows if not r["masked"]]
    masked = collections.Counter(r["masked"] for r in rows if r["masked"])
    print()
    if masked:
        print("masked (infrastructure faults, left out of the rewards): " +
              ", ".join(f"{f} {n}" for f, n in sorted(masked.items())))
    print("per patch: " + ", ".join(
        f"{p}={statistics.mean(r['reward'] for r in scored if r['patch'] == p):.2f}"
        for p in sorted({r["patch"] for r in scored})))
    nodes = collections.Counter(r["node"] for r in rows if r["node"])
    if len(nodes) > 1:
        print("sandboxes per node: " + ", ".join(f"{n} {c}" for n, c in sorted(nodes.items())))
    print(f"create latency: p50 {pct(creates, .5):.0f} ms, p90 {pct(creates, .9):.0f} ms, p99 {pct(creates, .99):.0f} ms")
    warm = [r["create_ms"] for r in rows if r["warm"]]
    if warm:
        print(f"  {len(warm)} of {len(rows)} creates taken from the warm pool: p50 {pct(warm, .5):.0f} ms; "
              f"the others started a container: p50 {pct([r['create_ms'] for r in rows if r['create_ms'] and not r['warm']], .5):.0f} ms")
    print(f"exec latency:   p50 {pct(execs, .5):.0f} ms, p90 {pct(execs, .9):.0f} ms, p99 {pct(execs, .99):.0f} ms")
    scores = [r["score_ms"] for r in rows if r["score_ms"]]
    if scores:
        parts = {k: pct([r["grade_ms"].get(k + "_ms", 0) for r in rows if r["grade_ms"]], .5)
                 for k in ("capture", "start", "grader")}
        print(f"rewards graded in clean rooms: {len(scores)} grades, p50 {pct(scores, .5):.0f} ms, "
              f"p90 {pct(scores, .9):.0f} ms (p50 capture {parts['capture']:.0f} ms, start {parts['start']:.0f} ms, "
              f"grader {parts['grader']:.0f} ms)")
    if pre.get("paused"):
        vms = ""
        if systems is not None and pre.get("t1"):
            # A task that began before the pause and ended after the resume
            # ran across it, its exec stream open throughout.
            across = sum(1 for r in systems["rows"] if r["task_start"] and r["task_start"] < pre["t0"] < pre["t1"] < r["task_end"])
            vms = f" ({pre['paused_vms']} microVMs among them, {across} mid-task)"
        print(f"preemption: {pre['paused']} sandboxes paused{vms} in {pre['pause_s']:.2f}s, releasing "
              f"{pre['released_mib']:.0f} MiB; {pre['resumed']} resumed in {pre['resume_s']:.2f}s, and their rollouts carried on")
    print(f"{len(rows)} rollouts in {wall:.1f}s; errors: {sum(1 for r in rows if r['error'])}; "
          f"sandboxes left running: {len(left)}")
    print_events(seen, problems, rows)
    print_cost(patches, run_cost)
    sys_errors = False
    if systems is not None:
        systems_batch.print_report(systems, pct)
        sys_errors = any(r["error"] for r in systems["rows"])
    if args.json:
        print(json.dumps({"coding": rows, "systems": systems,
                          "events": dict(collections.Counter(e.kind for e in seen)),
                          "cost": {k: dataclasses.asdict(u) for k, u in patches.items()}}))
    return 1 if any(r["error"] for r in rows) or left or sys_errors else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
