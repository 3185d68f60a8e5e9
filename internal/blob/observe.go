package blob

import (
	"context"
	"errors"
	"io"
	"strings"

	"dsec.dev/dsec/internal/errdefs"
)

// Observe returns st with every failed call reported to failed, named by
// its op ("put", "get", "get_range", "stat", "delete", "list"), for the
// blob store's error counter (docs/operations.md). A missing key is an
// answer, not a failure, and so is the caller giving up (its context
// cancelled). Errors reading a body after Get returned are the reader's.
func Observe(st Store, failed func(op string)) Store {
	return &observed{Store: st, failed: failed}
}

// Backend names the kind of store a spec opens, "s3" or "dir", for the
// error counter's label.
func Backend(spec string) string {
	if strings.HasPrefix(spec, "s3://") {
		return "s3"
	}
	return "dir"
}

type observed struct {
	Store
	failed func(op string)
}

func (o *observed) done(op string, err error) {
	if err != nil && !errors.Is(err, errdefs.ErrNotFound) && !errors.Is(err, context.Canceled) {
		o.failed(op)
	}
}

func (o *observed) Put(ctx context.Context, key string, r io.Reader, size int64) error {
	err := o.Store.Put(ctx, key, r, size)
	o.done("put", err)
	return err
}

func (o *observed) Get(ctx context.Context, key string) (io.ReadCloser, error) {
	rc, err := o.Store.Get(ctx, key)
	o.done("get", err)
	return rc, err
}

func (o *observed) GetRange(ctx context.Context, key string, offset, length int64) (io.ReadCloser, error) {
	rc, err := o.Store.GetRange(ctx, key, offset, length)
	o.done("get_range", err)
	return rc, err
}

func (o *observed) Stat(ctx context.Context, key string) (int64, error) {
	n, err := o.Store.Stat(ctx, key)
	o.done("stat", err)
	return n, err
}

func (o *observed) Delete(ctx context.Context, key string) error {
	err := o.Store.Delete(ctx, key)
	o.done("delete", err)
	return err
}

func (o *observed) List(ctx context.Context, prefix string, fn func(key string, size int64) error) error {
	var stopped error // fn's own error ends the listing: not the store's
	err := o.Store.List(ctx, prefix, func(key string, size int64) error {
		stopped = fn(key, size)
		return stopped
	})
	if stopped == nil || !errors.Is(err, stopped) {
		o.done("list", err)
	}
	return err
}
