package blob

import (
	"context"
	"fmt"
	"io"
	"strings"

	"dsec.dev/dsec/internal/errdefs"
)

// maxKeyLen is the longest key accepted, the S3 limit.
const maxKeyLen = 1024

// CheckKey reports whether key is a valid object key: non-empty
// slash-separated segments, none of them "." or "..", no leading or trailing
// slash, no NUL byte. Every Store refuses other keys with an error wrapping
// errdefs.ErrInvalidArgument.
func CheckKey(key string) error {
	if key == "" || len(key) > maxKeyLen {
		return fmt.Errorf("check key %q: length %d: %w", key, len(key), errdefs.ErrInvalidArgument)
	}
	if strings.ContainsRune(key, 0) || strings.ContainsRune(key, '\\') {
		return fmt.Errorf("check key %q: forbidden character: %w", key, errdefs.ErrInvalidArgument)
	}
	for _, seg := range strings.Split(key, "/") {
		switch seg {
		case "":
			return fmt.Errorf("check key %q: empty segment: %w", key, errdefs.ErrInvalidArgument)
		case ".", "..":
			return fmt.Errorf("check key %q: segment %q: %w", key, seg, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

// ctxReader fails reads once its context is done, so a long copy stops
// promptly when the caller cancels.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c *ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}

// ctxReadCloser is a ctxReader over a body that must be closed.
type ctxReadCloser struct {
	ctxReader
	c io.Closer
}

func (c *ctxReadCloser) Close() error { return c.c.Close() }
