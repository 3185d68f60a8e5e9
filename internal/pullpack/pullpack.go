// Package pullpack is the packed form of a page of a node's events, as an
// apiserver's pull of the node brings them (EventsRequest.packed): one
// byte string for the page, which the edge writes from the values its
// event log keeps and the apiserver reads straight into the store's rows,
// without a message per event on either side (the messages, two a
// sandbox, were a fifth of what a busy node's operations allocated, and
// decoding them most of what the pull cost an apiserver).
//
// A page is a format byte (1), the node's name, the sequence number of
// its first event and how many it holds (4 bytes), then each event in order (the next numbered one more):
// its time as the change from the previous one's (Unix milliseconds, the
// first's from 0, zigzag varint), then its kind, sandbox, project, reason
// and message, each a length (uvarint) and its bytes. An event's key is
// its node's, its log's epoch's and its number's (NODE/EPOCH/SEQ), made
// by the reader, which knows the epoch from the page's answer.
package pullpack

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Event is an event as a node keeps and packs it: its node, epoch and
// number are its log's.
type Event struct {
	AtUnixMs                                  int64
	Kind, SandboxID, Project, Reason, Message string
}

// format is a page's first byte: the only one so far.
const format = 1

// Writer writes a page.
type Writer struct {
	b       []byte
	countAt int // where the count goes
	prevAt  int64
	n       int
}

// NewWriter starts a page of node's events, the first numbered first, in
// b's space (nil: a new one).
func NewWriter(b []byte, node string, first uint64) *Writer {
	w := &Writer{b: append(b[:0], format)}
	w.str(node)
	w.b = binary.AppendUvarint(w.b, first)
	w.countAt = len(w.b)
	w.b = append(w.b, 0, 0, 0, 0)
	return w
}

func (w *Writer) str(s string) {
	w.b = binary.AppendUvarint(w.b, uint64(len(s)))
	w.b = append(w.b, s...)
}

// Add adds the page's next event.
func (w *Writer) Add(e *Event) {
	w.b = binary.AppendVarint(w.b, e.AtUnixMs-w.prevAt)
	w.prevAt = e.AtUnixMs
	w.str(e.Kind)
	w.str(e.SandboxID)
	w.str(e.Project)
	w.str(e.Reason)
	w.str(e.Message)
	w.n++
}

// Len is how many events the page holds.
func (w *Writer) Len() int { return w.n }

// Bytes is the page.
func (w *Writer) Bytes() []byte {
	binary.BigEndian.PutUint32(w.b[w.countAt:], uint32(w.n))
	return w.b
}

// ErrMalformed is what Read returns for data that is not a page.
var ErrMalformed = errors.New("malformed packed events")

// Read reads page data, calling fn with the node's name and each event
// and its number, in order; it stops at the first fault, which it
// returns (a page cut short, or with bytes past its last event, is one).
// The strings of kinds, projects, reasons and messages are shared
// by the events that repeat them, a sandbox's ID is its own: fn may keep
// them.
func Read(data []byte, fn func(node string, seq uint64, e Event)) error {
	r, err := newReader(data)
	if err != nil {
		return err
	}
	node := r.str(false)
	seq := r.uvarint()
	count := r.count()
	if r.err != nil {
		return r.err
	}
	var at int64
	for range count {
		at += r.varint()
		e := Event{AtUnixMs: at, Kind: r.str(true), SandboxID: r.str(false), Project: r.str(true), Reason: r.str(true), Message: r.str(true)}
		if r.err != nil {
			break
		}
		fn(node, seq, e)
		seq++
	}
	if r.err == nil && len(r.b) > 0 {
		r.err = fmt.Errorf("%w: %d bytes past its %d events", ErrMalformed, len(r.b), count)
	}
	return r.err
}

// reader reads a page, remembering its first fault.
type reader struct {
	b    []byte
	err  error
	seen map[string]string // the repeated strings read so far
}

// newReader starts reading page data after its format byte.
func newReader(data []byte) (*reader, error) {
	if len(data) == 0 || data[0] != format {
		return nil, fmt.Errorf("%w: format %v", ErrMalformed, data[:min(len(data), 1)])
	}
	return &reader{b: data[1:], seen: map[string]string{}}, nil
}

// take reads the next n bytes of a fixed-width field, nil after a fault
// (short: what the fault says of the field cut short).
func (r *reader) take(n int, short string) []byte {
	if r.err != nil {
		return nil
	}
	if len(r.b) < n {
		r.err = fmt.Errorf("%w: %s", ErrMalformed, short)
		return nil
	}
	b := r.b[:n]
	r.b = r.b[n:]
	return b
}

// count reads a page's count of events or records.
func (r *reader) count() uint32 {
	b := r.take(4, "no count")
	if b == nil {
		return 0
	}
	return binary.BigEndian.Uint32(b)
}

func (r *reader) uvarint() uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b)
	if n <= 0 {
		r.err = fmt.Errorf("%w: a bad number", ErrMalformed)
		return 0
	}
	r.b = r.b[n:]
	return v
}

func (r *reader) varint() int64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Varint(r.b)
	if n <= 0 {
		r.err = fmt.Errorf("%w: a bad number", ErrMalformed)
		return 0
	}
	r.b = r.b[n:]
	return v
}

// raw reads a string's bytes, nil after a fault.
func (r *reader) raw() []byte {
	n := r.uvarint()
	if r.err != nil {
		return nil
	}
	if n > uint64(len(r.b)) {
		r.err = fmt.Errorf("%w: a string of %d bytes where %d are left", ErrMalformed, n, len(r.b))
		return nil
	}
	b := r.b[:n]
	r.b = r.b[n:]
	return b
}

// str reads a string; shared says to give one read before by the same
// string (kinds, projects, reasons and messages repeat across a page).
func (r *reader) str(shared bool) string {
	b := r.raw()
	if len(b) == 0 {
		return ""
	}
	if !shared {
		return string(b)
	}
	if s, ok := r.seen[string(b)]; ok {
		return s
	}
	s := string(b)
	r.seen[s] = s
	return s
}
