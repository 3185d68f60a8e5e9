package layerupload

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// msgs is a Stream of fixed messages that ends with err (nil: cleanly).
type msgs struct {
	m   []*dsecv1.UploadLayerRequest
	cur *dsecv1.UploadLayerRequest
	err error
}

func (s *msgs) Receive() bool {
	if len(s.m) == 0 {
		return false
	}
	s.cur, s.m = s.m[0], s.m[1:]
	return true
}
func (s *msgs) Msg() *dsecv1.UploadLayerRequest { return s.cur }
func (s *msgs) Err() error {
	if len(s.m) > 0 {
		return nil
	}
	return s.err
}

func header(ref string, kind dsecv1.LayerKind, size int64) *dsecv1.UploadLayerRequest {
	return &dsecv1.UploadLayerRequest{Part: &dsecv1.UploadLayerRequest_Header{Header: &dsecv1.UploadLayerHeader{Ref: ref, Kind: kind, Size: size}}}
}

var end = End()

func data(s string) *dsecv1.UploadLayerRequest {
	return &dsecv1.UploadLayerRequest{Part: &dsecv1.UploadLayerRequest_Data{Data: []byte(s)}}
}

func TestReadHeader(t *testing.T) {
	base := dsecv1.LayerKind_LAYER_KIND_BASE
	for _, tc := range []struct {
		name string
		s    *msgs
		want string // "" = accepted
		kind error
	}{
		{"a header", &msgs{m: []*dsecv1.UploadLayerRequest{header("a:1", base, 0)}}, "", nil},
		{"empty", &msgs{}, "the stream is empty", errdefs.ErrInvalidArgument},
		{"broken before the header", &msgs{err: errdefs.ErrUnavailable}, "read the header", errdefs.ErrUnavailable},
		{"data first", &msgs{m: []*dsecv1.UploadLayerRequest{data("x")}}, "must be the header", errdefs.ErrInvalidArgument},
		{"no ref", &msgs{m: []*dsecv1.UploadLayerRequest{header("", base, 0)}}, "names no ref", errdefs.ErrInvalidArgument},
		{"no kind", &msgs{m: []*dsecv1.UploadLayerRequest{header("a:1", 0, 0)}}, "kind must be", errdefs.ErrInvalidArgument},
		{"negative size", &msgs{m: []*dsecv1.UploadLayerRequest{header("a:1", base, -1)}}, "size -1", errdefs.ErrInvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, h, err := ReadHeader(tc.s)
			if tc.want == "" {
				if err != nil || h.GetRef() != "a:1" {
					t.Fatalf("ReadHeader = %v, %v", h, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) || !errors.Is(err, tc.kind) {
				t.Fatalf("ReadHeader: %v, want %q (%v)", err, tc.want, tc.kind)
			}
		})
	}
}

// TestBody: the archive is the data of the messages after the header, in
// order; a clean end is io.EOF, anything else is not; the limit holds.
func TestBody(t *testing.T) {
	base := dsecv1.LayerKind_LAYER_KIND_BASE
	read := func(s *msgs, limit int64) (string, error) {
		first, h, err := ReadHeader(s)
		if err != nil || first == nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		_, err = io.Copy(&out, NewBody(s, h.GetRef(), limit, "--max"))
		return out.String(), err
	}
	got, err := read(&msgs{m: []*dsecv1.UploadLayerRequest{header("a:1", base, 0), data("ab"), data(""), data("cde"), end}}, 5)
	if err != nil || got != "abcde" {
		t.Errorf("body = %q, %v; want abcde at exactly the limit", got, err)
	}
	_, err = read(&msgs{m: []*dsecv1.UploadLayerRequest{header("a:1", base, 0), data("ab"), data("cdef"), end}}, 5)
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "over the 5 bytes an upload may have (--max)") {
		t.Errorf("over the limit: %v", err)
	}
	_, err = read(&msgs{m: []*dsecv1.UploadLayerRequest{header("a:1", base, 0), data("ab"), header("b:1", base, 0)}}, 5)
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "a second header") {
		t.Errorf("second header: %v", err)
	}
	_, err = read(&msgs{m: []*dsecv1.UploadLayerRequest{header("a:1", base, 0), data("ab"), end, data("c")}}, 5)
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "after the end") {
		t.Errorf("data after the end: %v", err)
	}
	got, err = read(&msgs{m: []*dsecv1.UploadLayerRequest{header("a:1", base, 0), data("ab")}, err: errdefs.ErrUnavailable}, 5)
	if got != "ab" || !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "broke after 2 bytes") {
		t.Errorf("a broken stream: %q, %v; want its error, not an end", got, err)
	}
	// A transport may close a cancelled stream cleanly: without its end
	// marker, the archive is not whole.
	_, err = read(&msgs{m: []*dsecv1.UploadLayerRequest{header("a:1", base, 0), data("ab")}}, 5)
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "abandoned") {
		t.Errorf("a stream closed without its end: %v", err)
	}
}

func TestReplay(t *testing.T) {
	base := dsecv1.LayerKind_LAYER_KIND_BASE
	s := &msgs{m: []*dsecv1.UploadLayerRequest{header("a:1", base, 0), data("x")}}
	first, _, err := ReadHeader(s)
	if err != nil {
		t.Fatal(err)
	}
	r := Replay(first, s)
	var got []string
	for r.Receive() {
		if h := r.Msg().GetHeader(); h != nil {
			got = append(got, "header "+h.GetRef())
		} else {
			got = append(got, "data "+string(r.Msg().GetData()))
		}
	}
	if strings.Join(got, ", ") != "header a:1, data x" || r.Err() != nil {
		t.Errorf("replayed %v, %v", got, r.Err())
	}
}

func TestSize(t *testing.T) {
	for n, want := range map[int64]string{5: "5 bytes", 64 << 20: "64 MiB", 16 << 30: "16 GiB", 3<<20 + 1<<19: "3.5 MiB"} {
		if got := Size(n); got != want {
			t.Errorf("Size(%d) = %q, want %q", n, got, want)
		}
	}
}
