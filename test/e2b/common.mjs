// Shared by the suite's files: the template the sandboxes start from, and
// helpers that keep every test's sandboxes accounted for. The SDK is
// configured only as a user configures it: E2B_API_URL, E2B_SANDBOX_URL and
// E2B_API_KEY in the environment.
import { randomUUID } from 'node:crypto'
import { after } from 'node:test'
import { Sandbox } from 'e2b'

// E2B_TEMPLATE names the template (default "base", E2B's own default).
export const template = process.env.E2B_TEMPLATE || 'base'

// The code interpreter's template: E2B's name unless told otherwise.
export const interpreterTemplate = process.env.E2B_INTERPRETER_TEMPLATE || 'code-interpreter-v1'

for (const name of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY']) {
  if (!process.env[name]) {
    throw new Error(`${name} is not set: point the SDK at a dsec E2B address (docs/e2b.md)`)
  }
}

// run marks every sandbox of this process, so Sandbox.list can find them
// among others and a leak check can look for them.
export const run = randomUUID()

const created = new Set()

// create starts a sandbox from the template with the run's metadata; it is
// killed when the file's tests end, if a test did not kill it first.
export async function create(opts = {}) {
  const sbx = await Sandbox.create(template, {
    ...opts,
    metadata: { dsecTestRun: run, ...(opts.metadata || {}) },
  })
  created.add(sbx.sandboxId)
  return sbx
}

// track makes a sandbox made elsewhere (the code interpreter's) part of the
// cleanup.
export function track(sbx) {
  created.add(sbx.sandboxId)
  return sbx
}

after(async () => {
  await Promise.all([...created].map((id) => Sandbox.kill(id).catch(() => false)))
})

// eventually polls fn until it returns a truthy value or timeoutMs passes.
export async function eventually(fn, { timeoutMs = 10_000, intervalMs = 100, what = 'condition' } = {}) {
  const deadline = Date.now() + timeoutMs
  let last
  for (;;) {
    last = await fn()
    if (last) return last
    if (Date.now() > deadline) throw new Error(`${what} did not hold within ${timeoutMs} ms (last: ${JSON.stringify(last)})`)
    await new Promise((r) => setTimeout(r, intervalMs))
  }
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
