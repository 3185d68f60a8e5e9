// A PTY session: create, sendInput, resize, reconnect, kill.
import assert from 'node:assert/strict'
import { after, before, describe, test } from 'node:test'
import { CommandExitError } from 'e2b'

import { create, eventually } from './common.mjs'

describe('pty', { timeout: 120_000 }, () => {
  let sbx
  before(async () => {
    sbx = await create()
  })
  after(async () => {
    await sbx?.kill()
  })

  const decoder = () => {
    const d = new TextDecoder()
    const s = { text: '' }
    s.onData = (data) => { s.text += d.decode(data, { stream: true }) }
    return s
  }

  test('create, sendInput, envs, exit', async () => {
    const out = decoder()
    const term = await sbx.pty.create({ cols: 80, rows: 24, onData: out.onData, envs: { ABC: '123' } })
    assert.ok(term.pid > 0)
    await sbx.pty.sendInput(term.pid, new TextEncoder().encode('echo "abc=$ABC tty=$(tty)"\nexit\n'))
    const r = await term.wait()
    assert.equal(r.exitCode, 0)
    assert.match(out.text, /abc=123 tty=\/dev\/pts\/\d+/)
  })

  test('resize changes what the terminal reports', async () => {
    const out = decoder()
    const term = await sbx.pty.create({ cols: 80, rows: 24, onData: out.onData })
    await sbx.pty.sendInput(term.pid, new TextEncoder().encode('stty size\n'))
    await eventually(() => /24 80/.test(out.text), { what: `stty size says 24 80 (got ${JSON.stringify(out.text)})` })
    await sbx.pty.resize(term.pid, { cols: 132, rows: 40 })
    await sbx.pty.sendInput(term.pid, new TextEncoder().encode('stty size; tput cols\nexit\n'))
    await term.wait()
    assert.match(out.text, /40 132/)
    assert.match(out.text, /\b132\b/)
  })

  test('disconnect and connect again', async () => {
    const out1 = decoder()
    const term = await sbx.pty.create({ cols: 80, rows: 24, onData: out1.onData, envs: { FOO: 'bar' } })
    await sbx.pty.sendInput(term.pid, new TextEncoder().encode('echo "first $FOO"\n'))
    await eventually(() => out1.text.includes('first bar'), { what: 'the first connection sees output' })
    await term.disconnect()

    const out2 = decoder()
    const again = await sbx.pty.connect(term.pid, { onData: out2.onData })
    assert.equal(again.pid, term.pid)
    await sbx.pty.sendInput(term.pid, new TextEncoder().encode('echo "second $FOO"\nexit\n'))
    const r = await again.wait()
    assert.equal(r.exitCode, 0)
    assert.ok(out2.text.includes('second bar'), `the second connection saw ${JSON.stringify(out2.text)}`)
  })

  test('kill ends the terminal', async () => {
    const term = await sbx.pty.create({ cols: 80, rows: 24, onData: () => {} })
    assert.equal(await sbx.pty.kill(term.pid), true)
    await assert.rejects(term.wait())
    await assert.rejects(sbx.commands.run(`kill -0 ${term.pid}`), CommandExitError)
    assert.equal(await sbx.pty.kill(999999), false)
  })
})
