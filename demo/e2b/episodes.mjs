// The demo's rollouts as an agent framework built on E2B's SDK runs them
// (open-r1, rLLM and slime have E2B backends): the official `e2b` package,
// unchanged, pointed at dsec by E2B_API_URL, E2B_SANDBOX_URL and
// E2B_API_KEY (`dsec e2b env` prints them). Each episode makes a sandbox
// from the demo's environment, writes its candidate patch, applies it,
// runs the project's tests the way an agent looks at its work (streamed),
// puts the trusted tests back and scores the patch with the grader of the
// toolkit layer. Midway the
// trainer is preempted: every sandbox is paused through E2B's pause call,
// and E2B's connect resumes them; the episodes carry on.
//
//   node demo/e2b/episodes.mjs --template ENV [-n 8] [--json]
import { readFileSync, readdirSync } from 'node:fs'
import { dirname, join, basename } from 'node:path'
import { fileURLToPath } from 'node:url'
import { Sandbox, SandboxNotFoundError } from 'e2b'

const here = dirname(fileURLToPath(import.meta.url))
const patchDir = join(here, '..', 'patches')
const patches = readdirSync(patchDir).filter((p) => p.endsWith('.patch')).sort()
// The project's tests from this host: put back before grading, so a patch
// that edits the tests earns nothing.
const testsDir = join(here, '..', 'workspace', 'project', 'tests')
const trustedTests = readdirSync(testsDir).filter((n) => n.endsWith('.py'))
  .map((n) => ({ path: `/project/tests/${n}`, data: readFileSync(join(testsDir, n), 'utf8') }))

function flag(name, def) {
  const i = process.argv.indexOf(name)
  return i > 0 && i + 1 < process.argv.length ? process.argv[i + 1] : def
}
const template = flag('--template', process.env.E2B_TEMPLATE)
const episodes = Number(flag('-n', '8'))
if (!template) {
  console.error('usage: node episodes.mjs --template ENV [-n EPISODES]')
  process.exit(2)
}

const job = `e2b-demo-${process.pid}`
let applied = 0
let preempted = null

async function episode(i) {
  const name = patches[i % patches.length]
  const row = { episode: i, patch: basename(name, '.patch'), reward: 0, lines: 0, error: '' }
  const t0 = performance.now()
  const sbx = await Sandbox.create(template, { metadata: { job, episode: String(i) }, timeoutMs: 300_000 })
  row.createMs = performance.now() - t0
  try {
    await waitWhilePreempted()
    await sbx.files.write('/tmp/candidate.patch', readFileSync(join(patchDir, name), 'utf8'))
    await waitWhilePreempted()
    const apply = await sbx.commands.run('cd /project && patch -p1 --batch < /tmp/candidate.patch', { user: 'root' })
      .catch((e) => e) // a patch that does not apply exits non-zero: CommandExitError
    row.applied = apply.exitCode === 0
    applied++
    await waitWhilePreempted()
    // The agent's observation: the tests' output, streamed as it comes.
    await sbx.commands.run('cd /project && python3 -m unittest -q', {
      user: 'root',
      timeoutMs: 120_000,
      onStderr: () => row.lines++,
      onStdout: () => row.lines++,
    }).catch(() => {}) // failing tests exit non-zero
    await waitWhilePreempted()
    await sbx.files.write(trustedTests, { user: 'root' })
    await waitWhilePreempted()
    await sbx.commands.run('python3 /opt/dsec-harness/grade.py /project /tmp/result.json', { user: 'root' })
    const result = JSON.parse(await sbx.files.read('/tmp/result.json'))
    row.passed = result.passed
    row.total = result.total
    row.reward = result.total ? result.passed / result.total : 0
  } catch (e) {
    row.error = `${e.name}: ${e.message}`
  } finally {
    await waitWhilePreempted()
    await sbx.kill()
  }
  row.ms = performance.now() - t0
  return row
}

// A preempted trainer makes no calls: every step of an episode waits here
// while the batch is paused (a call already under way stalls in its
// paused sandbox until the resume).
async function waitWhilePreempted() {
  while (preempted) await preempted
}

// Once a quarter of the episodes applied their patch, pause every sandbox of
// the job (listed by its metadata), hold a second, and resume them.
async function preempt() {
  while (applied < Math.max(1, episodes / 4)) await new Promise((r) => setTimeout(r, 20))
  let release
  preempted = new Promise((r) => (release = r))
  const t0 = performance.now()
  const listed = await Sandbox.list({ query: { metadata: { job }, state: ['running'] } }).nextItems()
  // An episode that ended since the list killed its sandbox: not found.
  const paused = await Promise.all(listed.map((s) => Sandbox.pause(s.sandboxId).then(() => s.sandboxId, (e) => {
    if (e instanceof SandboxNotFoundError) return null
    throw e
  })))
  const live = paused.filter((id) => id !== null)
  const pauseMs = performance.now() - t0
  await new Promise((r) => setTimeout(r, 1000))
  const t1 = performance.now()
  await Promise.all(live.map((id) => Sandbox.connect(id).catch((e) => {
    if (!(e instanceof SandboxNotFoundError)) throw e // one whose last call was under way may have ended
  })))
  const resumeMs = performance.now() - t1
  preempted = null
  release()
  return { paused: live.length, pauseMs, resumeMs }
}

const t0 = performance.now()
const [rows, pre] = await Promise.all([
  Promise.all(Array.from({ length: episodes }, (_, i) => episode(i))),
  preempt(),
])
const secs = (performance.now() - t0) / 1000
for (const r of rows) {
  const score = r.error ? `error: ${r.error}` : `${r.passed}/${r.total} tests, reward ${r.reward.toFixed(2)}`
  console.log(`episode ${String(r.episode).padStart(2)}  ${r.patch.padEnd(24)} create ${r.createMs.toFixed(0).padStart(5)} ms  ${score}`)
}
const mean = rows.reduce((s, r) => s + r.reward, 0) / rows.length
console.log(`preempted: ${pre.paused} sandboxes paused in ${pre.pauseMs.toFixed(0)} ms through E2B's pause, resumed by connect in ${pre.resumeMs.toFixed(0)} ms`)
console.log(`${rows.length} episodes through E2B's SDK in ${secs.toFixed(1)} s, mean reward ${mean.toFixed(2)}, ${rows.filter((r) => r.error).length} errors`)
if (process.argv.includes('--json')) console.log(JSON.stringify(rows))
process.exit(rows.some((r) => r.error) ? 1 : 0)
