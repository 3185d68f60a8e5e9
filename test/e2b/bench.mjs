// The E2B side of `dsec bench e2b`: a long-lived Node process that times
// SDK calls on request, so that node's start does not count and the Go
// bench can interleave them with dsec's own calls. It reads one JSON
// request a line on stdin and answers one JSON line on stdout:
//
//   {"op":"create"}        Sandbox.create(template) → commands.run('true'):
//                          {"ms": total, "create_ms": …, "id": sandboxID}
//                          (the sandbox is left running: the caller deletes it)
//   {"op":"runs","n":N}    N × commands.run('true') in one sandbox kept for
//                          the purpose: {"ms": [each]}
//   {"op":"quit"}          kills that sandbox and exits
//
// "url", when given with create or runs, points the SDK's apiUrl and
// sandboxUrl there instead: the Go side's instant server, which answers
// at once, so the figure is what the SDK and node cost by themselves.
//
// An error answers {"error": "..."}. The SDK is configured as users do:
// E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY; the template is E2B_TEMPLATE
// (default "base").
import { createInterface } from 'node:readline'
import { performance } from 'node:perf_hooks'
import { Sandbox } from 'e2b'

const template = process.env.E2B_TEMPLATE || 'base'
const warm = new Map() // url ('' = the configured one) → the sandbox of its "runs" requests

function options(url) {
  const o = { metadata: { dsecBench: 'e2b' } }
  if (url) Object.assign(o, { apiUrl: url, sandboxUrl: url })
  return o
}

async function handle(req) {
  const url = req.url || ''
  switch (req.op) {
    case 'create': {
      const t0 = performance.now()
      const sbx = await Sandbox.create(template, options(url))
      const t1 = performance.now()
      await sbx.commands.run('true')
      const t2 = performance.now()
      return { ms: t2 - t0, create_ms: t1 - t0, id: sbx.sandboxId }
    }
    case 'runs': {
      let sbx = warm.get(url)
      if (!sbx) {
        sbx = await Sandbox.create(template, options(url))
        await sbx.commands.run('true')
        warm.set(url, sbx)
      }
      const ms = []
      for (let i = 0; i < (req.n || 1); i++) {
        const t0 = performance.now()
        await sbx.commands.run('true')
        ms.push(performance.now() - t0)
      }
      return { ms, id: sbx.sandboxId }
    }
    case 'quit':
      await killWarm()
      return { ok: true }
    default:
      throw new Error(`unknown op ${JSON.stringify(req.op)}`)
  }
}

async function killWarm() {
  for (const sbx of warm.values()) await sbx.kill().catch(() => {})
  warm.clear()
}

const rl = createInterface({ input: process.stdin })
for await (const line of rl) {
  if (!line.trim()) continue
  let out
  let quit = false
  try {
    const req = JSON.parse(line)
    quit = req.op === 'quit'
    out = await handle(req)
  } catch (err) {
    out = { error: String(err?.stack || err) }
  }
  process.stdout.write(JSON.stringify(out) + '\n')
  if (quit) break
}
await killWarm()
