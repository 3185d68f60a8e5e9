package agentclient

import (
	"context"
	"fmt"
	"hash/crc32"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// Stream is a server stream from the agent. Receive until it returns
// false, then Err.
type Stream[T any] interface {
	Receive() bool
	Msg() *T
	Err() error
	Close() error
}

// Castagnoli is the CRC-32C table of a resumed download's prefix_crc32c.
var Castagnoli = crc32.MakeTable(crc32.Castagnoli)

// DownloadFunc is the agent's Download call (Client has it).
type DownloadFunc func(context.Context, *connect.Request[dsecv1.DownloadRequest]) (*connect.ServerStreamForClient[dsecv1.DownloadChunk], error)

// ResumingDownload is a Download whose stream outlives its agent channel:
// when the stream breaks (the channel failed under it, see broken), it
// calls Download again from the bytes received so far (offset, with their
// CRC-32C, so the agent refuses with FailedPrecondition if the files
// changed meanwhile) and reads on, once per stretch of progress. A
// microVM paused to disk loses its channel: the new call's dial waits for
// the resume.
func ResumingDownload(ctx context.Context, call DownloadFunc, req *dsecv1.DownloadRequest) (Stream[dsecv1.DownloadChunk], error) {
	s, err := call(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return &resumingDownload{ctx: ctx, call: call, req: req, cur: s}, nil
}

type resumingDownload struct {
	ctx  context.Context
	call DownloadFunc
	req  *dsecv1.DownloadRequest
	cur  Stream[dsecv1.DownloadChunk]

	off      int64
	crc      uint32
	progress bool // a chunk came on cur
	resumed  bool // cur is a resumed call
	err      error
}

func (r *resumingDownload) Receive() bool {
	for {
		if r.cur.Receive() {
			d := r.cur.Msg().GetData()
			r.off += int64(len(d))
			r.crc = crc32.Update(r.crc, Castagnoli, d)
			r.progress = true
			return true
		}
		err := r.cur.Err()
		if err == nil || !broken(r.ctx, err) || (r.resumed && !r.progress) {
			if err != nil && r.resumed {
				err = fmt.Errorf("resume download of %s at byte %d: %w", r.req.GetPath(), r.off, err)
			}
			r.err = err
			return false
		}
		again := &dsecv1.DownloadRequest{SandboxId: r.req.GetSandboxId(), Path: r.req.GetPath(), User: r.req.GetUser(),
			Offset: r.req.GetOffset() + r.off, PrefixCrc32C: r.crc}
		if r.req.GetOffset() != 0 {
			// A caller's own offset has a prefix this stream never saw.
			r.err = err
			return false
		}
		next, cerr := r.call(r.ctx, connect.NewRequest(again))
		if cerr != nil {
			r.err = fmt.Errorf("%w (resume download at byte %d: %v)", err, r.off, cerr)
			return false
		}
		r.cur.Close()
		r.cur, r.resumed, r.progress = next, true, false
	}
}

func (r *resumingDownload) Msg() *dsecv1.DownloadChunk { return r.cur.Msg() }

func (r *resumingDownload) Err() error { return r.err }

func (r *resumingDownload) Close() error { return r.cur.Close() }

// WatchFunc is the agent's WatchDir call (Client has it).
type WatchFunc func(context.Context, *connect.Request[dsecv1.WatchDirRequest]) (*connect.ServerStreamForClient[dsecv1.WatchEvent], error)

// Rewatching is a WatchDir whose stream outlives its agent channel: when
// the stream breaks (the channel failed under it), it watches again and
// reads on, without the new watch's started event. A microVM paused to
// disk loses its channel: the new watch's dial waits for the resume. The
// guest stands still while paused, but runs for a moment after the resume
// before the new watch is set: a change made in that moment is not seen.
func Rewatching(ctx context.Context, call WatchFunc, req *dsecv1.WatchDirRequest) (Stream[dsecv1.WatchEvent], error) {
	s, err := call(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return &rewatching{ctx: ctx, call: call, req: req, cur: s}, nil
}

type rewatching struct {
	ctx     context.Context
	call    WatchFunc
	req     *dsecv1.WatchDirRequest
	cur     Stream[dsecv1.WatchEvent]
	started bool // the first watch's started event came
	resumed bool // cur is a new watch whose started event is still to come
	err     error
}

func (r *rewatching) Receive() bool {
	for {
		if r.cur.Receive() {
			if r.cur.Msg().GetStarted() {
				if r.resumed {
					r.resumed = false
					continue // the client has it from the first watch
				}
				r.started = true
			}
			return true
		}
		err := r.cur.Err()
		if err == nil || !r.started || r.resumed || !broken(r.ctx, err) {
			if err != nil && r.resumed {
				err = fmt.Errorf("watch %s again: %w", r.req.GetPath(), err)
			}
			r.err = err
			return false
		}
		next, cerr := r.call(r.ctx, connect.NewRequest(r.req))
		if cerr != nil {
			r.err = fmt.Errorf("%w (watch %s again: %v)", err, r.req.GetPath(), cerr)
			return false
		}
		r.cur.Close()
		r.cur, r.resumed = next, true
	}
}

func (r *rewatching) Msg() *dsecv1.WatchEvent { return r.cur.Msg() }

func (r *rewatching) Err() error { return r.err }

func (r *rewatching) Close() error { return r.cur.Close() }
