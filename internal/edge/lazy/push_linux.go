package lazy

import (
	"time"
)

// Pushing a chunk's pages. The kernel asks the file system for a layer
// file's pages a readahead window (at most 128 KiB) or, for EROFS metadata,
// a single page at a time, and each request costs a round trip through
// lazyfs: waking a reader, a read and a write of /dev/fuse. Once a chunk is
// read, lazyfs holds all of it decoded, so it hands the kernel the rest of
// the chunk's pages too (FUSE_NOTIFY_STORE, into the file's page cache), in
// the background: the next reads of the chunk find their pages cached and
// never reach lazyfs. A chunk's pages are pushed again only when it is read
// again a while later, which means the kernel let some of them go.
const (
	pushWorkers = 2
	pushQueue   = 64
	// repushAfter is how long after a chunk's pages were pushed a read of
	// the chunk is taken for one of a page the kernel dropped, rather than
	// one that was in flight while the push was under way.
	repushAfter = time.Second
)

// pushJob is the pages of chunk i of a layer, other than those of the read
// that asked for them ([skipFrom, skipTo) within the chunk, page-aligned),
// to hand to the kernel.
type pushJob struct {
	l                *layer
	i                int
	gen              uint64
	data             []byte // the chunk's plain bytes; not modified
	skipFrom, skipTo int64
}

// startPushing starts the workers that push chunks' pages, until the file
// system's context ends.
func (f *FS) startPushing() {
	f.mnt.pushes = make(chan pushJob, pushQueue)
	for range pushWorkers {
		go f.pushLoop()
	}
}

// pushRest queues the push of chunk i's pages after a read of [within,
// within+n) of it, unless the chunk's pages went to the kernel less than
// repushAfter ago or the queue is full. data is the chunk's plain bytes.
func (f *FS) pushRest(l *layer, i int, data []byte, within, n int64) {
	m := &f.mnt
	if m.pushes == nil || n >= int64(len(data)) {
		return
	}
	now := time.Now().UnixNano()
	last := l.pushedAt[i].Load()
	if last != 0 && now-last < int64(repushAfter) || !l.pushedAt[i].CompareAndSwap(last, now) {
		return
	}
	j := pushJob{
		l: l, i: i, gen: l.pushGen.Load(), data: data,
		skipFrom: within &^ (pageSize - 1),
		skipTo:   min((within+n+pageSize-1)&^(pageSize-1), int64(len(data))),
	}
	select {
	case m.pushes <- j:
	default:
		// Busy: a later read of the chunk may try again.
		l.pushedAt[i].CompareAndSwap(now, last)
	}
}

func (f *FS) pushLoop() {
	for {
		select {
		case j := <-f.mnt.pushes:
			f.push(j)
		case <-f.ctx.Done():
			return
		}
	}
}

// push hands the kernel the job's pages, unless the layer's pages were
// dropped since the job was queued (dropPages holds pushMu to fence pushes
// off while it drops).
func (f *FS) push(j pushJob) {
	l := j.l
	l.pushMu.RLock()
	defer l.pushMu.RUnlock()
	if l.pushGen.Load() != j.gen {
		return
	}
	node := f.mnt.root.GetChild(l.hex)
	if node == nil {
		return
	}
	base := int64(j.i) * l.ix.ChunkSize
	for _, r := range [2][2]int64{{0, j.skipFrom}, {j.skipTo, int64(len(j.data))}} {
		if r[1] <= r[0] {
			continue
		}
		if errno := node.WriteCache(base+r[0], j.data[r[0]:r[1]]); errno != 0 {
			// The kernel forgot the file (ENOENT) or the mount is going.
			f.log.Debug("push pages", "layer", l.hex, "chunk", j.i, "err", errno)
			return
		}
		l.bytesPushed.Add(r[1] - r[0])
	}
}
