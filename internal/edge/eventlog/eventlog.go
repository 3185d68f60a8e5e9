// Package eventlog holds a node's lifecycle events (a sandbox created,
// paused, resumed, deleted, expired, failed…) in order, the last Capacity
// of them, for the apiservers to pull into the metadata store.
//
// Each event is numbered in the log's epoch (random, new each time the
// edge starts) and named NODE/EPOCH/SEQ: the key the store keeps it under
// once, however many apiservers pull it, and however often one restarted
// pulls it again. The edge's sandbox manager (and a hollow edge) add
// events as their sandboxes change; the edge service answers Events and
// reports the epoch and the last sequence number in its Status.
//
// A real edge's log is kept on the node's disk as well (Open, file.go): a
// dsecd killed or crashed starts again in the same epoch, at the next
// sequence number, with the events no apiserver pulled yet still there to
// pull. A log made by New (a hollow edge's, which has no state root)
// lives in memory alone, in an epoch new each time: what no apiserver
// pulled before it stops is lost.
package eventlog

import (
	"log/slog"
	"os"
	"strconv"
	"sync"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/pullpack"
)

// Event kinds (dsecv1.Event.kind).
const (
	Created    = "created"
	Paused     = "paused"
	Resumed    = "resumed"
	PhaseEnded = "phase_ended"
	Forked     = "forked"
	Snapshot   = "snapshot"
	Deleted    = "deleted"
	Expired    = "expired"
	Failed     = "failed"
)

// Kinds lists every kind, in a sandbox's life order.
var Kinds = []string{Created, Paused, Resumed, PhaseEnded, Forked, Snapshot, Deleted, Expired, Failed}

// DefaultCapacity is how many events a log keeps: at the edge's busiest
// (hundreds of creates and deletes a second) many seconds of them, while
// apiservers pull within about a second.
const DefaultCapacity = 16384

// Log is a node's event log. It is safe for concurrent use; a nil *Log
// records nothing.
type Log struct {
	node     string
	epoch    string
	capacity int

	// Where Open keeps it ("" for New's: nowhere), in which boot, and
	// what it says when its files surprise it.
	dir  string
	boot string
	log  *slog.Logger

	mu sync.Mutex
	// ring[(seq-1) % capacity] for seq in [first, last], made at the
	// first Add: values, not messages (a message and a key each event
	// were a fifth of what a busy node's operations allocated); Read
	// makes the messages, ReadPacked none.
	ring  []pullpack.Event
	first uint64 // sequence number of the oldest kept
	last  uint64 // sequence number of the newest (0: none)
	// The current segment (nil: in memory alone), the events in it, and
	// a record's buffers, reused.
	f         *os.File
	inSegment int
	buf, rec  []byte
	closed    bool // Close was called: Add records nothing more
}

// New returns an empty log of node's, keeping capacity events (0:
// DefaultCapacity), in a new epoch.
func New(node string, capacity int) *Log {
	if capacity <= 0 {
		capacity = DefaultCapacity
	}
	return &Log{node: node, epoch: newEpoch(), capacity: capacity, first: 1}
}

// Add records an event of sandbox id (in project, a path) now, and
// writes it to the log's file if it has one.
func (l *Log) Add(kind, id, project, reason, message string) {
	if l == nil {
		return
	}
	ev := pullpack.Event{AtUnixMs: time.Now().UnixMilli(), Kind: kind, SandboxID: id, Project: project, Reason: reason, Message: message}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return
	}
	if l.ring == nil {
		l.ring = make([]pullpack.Event, l.capacity)
	}
	l.last++
	l.ring[(l.last-1)%uint64(l.capacity)] = ev
	if l.last-l.first >= uint64(l.capacity) {
		l.first = l.last - uint64(l.capacity) + 1
	}
	l.write(l.last, &ev)
}

// message is event ev, numbered seq, as a message; the caller holds l.mu.
func (l *Log) message(seq uint64, ev *pullpack.Event) *dsecv1.Event {
	return &dsecv1.Event{Key: l.node + "/" + l.epoch + "/" + strconv.FormatUint(seq, 10), AtUnixMs: ev.AtUnixMs, Project: ev.Project,
		SandboxId: ev.SandboxID, Kind: ev.Kind, Node: l.node, Reason: ev.Reason, Message: ev.Message}
}

// fromMessage is the value a log keeps of message ev.
func fromMessage(ev *dsecv1.Event) pullpack.Event {
	return pullpack.Event{AtUnixMs: ev.GetAtUnixMs(), Kind: ev.GetKind(), SandboxID: ev.GetSandboxId(), Project: ev.GetProject(),
		Reason: ev.GetReason(), Message: ev.GetMessage()}
}

// Head returns the log's epoch and the sequence number of its newest
// event (0: none yet).
func (l *Log) Head() (epoch string, seq uint64) {
	if l == nil {
		return "", 0
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.epoch, l.last
}

// Read returns at most limit events after sequence number after of epoch
// (another epoch, or "", reads from the oldest kept), next (the sequence
// number of the last returned, or after when none) and how many events
// after after the log no longer keeps.
func (l *Log) Read(epoch string, after uint64, limit int) (evs []*dsecv1.Event, next, lost uint64) {
	if l == nil {
		return nil, after, 0
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	from, to, lost := l.span(epoch, after, limit)
	for seq := from; seq <= to; seq++ {
		evs = append(evs, l.message(seq, &l.ring[(seq-1)%uint64(l.capacity)]))
	}
	if to < from {
		return evs, from - 1, lost
	}
	return evs, to, lost
}

// ReadPacked is Read with the events packed (pullpack), in buf's space
// (nil: new), where it made a message of each.
func (l *Log) ReadPacked(epoch string, after uint64, limit int, buf []byte) (page []byte, n int, next, lost uint64) {
	if l == nil {
		return nil, 0, after, 0
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	from, to, lost := l.span(epoch, after, limit)
	if to < from {
		return nil, 0, from - 1, lost
	}
	if buf == nil {
		// Room for the page as a hollow node's events take: its growth
		// by doubling was most of what a pull allocated.
		buf = make([]byte, 0, 64+int(to-from+1)*64)
	}
	w := pullpack.NewWriter(buf, l.node, from)
	for seq := from; seq <= to; seq++ {
		w.Add(&l.ring[(seq-1)%uint64(l.capacity)])
	}
	return w.Bytes(), w.Len(), to, lost
}

// span is which events a read after after of epoch returns, at most
// limit: from..to (to < from: none, from-1 the read's next) and how many
// after after the log no longer keeps; the caller holds l.mu.
func (l *Log) span(epoch string, after uint64, limit int) (from, to, lost uint64) {
	if epoch != l.epoch || after > l.last {
		after = 0
	}
	from = after + 1
	if from < l.first {
		lost = l.first - from
		from = l.first
	}
	to = min(l.last, from+uint64(max(limit, 0))-1)
	return from, to, lost
}

// Epoch is the log's epoch.
func (l *Log) Epoch() string {
	e, _ := l.Head()
	return e
}
