package blob

import (
	"context"
	"fmt"
	"io"

	"golang.org/x/time/rate"
)

// maxThrottleBurst bounds how many bytes a throttled store hands out
// without waiting.
const maxThrottleBurst = 256 << 10

// Throttle wraps st so that the bodies of all its reads (Get and GetRange),
// taken together, flow at no more than bytesPerSecond: a model of a remote
// store behind a link of that bandwidth (1 Gbit/s is 125_000_000). Writes
// and metadata calls pass through. bytesPerSecond <= 0 returns st itself.
func Throttle(st Store, bytesPerSecond int64) Store {
	if bytesPerSecond <= 0 {
		return st
	}
	burst := int(min(bytesPerSecond, maxThrottleBurst))
	return &throttled{Store: st, lim: rate.NewLimiter(rate.Limit(bytesPerSecond), burst)}
}

type throttled struct {
	Store
	lim *rate.Limiter
}

func (t *throttled) Get(ctx context.Context, key string) (io.ReadCloser, error) {
	rc, err := t.Store.Get(ctx, key)
	if err != nil {
		return nil, err
	}
	return &throttledReader{ctx: ctx, rc: rc, lim: t.lim}, nil
}

func (t *throttled) GetRange(ctx context.Context, key string, offset, length int64) (io.ReadCloser, error) {
	rc, err := t.Store.GetRange(ctx, key, offset, length)
	if err != nil {
		return nil, err
	}
	return &throttledReader{ctx: ctx, rc: rc, lim: t.lim}, nil
}

type throttledReader struct {
	ctx context.Context
	rc  io.ReadCloser
	lim *rate.Limiter
}

func (r *throttledReader) Read(p []byte) (int, error) {
	// Never take more than one burst at once, so WaitN can always succeed.
	if b := r.lim.Burst(); len(p) > b {
		p = p[:b]
	}
	n, err := r.rc.Read(p)
	if n > 0 {
		if werr := r.lim.WaitN(r.ctx, n); werr != nil {
			return n, fmt.Errorf("throttle read: %w", werr)
		}
	}
	return n, err
}

func (r *throttledReader) Close() error { return r.rc.Close() }
