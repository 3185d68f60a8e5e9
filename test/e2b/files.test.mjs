// files: write, read (text, bytes, blob, stream), list with depth, exists,
// getInfo, makeDir, rename, remove, signed upload/download URLs used with
// fetch, watchDir.
import assert from 'node:assert/strict'
import { after, before, describe, test } from 'node:test'
import { FileNotFoundError, FilesystemEventType, FileType } from 'e2b'

import { create, eventually } from './common.mjs'

describe('files', { timeout: 180_000 }, () => {
  let sbx
  before(async () => {
    sbx = await create()
  })
  after(async () => {
    await sbx?.kill()
  })

  test('write and read: relative paths resolve against /home/user', async () => {
    const info = await sbx.files.write('hello.txt', 'Hello, world!')
    assert.equal(info.name, 'hello.txt')
    assert.equal(info.path, '/home/user/hello.txt')
    assert.equal(await sbx.files.read('hello.txt'), 'Hello, world!')
    assert.equal(await sbx.files.read('/home/user/hello.txt'), 'Hello, world!')
    assert.equal((await sbx.commands.run('cat hello.txt')).stdout, 'Hello, world!')
    // Written by and for the default user.
    assert.equal((await sbx.commands.run('stat -c %U:%G hello.txt')).stdout, 'user:user\n')
  })

  test('write creates parent directories, overwrites, and takes bytes and blobs', async () => {
    await sbx.files.write('deep/er/file.txt', 'first')
    await sbx.files.write('deep/er/file.txt', 'second')
    assert.equal(await sbx.files.read('deep/er/file.txt'), 'second')

    const bytes = new Uint8Array(256).map((_, i) => i)
    await sbx.files.write('/tmp/bytes.bin', bytes)
    const back = await sbx.files.read('/tmp/bytes.bin', { format: 'bytes' })
    assert.deepEqual(Buffer.from(back), Buffer.from(bytes))
    assert.equal((await sbx.commands.run('wc -c < /tmp/bytes.bin')).stdout.trim(), '256')

    await sbx.files.write('/tmp/blob.txt', new Blob(['from a blob']))
    const blob = await sbx.files.read('/tmp/blob.txt', { format: 'blob' })
    assert.equal(await blob.text(), 'from a blob')
  })

  test('write of several files at once', async () => {
    const infos = await sbx.files.write([
      { path: 'multi/a.txt', data: 'A' },
      { path: 'multi/b.txt', data: 'B' },
    ])
    assert.deepEqual(infos.map((i) => i.path).sort(), ['/home/user/multi/a.txt', '/home/user/multi/b.txt'])
    assert.equal(await sbx.files.read('multi/a.txt'), 'A')
    assert.equal(await sbx.files.read('multi/b.txt'), 'B')
  })

  test('a large file round-trips, also as a stream', async () => {
    const content = 'Streamed read content. '.repeat(50_000) // about 1.1 MB
    await sbx.files.write('large.txt', content)
    assert.equal(await sbx.files.read('large.txt'), content)
    const stream = await sbx.files.read('large.txt', { format: 'stream' })
    const chunks = []
    for await (const c of stream) chunks.push(c)
    assert.equal(Buffer.concat(chunks).toString('utf-8'), content)
  })

  test('an empty file reads empty in every format', async () => {
    await sbx.commands.run('touch empty.txt')
    assert.equal(await sbx.files.read('empty.txt'), '')
    assert.equal((await sbx.files.read('empty.txt', { format: 'bytes' })).length, 0)
    assert.equal((await sbx.files.read('empty.txt', { format: 'blob' })).size, 0)
  })

  test('reading a missing file throws FileNotFoundError', async () => {
    await assert.rejects(sbx.files.read('no-such-file.txt'), FileNotFoundError)
  })

  test('write and read as root', async () => {
    await sbx.files.write('root-file.txt', 'root data', { user: 'root' })
    assert.equal(await sbx.files.read('/root/root-file.txt', { user: 'root' }), 'root data')
    assert.equal((await sbx.commands.run('stat -c %U /root/root-file.txt', { user: 'root' })).stdout, 'root\n')
  })

  test('exists, makeDir (nested, existing), getInfo', async () => {
    assert.equal(await sbx.files.exists('dir-a'), false)
    assert.equal(await sbx.files.makeDir('dir-a'), true)
    assert.equal(await sbx.files.exists('dir-a'), true)
    assert.equal(await sbx.files.makeDir('dir-a'), false, 'making an existing directory answers false')
    assert.equal(await sbx.files.makeDir('dir-b/nested/deeper'), true)
    assert.equal(await sbx.files.exists('dir-b/nested/deeper'), true)

    await sbx.files.write('dir-a/f.txt', 'test')
    const f = await sbx.files.getInfo('dir-a/f.txt')
    assert.equal(f.name, 'f.txt')
    assert.equal(f.type, FileType.FILE)
    assert.equal(f.path, '/home/user/dir-a/f.txt')
    assert.equal(f.size, 4)
    assert.equal(f.mode, 0o644)
    assert.equal(f.permissions, '-rw-r--r--')
    assert.equal(f.owner, 'user')
    assert.equal(f.group, 'user')
    assert.ok(f.modifiedTime instanceof Date)

    const d = await sbx.files.getInfo('dir-a')
    assert.equal(d.type, FileType.DIR)
    assert.equal(d.mode, 0o755)
    assert.equal(d.permissions, 'drwxr-xr-x')

    await sbx.commands.run('ln -s dir-a/f.txt link.txt')
    const l = await sbx.files.getInfo('link.txt')
    assert.equal(l.name, 'link.txt')
    assert.equal(l.symlinkTarget, '/home/user/dir-a/f.txt')

    await assert.rejects(sbx.files.getInfo('no-such-entry'), FileNotFoundError)
  })

  test('list: entries in order, with depth', async () => {
    await sbx.files.makeDir('tree/sub1/sub1_1')
    await sbx.files.makeDir('tree/sub2')
    await sbx.files.write('tree/file1.txt', 'Hello, world!')

    const one = await sbx.files.list('tree')
    assert.deepEqual(one.map((e) => e.name), ['file1.txt', 'sub1', 'sub2'])
    assert.deepEqual(one.map((e) => e.type), [FileType.FILE, FileType.DIR, FileType.DIR])
    assert.deepEqual(one.map((e) => e.path), ['/home/user/tree/file1.txt', '/home/user/tree/sub1', '/home/user/tree/sub2'])
    assert.equal(one[0].size, 13)
    assert.equal(one[0].owner, 'user')

    const two = await sbx.files.list('tree', { depth: 2 })
    assert.deepEqual(two.map((e) => e.path), [
      '/home/user/tree/file1.txt', '/home/user/tree/sub1', '/home/user/tree/sub1/sub1_1', '/home/user/tree/sub2',
    ])
    await assert.rejects(sbx.files.list('tree', { depth: -1 }), /depth should be at least one/)
    await assert.rejects(sbx.files.list('no-such-dir'), FileNotFoundError)
  })

  test('rename and remove', async () => {
    await sbx.files.write('old.txt', 'This file will be renamed.')
    const info = await sbx.files.rename('old.txt', 'new.txt')
    assert.equal(info.name, 'new.txt')
    assert.equal(info.type, FileType.FILE)
    assert.equal(info.path, '/home/user/new.txt')
    assert.equal(await sbx.files.exists('old.txt'), false)
    assert.equal(await sbx.files.read('new.txt'), 'This file will be renamed.')
    await assert.rejects(sbx.files.rename('no-such-old.txt', 'x.txt'), FileNotFoundError)

    await sbx.files.remove('new.txt')
    assert.equal(await sbx.files.exists('new.txt'), false)
    await sbx.files.makeDir('to-remove/inner')
    await sbx.files.write('to-remove/inner/x', 'x')
    await sbx.files.remove('to-remove')
    assert.equal(await sbx.files.exists('to-remove'), false)
    await sbx.files.remove('never-existed.txt') // not an error, as with E2B
  })

  test('uploadUrl and downloadUrl work with plain fetch', async () => {
    const up = await sbx.uploadUrl('uploaded.txt')
    const form = new FormData()
    form.append('file', new Blob(['uploaded through a signed URL']), 'uploaded.txt')
    const res = await fetch(up, { method: 'POST', body: form })
    assert.equal(res.status, 200, await res.clone().text())
    assert.deepEqual(await res.json(), [{ name: 'uploaded.txt', path: '/home/user/uploaded.txt', type: 'file' }])
    assert.equal(await sbx.files.read('uploaded.txt'), 'uploaded through a signed URL')

    const down = await sbx.downloadUrl('uploaded.txt')
    const got = await fetch(down)
    assert.equal(got.status, 200)
    assert.equal(await got.text(), 'uploaded through a signed URL')

    // As root, with an expiring signature.
    await sbx.files.write('/root/secret.txt', 'root only', { user: 'root' })
    const rootDown = await sbx.downloadUrl('/root/secret.txt', { user: 'root', useSignatureExpiration: 60_000 })
    const rootGot = await fetch(rootDown)
    assert.equal(rootGot.status, 200)
    assert.equal(await rootGot.text(), 'root only')

    // A signature that expired, or one for another path, is refused.
    const expired = await sbx.downloadUrl('uploaded.txt', { useSignatureExpiration: -10_000 })
    const e = await fetch(expired)
    assert.equal(e.status, 401)
    const body = await e.json()
    assert.equal(body.code, 401)
    const forged = new URL(down)
    forged.searchParams.set('path', '/etc/shadow')
    assert.ok([401, 403].includes((await fetch(forged)).status), 'a signature for another path is refused')
    const missing = await fetch(await sbx.downloadUrl('no-such-file.txt'))
    assert.equal(missing.status, 404)
  })

  test('watchDir reports writes, creates and removes', async () => {
    await sbx.files.makeDir('watched')
    await sbx.files.write('watched/w.txt', 'before')
    const events = []
    const handle = await sbx.files.watchDir('watched', (ev) => { events.push(ev) })
    try {
      // One change at a time, each awaited, as E2B's own tests do.
      await sbx.files.write('watched/w.txt', 'after')
      await eventually(() => events.some((e) => e.type === FilesystemEventType.WRITE && e.name === 'w.txt'), { what: 'a WRITE event of w.txt' })
      await sbx.files.write('watched/new.txt', 'new')
      await eventually(() => events.some((e) => e.type === FilesystemEventType.CREATE && e.name === 'new.txt'), { what: 'a CREATE event of new.txt' })
      await sbx.files.remove('watched/new.txt')
      await eventually(() => events.some((e) => e.type === FilesystemEventType.REMOVE && e.name === 'new.txt'), { what: 'a REMOVE event of new.txt' })
    } finally {
      await handle.stop()
    }
    await assert.rejects(sbx.files.watchDir('no-such-watched-dir', () => {}), FileNotFoundError)
  })

  test('gzip content encoding and octet-stream uploads of a stream', async () => {
    await sbx.files.write('gz.txt', 'written with gzip', { gzip: true })
    assert.equal(await sbx.files.read('gz.txt'), 'written with gzip')
    assert.equal(await sbx.files.read('gz.txt', { gzip: true }), 'written with gzip')
    const content = 'Streamed octet-stream upload. '.repeat(10_000)
    const info = await sbx.files.write('octet.bin', new Blob([content]).stream(), { useOctetStream: true })
    assert.equal(info.path, '/home/user/octet.bin')
    assert.equal(await sbx.files.read('octet.bin'), content)
  })

  test('watchDir recursive sees nested changes', async () => {
    await sbx.files.makeDir('rwatch/nested')
    const events = []
    const handle = await sbx.files.watchDir('rwatch', (ev) => { events.push(ev) }, { recursive: true })
    try {
      await sbx.files.write('rwatch/nested/n.txt', 'nested')
      await eventually(() => events.some((e) => e.name === 'nested/n.txt' &&
        (e.type === FilesystemEventType.WRITE || e.type === FilesystemEventType.CREATE)), { what: `an event of nested/n.txt (got ${JSON.stringify(events)})` })
    } finally {
      await handle.stop()
    }
  })
})
