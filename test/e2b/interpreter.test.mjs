// @e2b/code-interpreter: runCode returns stdout and the cell's result, keeps
// state between calls, and reports errors.
import assert from 'node:assert/strict'
import { after, before, describe, test } from 'node:test'
import { Sandbox } from '@e2b/code-interpreter'

import { interpreterTemplate, run, track } from './common.mjs'

describe('code interpreter', { timeout: 180_000 }, () => {
  let sbx
  before(async () => {
    sbx = track(await Sandbox.create(interpreterTemplate, { metadata: { dsecTestRun: run } }))
  })
  after(async () => {
    await sbx?.kill()
  })

  test('runCode: stdout and the result of the last expression', async () => {
    const ex = await sbx.runCode('print("hello from python")\nx = 40\nx + 2')
    assert.equal(ex.error, undefined, `error: ${JSON.stringify(ex.error)}`)
    assert.equal(ex.logs.stdout.join(''), 'hello from python\n')
    assert.deepEqual(ex.logs.stderr, [])
    assert.equal(ex.text, '42')
    assert.equal(ex.results.length, 1)
    assert.equal(ex.results[0].isMainResult, true)
    assert.equal(ex.results[0].text, '42')
  })

  test('state persists between calls', async () => {
    await sbx.runCode('counter = 10')
    const ex = await sbx.runCode('counter * 3')
    assert.equal(ex.text, '30')
  })

  test('stderr and streaming callbacks', async () => {
    const out = []
    const err = []
    const ex = await sbx.runCode('import sys\nprint("a")\nprint("b", file=sys.stderr)', {
      onStdout: (m) => out.push(m.line),
      onStderr: (m) => err.push(m.line),
    })
    assert.equal(ex.logs.stdout.join(''), 'a\n')
    assert.equal(ex.logs.stderr.join(''), 'b\n')
    assert.equal(out.join(''), 'a\n')
    assert.equal(err.join(''), 'b\n')
  })

  test('an exception is the execution error', async () => {
    const ex = await sbx.runCode('1 / 0')
    assert.ok(ex.error, 'an error')
    assert.equal(ex.error.name, 'ZeroDivisionError')
    assert.match(ex.error.value, /division by zero/)
    assert.match(ex.error.traceback, /ZeroDivisionError/)
  })

  test('the working directory is /home/user; envs reach the cell', async () => {
    const ex = await sbx.runCode('from pathlib import Path; print(Path.cwd())')
    assert.equal(ex.logs.stdout.join('').trim(), '/home/user')
    const env = await sbx.runCode('import os; print(os.environ.get("CELL_VAR"))', { envs: { CELL_VAR: 'from runCode' } })
    assert.equal(env.logs.stdout.join(''), 'from runCode\n')
  })

  test('a result\'s text is its repr, a string\'s without the quotes (as E2B\'s server gives it)', async () => {
    assert.equal((await sbx.runCode('"a string"')).text, 'a string')
    assert.equal((await sbx.runCode('[1, "b"]')).text, "[1, 'b']")
    assert.equal((await sbx.runCode('None')).results.length, 0, 'None is no result')
  })

  test('execution count, and onResult and onError callbacks', async () => {
    const results = []
    const ex = await sbx.runCode('7 * 6', { onResult: (r) => results.push(r) })
    assert.equal(results.length, 1)
    assert.equal(results[0].text, '42')
    assert.ok(ex.executionCount > 0, `executionCount ${ex.executionCount}`)
    const next = await sbx.runCode('1')
    assert.equal(next.executionCount, ex.executionCount + 1)
    const errors = []
    const bad = await sbx.runCode('undefined_name_xyz', { onError: (e) => errors.push(e) })
    assert.equal(errors.length, 1)
    assert.equal(bad.error.name, 'NameError')
  })

  test('contexts: create, list, independent state, restart, remove', async () => {
    await sbx.runCode('shared = 1')
    const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
    assert.ok(ctx.id, 'a context ID')
    const listed = await sbx.listCodeContexts()
    assert.ok(listed.some((c) => c.id === ctx.id), `listCodeContexts lacks ${ctx.id}`)
    const other = await sbx.runCode('shared', { context: ctx })
    assert.equal(other.error?.name, 'NameError', 'a new context does not see the default one\'s variables')
    assert.equal((await sbx.runCode('import os; print(os.getcwd())', { context: ctx })).logs.stdout.join(''), '/tmp\n')
    await sbx.runCode('y = 5', { context: ctx })
    await sbx.restartCodeContext(ctx)
    assert.equal((await sbx.runCode('y', { context: ctx })).error?.name, 'NameError', 'a restart forgets the state')
    await sbx.removeCodeContext(ctx)
    assert.ok(!(await sbx.listCodeContexts()).some((c) => c.id === ctx.id), 'the removed context is not listed')
  })

  test('Sandbox.connect gives a working interpreter', async () => {
    const again = await Sandbox.connect(sbx.sandboxId)
    assert.equal((await again.runCode('counter + 1')).text, '11')
  })

  test('the interpreter sandbox is an E2B sandbox too', async () => {
    const r = await sbx.commands.run('python3 -c "print(6*7)"')
    assert.equal(r.stdout, '42\n')
  })
})
