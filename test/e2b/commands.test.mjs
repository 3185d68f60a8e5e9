// commands: run (stdout, stderr, exit codes, envs, cwd, user, streaming
// callbacks, timeouts), background commands (list, connect, kill), stdin.
import assert from 'node:assert/strict'
import { after, before, describe, test } from 'node:test'
import { CommandExitError, TimeoutError } from 'e2b'

import { create, eventually, sleep } from './common.mjs'

describe('commands', { timeout: 180_000 }, () => {
  let sbx
  before(async () => {
    sbx = await create({ envs: { SANDBOX_WIDE: 'from-create' } })
  })
  after(async () => {
    await sbx?.kill()
  })

  test('stdout and stderr are kept apart', async () => {
    const r = await sbx.commands.run('echo out; echo err >&2; printf "no newline"')
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout, 'out\nno newline')
    assert.equal(r.stderr, 'err\n')
    assert.equal(r.error, undefined)
  })

  test('special characters and multiline strings reach bash unchanged', async () => {
    for (const text of ['Hello, World!', '!@#$%^&*()_+', 'Hello,\nWorld!', 'ünïcødé ✓ 😀']) {
      const r = await sbx.commands.run(`echo "${text}"`)
      assert.equal(r.stdout, `${text}\n`)
    }
  })

  test('a non-zero exit throws CommandExitError with the output', async () => {
    await assert.rejects(sbx.commands.run('echo partial; echo oops >&2; exit 3'), (err) => {
      assert.ok(err instanceof CommandExitError, `got ${err?.name}: ${err?.message}`)
      assert.equal(err.exitCode, 3)
      assert.equal(err.stdout, 'partial\n')
      assert.equal(err.stderr, 'oops\n')
      return true
    })
    await assert.rejects(sbx.commands.run('false'), (err) => err instanceof CommandExitError && err.exitCode === 1)
    await assert.rejects(sbx.commands.run('no-such-command-here'), (err) => err instanceof CommandExitError && err.exitCode === 127)
  })

  test('envs: per command, from create, and not leaking into the next command', async () => {
    const r = await sbx.commands.run('echo "$FOO $BAR"', { envs: { FOO: 'foo', BAR: 'with space' } })
    assert.equal(r.stdout, 'foo with space\n')
    const py = await sbx.commands.run(`python3 -c "import os; print(os.environ['FOO'])"`, { envs: { FOO: 'bar' } })
    assert.equal(py.stdout.trim(), 'bar')
    const next = await sbx.commands.run('echo "[$FOO]"')
    assert.equal(next.stdout, '[]\n')
    const wide = await sbx.commands.run('echo "$SANDBOX_WIDE"')
    assert.equal(wide.stdout, 'from-create\n')
  })

  test('cwd, and the default working directory is the home of the user', async () => {
    assert.equal((await sbx.commands.run('pwd')).stdout, '/home/user\n')
    assert.equal((await sbx.commands.run('pwd', { cwd: '/tmp' })).stdout, '/tmp\n')
    await sbx.files.makeDir('/home/user/work/sub')
    assert.equal((await sbx.commands.run('pwd', { cwd: '/home/user/work/sub' })).stdout, '/home/user/work/sub\n')
    await assert.rejects(sbx.commands.run('pwd', { cwd: '/no/such/dir' }))
  })

  test('user: "user" by default, root on request', async () => {
    assert.equal((await sbx.commands.run('whoami')).stdout, 'user\n')
    assert.equal((await sbx.commands.run('echo $HOME')).stdout, '/home/user\n')
    assert.equal((await sbx.commands.run('whoami', { user: 'root' })).stdout, 'root\n')
    assert.equal((await sbx.commands.run('id -u', { user: 'root' })).stdout, '0\n')
    assert.equal((await sbx.commands.run('pwd', { user: 'root' })).stdout, '/root\n')
  })

  // E2B's own envVars test runs `sudo echo`; users `sudo apt-get install`.
  // E2B's creates ask dsec for allow_privilege_escalation, so sudo works.
  test('sudo works for the default user, as in E2B\'s base template', async () => {
    assert.equal((await sbx.commands.run('sudo -n whoami')).stdout, 'root\n')
  })

  test('onStdout and onStderr stream output while the command runs', async () => {
    const out = []
    const err = []
    const stamps = []
    const t0 = Date.now()
    const r = await sbx.commands.run('for i in 1 2 3; do echo "out $i"; echo "err $i" >&2; sleep 0.4; done', {
      onStdout: (d) => { out.push(d); stamps.push(Date.now() - t0) },
      onStderr: (d) => { err.push(d) },
    })
    assert.equal(out.join(''), 'out 1\nout 2\nout 3\n')
    assert.equal(err.join(''), 'err 1\nerr 2\nerr 3\n')
    assert.equal(r.stdout, out.join(''))
    assert.equal(r.stderr, err.join(''))
    // The first line came well before the command ended: streamed, not
    // delivered at the end.
    assert.ok(stamps.length >= 2, `stdout arrived in ${stamps.length} callback(s), want it streamed`)
    assert.ok(stamps[stamps.length - 1] - stamps[0] >= 500, `callbacks at ${stamps} ms: not spread over the run`)
  })

  test('a command longer than its timeoutMs is stopped with an error', async () => {
    const t0 = Date.now()
    await assert.rejects(sbx.commands.run('sleep 30', { timeoutMs: 1_500 }))
    assert.ok(Date.now() - t0 < 15_000, 'the timeout cut the command short')
    const h = await sbx.commands.run('sleep 30', { timeoutMs: 1_500, background: true })
    await assert.rejects(h.wait(), TimeoutError)
  })

  test('background: the handle, list, connect, kill', async () => {
    const h = await sbx.commands.run('echo started; sleep 60', { background: true })
    assert.ok(Number.isInteger(h.pid) && h.pid > 0, `pid ${h.pid}`)
    await eventually(() => h.stdout === 'started\n', { what: 'the background command prints' })

    const h2 = await sbx.commands.run('sleep 61', { background: true })
    const procs = await sbx.commands.list()
    const pids = procs.map((p) => p.pid)
    assert.ok(pids.includes(h.pid) && pids.includes(h2.pid), `list ${JSON.stringify(procs)} lacks ${h.pid} or ${h2.pid}`)
    const p = procs.find((x) => x.pid === h.pid)
    assert.equal(p.cmd, '/bin/bash')
    assert.ok(p.args.join(' ').includes('sleep 60'), `args ${p.args}`)

    // Another handle on the same process.
    const conn = await sbx.commands.connect(h.pid)
    assert.equal(conn.pid, h.pid)

    assert.equal(await sbx.commands.kill(h.pid), true)
    await assert.rejects(h.wait(), (err) => err instanceof CommandExitError && err.exitCode !== 0)
    await assert.rejects(conn.wait())
    await assert.rejects(sbx.commands.run(`kill -0 ${h.pid}`), CommandExitError)
    const after = (await sbx.commands.list()).map((x) => x.pid)
    assert.ok(!after.includes(h.pid), `killed ${h.pid} is still listed: ${after}`)

    assert.equal(await h2.kill(), true)
    assert.equal(await sbx.commands.kill(999999), false, 'killing an unknown pid answers false')
    await assert.rejects(sbx.commands.connect(999999))
  })

  test('a background command outlives its handle', async () => {
    const h = await sbx.commands.run('sleep 1; echo done > /tmp/outlived', { background: true })
    await h.disconnect()
    await eventually(async () => (await sbx.files.exists('/tmp/outlived')), { what: 'the disconnected command finishes' })
    assert.equal(await sbx.files.read('/tmp/outlived'), 'done\n')
  })

  test('a finished background command yields its result', async () => {
    const h = await sbx.commands.run('echo bg; exit 0', { background: true })
    const r = await h.wait()
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout, 'bg\n')
  })

  test('sendStdin and closeStdin', async () => {
    const h = await sbx.commands.run('cat', { background: true, stdin: true })
    await sbx.commands.sendStdin(h.pid, 'Hello, ')
    await h.sendStdin(new TextEncoder().encode('World!\nsecond line'))
    await eventually(() => h.stdout === 'Hello, World!\nsecond line', { what: `cat echoes its stdin (got ${JSON.stringify(h.stdout)})` })
    await h.closeStdin()
    const r = await h.wait()
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout, 'Hello, World!\nsecond line')

    const h2 = await sbx.commands.run('cat', { background: true, stdin: true })
    await sbx.commands.sendStdin(h2.pid, '')
    await sleep(200)
    assert.equal(h2.stdout, '')
    await h2.kill()
  })

  test('many commands in a row and at once', async () => {
    const rs = await Promise.all(Array.from({ length: 20 }, (_, i) => sbx.commands.run(`echo ${i}`)))
    rs.forEach((r, i) => assert.equal(r.stdout, `${i}\n`))
    for (let i = 0; i < 10; i++) {
      await sbx.commands.run('true')
    }
  })
})
