// The same calls from many sandboxes at once, with no error: E2B_CONCURRENT
// sandboxes (default 50), each created, run, written, read, listed and
// killed concurrently. Light enough for a 2-core machine.
import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'
import { describe, test } from 'node:test'
import { Sandbox } from 'e2b'

import { create } from './common.mjs'

const n = Number(process.env.E2B_CONCURRENT || 50)

describe(`${n} sandboxes at once`, { timeout: 600_000 }, () => {
  test('create, commands.run, files, list, kill', async () => {
    const group = randomUUID()
    const errors = []
    const one = async (i) => {
      const sbx = await create({ metadata: { group, i: String(i) }, envs: { I: String(i) }, timeoutMs: 300_000 })
      const r = await sbx.commands.run('echo "$I $(whoami)"')
      assert.equal(r.stdout, `${i} user\n`)
      await assert.rejects(sbx.commands.run(`exit ${1 + (i % 100)}`), (e) => e.exitCode === 1 + (i % 100))
      await sbx.files.write(`n-${i}.txt`, `sandbox ${i}`)
      assert.equal(await sbx.files.read(`n-${i}.txt`), `sandbox ${i}`)
      assert.deepEqual((await sbx.files.list('.')).map((e) => e.name).filter((x) => x.startsWith('n-')), [`n-${i}.txt`])
      const streamed = []
      await sbx.commands.run('echo a; echo b', { onStdout: (d) => streamed.push(d) })
      assert.equal(streamed.join(''), 'a\nb\n')
      assert.equal(await sbx.isRunning(), true)
      return sbx
    }
    const t0 = Date.now()
    const settled = await Promise.allSettled(Array.from({ length: n }, (_, i) => one(i)))
    const made = []
    settled.forEach((s, i) => {
      if (s.status === 'fulfilled') made.push(s.value)
      else errors.push(`sandbox ${i}: ${s.reason?.stack || s.reason}`)
    })
    const listed = []
    const pager = Sandbox.list({ query: { metadata: { group } }, limit: 20 })
    while (pager.hasNext) listed.push(...(await pager.nextItems()))
    const kills = await Promise.allSettled(made.map((s) => s.kill()))
    kills.forEach((k, i) => {
      if (k.status === 'rejected') errors.push(`kill ${made[i].sandboxId}: ${k.reason}`)
      else if (k.value !== true) errors.push(`kill ${made[i].sandboxId} answered ${k.value}`)
    })
    console.log(`${n} sandboxes: created, used and killed in ${((Date.now() - t0) / 1000).toFixed(1)} s`)
    assert.deepEqual(errors, [])
    assert.equal(new Set(listed.map((s) => s.sandboxId)).size, n, `list with the group's metadata, in pages of 20, found ${listed.length}`)
    const left = await Sandbox.list({ query: { metadata: { group }, state: ['running'] } }).nextItems()
    assert.deepEqual(left, [])
  })
})
