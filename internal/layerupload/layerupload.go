// Package layerupload is a layer upload's stream (LayerService.UploadLayer)
// as each hop sees it: the apiserver reads the header to check it, puts it
// back (Replay) and relays the stream to an edge, in-process or over the
// network; the edge reads the archive out of it (Body), bounded, as it
// arrives. No hop holds more than one message of it.
package layerupload

import (
	"fmt"
	"io"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// Stream is the receiving half of an upload: a Connect handler's
// *connect.ClientStream, or a hop's view of one. Receive reports whether a
// message came; at the stream's end Err is nil for a clean end (the sender
// closed it) and the cause otherwise. An upload is whole only when its last
// message is the end marker and the stream then ends cleanly: a transport
// may close a cancelled stream cleanly too.
type Stream = interface {
	Receive() bool
	Msg() *dsecv1.UploadLayerRequest
	Err() error
}

// ReadHeader reads the stream's first message, which must be its header,
// naming a ref and a kind.
func ReadHeader(s Stream) (*dsecv1.UploadLayerRequest, *dsecv1.UploadLayerHeader, error) {
	if !s.Receive() {
		if err := s.Err(); err != nil {
			return nil, nil, fmt.Errorf("upload layer: read the header: %w", err)
		}
		return nil, nil, fmt.Errorf("upload layer: the stream is empty; its first message is the header: %w", errdefs.ErrInvalidArgument)
	}
	first := s.Msg()
	h := first.GetHeader()
	switch {
	case h == nil:
		return nil, nil, fmt.Errorf("upload layer: the first message must be the header (ref, kind), not data: %w", errdefs.ErrInvalidArgument)
	case h.GetRef() == "":
		return nil, nil, fmt.Errorf("upload layer: the header names no ref (name:tag): %w", errdefs.ErrInvalidArgument)
	case h.GetKind() == dsecv1.LayerKind_LAYER_KIND_UNSPECIFIED:
		return nil, nil, fmt.Errorf("upload layer %s: layer kind must be base, workspace or toolkit: %w", h.GetRef(), errdefs.ErrInvalidArgument)
	case h.GetSize() < 0:
		return nil, nil, fmt.Errorf("upload layer %s: size %d: %w", h.GetRef(), h.GetSize(), errdefs.ErrInvalidArgument)
	}
	return first, h, nil
}

// Replay returns s with first, which was read from it already, in front.
func Replay(first *dsecv1.UploadLayerRequest, s Stream) Stream {
	return &replay{first: first, s: s}
}

type replay struct {
	first *dsecv1.UploadLayerRequest
	msg   *dsecv1.UploadLayerRequest
	s     Stream
}

func (r *replay) Receive() bool {
	if r.first != nil {
		r.msg, r.first = r.first, nil
		return true
	}
	if !r.s.Receive() {
		r.msg = nil
		return false
	}
	r.msg = r.s.Msg()
	return true
}

func (r *replay) Msg() *dsecv1.UploadLayerRequest { return r.msg }
func (r *replay) Err() error                      { return r.s.Err() }

// End is the message that ends an upload whose archive is whole.
func End() *dsecv1.UploadLayerRequest {
	return &dsecv1.UploadLayerRequest{Part: &dsecv1.UploadLayerRequest_End{End: true}}
}

// Body reads the archive out of an upload's stream whose header was read:
// the data of every later message, in order. Read returns io.EOF only
// after the end marker and the stream's clean end, and fails once more than
// the limit has come.
type Body struct {
	s         Stream
	ref       string
	limit     int64
	limitName string
	n         int64
	buf       []byte
	ended     bool // the end marker came
}

// NewBody reads the archive of upload ref out of s, at most limit bytes;
// limitName says how the limit is set (a flag), for the error that refuses
// more.
func NewBody(s Stream, ref string, limit int64, limitName string) *Body {
	return &Body{s: s, ref: ref, limit: limit, limitName: limitName}
}

func (b *Body) Read(p []byte) (int, error) {
	for len(b.buf) == 0 {
		if !b.s.Receive() {
			if err := b.s.Err(); err != nil {
				return 0, fmt.Errorf("upload layer %s: the stream broke after %d bytes: %w", b.ref, b.n, err)
			}
			if !b.ended {
				return 0, fmt.Errorf("upload layer %s: the stream stopped after %d bytes without its end: the upload was abandoned: %w",
					b.ref, b.n, errdefs.ErrInvalidArgument)
			}
			return 0, io.EOF
		}
		m := b.s.Msg()
		switch {
		case b.ended:
			return 0, fmt.Errorf("upload layer %s: a message after the end: %w", b.ref, errdefs.ErrInvalidArgument)
		case m.GetHeader() != nil:
			return 0, fmt.Errorf("upload layer %s: a second header after %d bytes of archive: %w", b.ref, b.n, errdefs.ErrInvalidArgument)
		case m.GetEnd():
			b.ended = true
			continue
		}
		b.buf = m.GetData()
		b.n += int64(len(b.buf))
		if b.n > b.limit {
			return 0, fmt.Errorf("upload layer %s: the archive is over the %s an upload may have (%s): %w",
				b.ref, Size(b.limit), b.limitName, errdefs.ErrResourceExhausted)
		}
	}
	n := copy(p, b.buf)
	b.buf = b.buf[n:]
	return n, nil
}

// Bytes is how many bytes of archive have come so far.
func (b *Body) Bytes() int64 { return b.n }

// Size says n bytes in the largest binary unit that divides it, or in MiB.
func Size(n int64) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return fmt.Sprintf("%d GiB", n>>30)
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	}
	return fmt.Sprintf("%d bytes", n)
}
