package proc

import (
	"context"
	"slices"
	"time"

	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// Follower is one stream following a process's output: the retained
// output there was when it began to follow, a gap for each stream whose
// output went past the retained part before then (Chunk.Dropped), then
// every chunk as the agent reads it, until the exit. One goroutine reads
// it; Close ends it.
type Follower struct {
	p *Process

	// Guarded by p.mu.
	replay, replayEnd int     // p.chunks[replay:replayEnd] are still to hand out
	queue             []Chunk // chunks read since it began to follow, not yet handed out
	lag               int64   // bytes in queue past the retained part
	sent              [3]int64
	closed            bool
}

// Follower is the follower Spec.Followed made at Start, nil without it.
func (p *Process) Follower() *Follower { return p.first }

// Follow begins a stream of the process's output (an Attach): what is
// retained, then everything from now on.
func (p *Process) Follow() *Follower { return p.FollowFrom(0, 0) }

// FollowFrom is Follow for a stream that resumes one that broke: the
// first stdout bytes of stdout and stderr bytes of stderr, which the
// broken stream carried, are left out. Output past them that is no longer
// there (past the retained part, read while no stream followed) comes as
// a gap.
func (p *Process) FollowFrom(stdout, stderr int64) *Follower {
	p.mu.Lock()
	defer p.mu.Unlock()
	f := &Follower{p: p}
	skip := [3]int64{Stdout: max(stdout, 0), Stderr: max(stderr, 0)}
	if skip == [3]int64{} {
		f.replayEnd = len(p.chunks)
	} else {
		// The replay, less what is skipped, as chunks of the queue's.
		var pos [3]int64
		for _, c := range p.chunks {
			start, end := pos[c.Stream], pos[c.Stream]+int64(len(c.Data))
			pos[c.Stream] = end
			if end <= skip[c.Stream] {
				continue
			}
			from := max(skip[c.Stream]-start, 0)
			f.queue = append(f.queue, Chunk{Stream: c.Stream, Data: c.Data[from:]})
		}
	}
	for _, s := range []Stream{Stdout, Stderr} {
		kept := p.retained[s]
		if p.released {
			kept = 0
		}
		f.sent[s] = min(skip[s], p.total[s])
		if missing := p.total[s] - max(kept, f.sent[s]); missing > 0 {
			f.queue = append(f.queue, Chunk{Stream: s, Dropped: missing})
		}
	}
	p.followers = append(p.followers, f)
	return f
}

// Next returns the chunks that are ready, waiting up to wait for some, and
// the exit record once every chunk has been returned: its truncated flags
// say whether this stream missed part of stdout or stderr. With nothing
// ready and no exit within wait, it returns neither.
func (f *Follower) Next(ctx context.Context, wait time.Duration) ([]Chunk, *dsecv1.ExecExited, error) {
	var timer <-chan time.Time
	p := f.p
	for {
		p.mu.Lock()
		if c := f.take(); len(c) > 0 {
			p.mu.Unlock()
			return c, nil, nil
		}
		if p.exited != nil {
			e := f.exitRecord()
			p.mu.Unlock()
			return nil, e, nil
		}
		ch := p.notify
		p.mu.Unlock()
		if wait <= 0 {
			return nil, nil, nil
		}
		if timer == nil {
			t := time.NewTimer(wait)
			defer t.Stop()
			timer = t.C
		}
		select {
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		case <-timer:
			return nil, nil, nil
		case <-ch:
		}
	}
}

// take hands out what is ready, p.mu held: the replay first, then the
// queue, whose handing out makes room for the readers.
func (f *Follower) take() []Chunk {
	var c []Chunk
	switch {
	case f.replay < f.replayEnd:
		c = f.p.chunks[f.replay:f.replayEnd]
		f.replay = f.replayEnd
	case len(f.queue) > 0:
		c, f.queue = f.queue, nil
		if f.lag >= liveWindow {
			f.p.makeRoom()
		}
		f.lag = 0
	}
	for _, ch := range c {
		f.sent[ch.Stream] += int64(len(ch.Data))
	}
	return c
}

// exitRecord is the process's exit record as this stream reports it, p.mu
// held: truncated where the stream did not carry every byte.
func (f *Follower) exitRecord() *dsecv1.ExecExited {
	e := f.p.exited
	out := f.sent[Stdout] < f.p.total[Stdout]
	errs := f.sent[Stderr] < f.p.total[Stderr]
	if e.GetStdoutTruncated() == out && e.GetStderrTruncated() == errs {
		return e
	}
	c := proto.Clone(e).(*dsecv1.ExecExited)
	c.StdoutTruncated, c.StderrTruncated = out, errs
	return c
}

// Close ends the stream: the readers no longer wait for it, and a Release
// that waited for the last follower is done.
func (f *Follower) Close() {
	p := f.p
	p.mu.Lock()
	defer p.mu.Unlock()
	if f.closed {
		return
	}
	f.closed = true
	f.queue = nil
	p.followers = slices.DeleteFunc(p.followers, func(o *Follower) bool { return o == f })
	p.makeRoom()
	if len(p.followers) == 0 && p.release {
		p.release = false
		p.chunks = nil
		p.released = true
	}
}
