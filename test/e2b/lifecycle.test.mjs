// Pause and resume, metrics, fork and snapshots: E2B's own tests of these
// (sandbox/snapshot, sandbox/connect, sandbox/fork, sandbox/metrics), as
// far as dsec keeps them (files yes, processes no; see docs/e2b.md).
import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'
import { describe, test } from 'node:test'
import { Sandbox } from 'e2b'

import { create, track } from './common.mjs'

describe('lifecycle', { timeout: 180_000 }, () => {
  test('pause, list paused, connect resumes with the files kept', async () => {
    const group = randomUUID()
    const sbx = await create({ metadata: { group } })
    await sbx.files.write('kept.txt', 'kept across a pause')
    assert.equal(await sbx.pause(), true)
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'paused')
    const paused = await Sandbox.list({ query: { metadata: { group }, state: ['paused'] } }).nextItems()
    assert.deepEqual(paused.map((s) => s.sandboxId), [sbx.sandboxId])
    const running = await Sandbox.list({ query: { metadata: { group }, state: ['running'] } }).nextItems()
    assert.deepEqual(running, [])
    assert.equal(await sbx.pause(), false, 'pausing a paused sandbox answers false (409)')

    const resumed = await Sandbox.connect(sbx.sandboxId)
    assert.equal(await resumed.isRunning(), true)
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'running')
    assert.equal(await resumed.files.read('kept.txt'), 'kept across a pause')
    assert.equal((await resumed.commands.run('echo after')).stdout, 'after\n')
    await sbx.kill()
  })

  test('isRunning is false while paused (E2B\'s connect test)', async () => {
    const sbx = await create()
    await sbx.pause()
    try {
      assert.equal(await sbx.isRunning(), false)
    } finally {
      await sbx.kill()
    }
  })

  test('metrics: a sample with CPU, memory and disk', async () => {
    const sbx = await create()
    const m = await sbx.getMetrics()
    assert.ok(m.length > 0, 'at least one sample')
    for (const k of ['cpuUsedPct', 'cpuCount', 'memUsed', 'memTotal', 'diskUsed', 'diskTotal']) {
      assert.equal(typeof m[0][k], 'number', `${k} is a number: ${JSON.stringify(m[0])}`)
    }
    assert.ok(m[0].timestamp instanceof Date)
    assert.ok(m[0].memTotal > 0 && m[0].cpuCount > 0)
    await sbx.kill()
  })

  test('fork: children start from the parent\'s files', async () => {
    const sbx = await create()
    await sbx.files.write('parent.txt', 'from the parent')
    const children = await sbx.fork({ count: 2 })
    assert.equal(children.length, 2)
    for (const c of children) {
      assert.ok(!(c instanceof Error), `a child failed: ${c}`)
      track(c)
      assert.notEqual(c.sandboxId, sbx.sandboxId)
      assert.equal(await c.files.read('parent.txt'), 'from the parent')
      await c.files.write('child.txt', c.sandboxId)
    }
    assert.equal(await sbx.files.exists('child.txt'), false, 'a child\'s writes stay in the child')
    await Promise.all([sbx.kill(), ...children.map((c) => c.kill())])
  })

  test('snapshot: create from it, list it, delete it', async () => {
    const sbx = await create()
    await sbx.files.write('snapped.txt', 'in the snapshot')
    const snap = await sbx.createSnapshot()
    assert.ok(snap.snapshotId, 'a snapshot ID')
    try {
      const from = track(await Sandbox.create(snap.snapshotId))
      assert.equal(await from.files.read('snapped.txt'), 'in the snapshot')
      await from.kill()
      const listed = []
      const pager = Sandbox.listSnapshots()
      while (pager.hasNext) listed.push(...(await pager.nextItems()))
      assert.ok(listed.some((s) => s.snapshotId === snap.snapshotId), `listSnapshots lacks ${snap.snapshotId}`)
    } finally {
      assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
      await sbx.kill()
    }
  })
})
