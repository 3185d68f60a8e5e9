package eventlog

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/pullpack"
)

// The log's files in its directory. A segment holds a header record (the
// node, the epoch and the sequence number of its first event) and then
// one record per event, numbered on from it. When the current segment
// holds Capacity events it becomes the previous one (replacing the one
// before) and a new one is begun, so the directory keeps at most twice
// Capacity events: the last Capacity of them are what a log reads back.
const (
	segmentName  = "log"
	previousName = "log.old"
	corruptName  = "log.corrupt" // the last segment found corrupt, kept to be looked at
	stateName    = "state"       // the boot the log was last written in, and whether it was closed
	headerMagic  = "dsec-eventlog-1"
	maxRecord    = 1 << 20
	frameLen     = 8 // a record's length and CRC-32C
)

var crcTable = crc32.MakeTable(crc32.Castagnoli)

// Options are how Open keeps a node's log.
type Options struct {
	// Capacity is how many events the log keeps (0: DefaultCapacity).
	Capacity int
	// BootID names the running kernel's boot ("": read from
	// /proc/sys/kernel/random/boot_id). Tests set it.
	BootID string
	// Log is where the log says what it found and dropped (nil: nowhere).
	Log *slog.Logger
}

// header is a segment's first record.
type header struct {
	Magic string `json:"magic"`
	Node  string `json:"node"`
	Epoch string `json:"epoch"`
	First uint64 `json:"first"` // the sequence number of the segment's first event
}

// state is the directory's state file: the boot in which the log was last
// opened for writing, and whether it was closed (its segment synced) since.
type state struct {
	Boot   string `json:"boot"`
	Closed bool   `json:"closed"`
}

// Open returns node's log kept in dir (made if missing): the epoch and
// the events its files hold, written by an edge of the same node before
// it stopped or was killed, and from then on each event added is written
// to them (one write, no fsync). It starts a new epoch, saying why in a
// log line, when dir holds no log, another node's, a segment it cannot
// read (kept as log.corrupt), or one written before the machine restarted
// and never closed: a crash of the machine may have lost the segment's
// last events, and continuing would number new events as those, which an
// apiserver may already have stored. A torn last record (the edge killed
// mid-write) is dropped. It fails only when dir cannot be written.
func Open(node, dir string, o Options) (*Log, error) {
	if o.Capacity <= 0 {
		o.Capacity = DefaultCapacity
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	if o.BootID == "" {
		o.BootID = bootID()
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("make the event log's directory %s: %w", dir, err)
	}
	l := &Log{node: node, capacity: o.Capacity, first: 1, dir: dir, boot: o.BootID, log: o.Log}
	cur, curErr := readSegment(filepath.Join(dir, segmentName))
	prev, prevErr := readSegment(filepath.Join(dir, previousName))
	st, stErr := readState(dir)
	fresh := func(why string, args ...any) error {
		if why != "" {
			o.Log.Warn("the event log starts a new epoch: "+why, args...)
		}
		l.epoch = newEpoch()
		os.Remove(filepath.Join(dir, previousName))
		return l.begin(1)
	}
	var err error
	switch {
	case errors.Is(curErr, os.ErrNotExist) && errors.Is(prevErr, os.ErrNotExist):
		err = fresh("")
	case stErr != nil:
		err = fresh("its state is unreadable", "dir", dir, "err", stErr)
	case st.Boot != o.BootID && !st.Closed:
		err = fresh("the machine restarted since it was written, and it was not closed: events not yet on the disk may be lost, and their numbers must not be used again", "dir", dir)
	case curErr != nil && !errors.Is(curErr, os.ErrNotExist) && !errors.Is(curErr, errNoHeader):
		os.Rename(filepath.Join(dir, segmentName), filepath.Join(dir, corruptName))
		err = fresh("its segment is corrupt (kept as "+corruptName+")", "dir", dir, "err", curErr)
	case curErr == nil && cur.node != node:
		err = fresh("its files are another node's", "dir", dir, "node", cur.node)
	case curErr != nil && prevErr == nil && prev.node != node:
		err = fresh("its files are another node's", "dir", dir, "node", prev.node)
	default:
		err = l.resume(cur, curErr, prev, prevErr)
	}
	if err != nil {
		return nil, err
	}
	if err := writeState(dir, state{Boot: o.BootID}); err != nil {
		l.f.Close()
		return nil, err
	}
	return l, nil
}

// resume continues the epoch of the segments found: the current one
// (missing or headless when an edge died between a rotation's rename and
// its new header), preceded by the previous one if its events lead to it.
func (l *Log) resume(cur segment, curErr error, prev segment, prevErr error) error {
	if prevErr != nil && !errors.Is(prevErr, os.ErrNotExist) {
		l.log.Warn("the event log's previous segment is unreadable: its events are dropped", "dir", l.dir, "err", prevErr)
	}
	var evs []*dsecv1.Event
	var next uint64
	switch {
	case curErr == nil:
		l.epoch, next = cur.epoch, cur.first+uint64(len(cur.events))
		if prevErr == nil && prev.epoch == cur.epoch && prev.first+uint64(len(prev.events)) == cur.first {
			evs = prev.events
		}
		evs = append(evs, cur.events...)
		if cur.torn > 0 {
			l.log.Warn("the event log's last record was torn (the edge stopped mid-write): dropped", "dir", l.dir, "bytes", cur.torn)
		}
	case prevErr == nil:
		l.epoch, next = prev.epoch, prev.first+uint64(len(prev.events))
		evs = prev.events
	default:
		l.epoch, next = newEpoch(), 1
		l.log.Warn("the event log starts a new epoch: it has no readable segment", "dir", l.dir)
	}
	if len(evs) > l.capacity {
		evs = evs[len(evs)-l.capacity:]
	}
	l.last = next - 1
	l.first = next - uint64(len(evs))
	l.ring = make([]pullpack.Event, l.capacity)
	for i, ev := range evs {
		l.ring[(l.first+uint64(i)-1)%uint64(l.capacity)] = fromMessage(ev)
	}
	if curErr != nil {
		return l.begin(next)
	}
	// Go on writing the current segment, without its torn tail.
	f, err := os.OpenFile(filepath.Join(l.dir, segmentName), os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("open the event log: %w", err)
	}
	if err := f.Truncate(cur.size); err != nil {
		f.Close()
		return fmt.Errorf("drop the event log's torn record: %w", err)
	}
	if _, err := f.Seek(cur.size, io.SeekStart); err != nil {
		f.Close()
		return fmt.Errorf("open the event log: %w", err)
	}
	l.f, l.inSegment = f, len(cur.events)
	l.log.Info("the event log goes on", "epoch", l.epoch, "seq", l.last, "kept", len(evs))
	return nil
}

// begin starts a new current segment whose first event is first,
// replacing any; the caller holds l.mu or owns l.
func (l *Log) begin(first uint64) error {
	hdr, _ := json.Marshal(header{Magic: headerMagic, Node: l.node, Epoch: l.epoch, First: first})
	f, err := os.OpenFile(filepath.Join(l.dir, segmentName), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("begin an event log segment: %w", err)
	}
	if _, err := f.Write(frame(nil, hdr)); err != nil {
		f.Close()
		return fmt.Errorf("begin an event log segment: %w", err)
	}
	l.f, l.inSegment = f, 0
	return nil
}

// rotate makes the current segment the previous one and begins another
// whose first event is next; the caller holds l.mu.
func (l *Log) rotate(next uint64) error {
	l.f.Close()
	l.f = nil
	if err := os.Rename(filepath.Join(l.dir, segmentName), filepath.Join(l.dir, previousName)); err != nil {
		return fmt.Errorf("rotate the event log: %w", err)
	}
	return l.begin(next)
}

// write appends ev (numbered seq) to the current segment in one write;
// the caller holds l.mu. A log that cannot write removes its files and
// goes on in memory: the next Open starts a new epoch rather than number
// events again that an apiserver may have pulled.
func (l *Log) write(seq uint64, ev *pullpack.Event) {
	if l.f == nil {
		return
	}
	err := func() error {
		if l.inSegment >= l.capacity {
			if err := l.rotate(seq); err != nil {
				return err
			}
		}
		l.buf = binary.AppendUvarint(l.buf[:0], seq)
		var err error
		if l.buf, err = (proto.MarshalOptions{}).MarshalAppend(l.buf, l.message(seq, ev)); err != nil {
			return fmt.Errorf("encode event %d: %w", seq, err)
		}
		l.rec = frame(l.rec[:0], l.buf)
		if _, err := l.f.Write(l.rec); err != nil {
			return fmt.Errorf("write event %d: %w", seq, err)
		}
		l.inSegment++
		return nil
	}()
	if err != nil {
		l.log.Error("the event log cannot write its file: it goes on in memory, and the node's next start begins a new epoch", "dir", l.dir, "err", err)
		if l.f != nil {
			l.f.Close()
			l.f = nil
		}
		for _, name := range []string{segmentName, previousName, stateName} {
			os.Remove(filepath.Join(l.dir, name))
		}
	}
}

// Close syncs the log's file and records that it was closed, so that its
// epoch goes on after the machine restarts. Events added after Close are
// dropped; it must be called once the node records no more.
func (l *Log) Close() error {
	if l == nil {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closed = true
	if l.f == nil {
		return nil
	}
	// The previous segment too: nothing synced it when it was rotated.
	if prev, err := os.Open(filepath.Join(l.dir, previousName)); err == nil {
		prev.Sync()
		prev.Close()
	}
	err := l.f.Sync()
	if cerr := l.f.Close(); err == nil {
		err = cerr
	}
	l.f = nil
	if err != nil {
		return fmt.Errorf("sync the event log: %w", err)
	}
	return writeState(l.dir, state{Boot: l.boot, Closed: true})
}

// frame appends payload to dst as a record: its length, its CRC-32C, it.
func frame(dst, payload []byte) []byte {
	dst = binary.LittleEndian.AppendUint32(dst, uint32(len(payload)))
	dst = binary.LittleEndian.AppendUint32(dst, crc32.Checksum(payload, crcTable))
	return append(dst, payload...)
}

// segment is what readSegment found in a file.
type segment struct {
	node, epoch string
	first       uint64
	events      []*dsecv1.Event
	size        int64 // the length of its valid records
	torn        int   // bytes dropped after them
}

// errNoHeader: a segment ends before its header is whole (an edge died as
// it began it).
var errNoHeader = errors.New("the segment has no whole header")

// readSegment reads the segment at path. A bad record that runs to the
// file's end (or is followed by zeros only, as a machine crash leaves a
// file) is torn and dropped; one followed by more is corruption, an error.
func readSegment(path string) (segment, error) {
	var s segment
	data, err := os.ReadFile(path)
	if err != nil {
		return s, err
	}
	payload, n, bad := record(data)
	if bad {
		if torn(data, n) {
			return s, errNoHeader
		}
		return s, fmt.Errorf("%s: its header record is corrupt", path)
	}
	var h header
	if err := json.Unmarshal(payload, &h); err != nil || h.Magic != headerMagic || h.Epoch == "" || h.First == 0 {
		return s, fmt.Errorf("%s: not an event log segment (%q)", path, payload)
	}
	s.node, s.epoch, s.first = h.Node, h.Epoch, h.First
	prefix := h.Node + "/" + h.Epoch + "/"
	off := n
	for off < len(data) {
		payload, n, bad := record(data[off:])
		var ev *dsecv1.Event
		if !bad {
			ev, bad = decode(payload, s.first+uint64(len(s.events)), prefix)
		}
		if bad {
			if torn(data[off:], n) {
				s.torn = len(data) - off
				break
			}
			return s, fmt.Errorf("%s: record at byte %d is corrupt", path, off)
		}
		s.events = append(s.events, ev)
		off += n
	}
	s.size = int64(off)
	return s, nil
}

// record reads the record data begins with: its payload, its whole
// length, and whether it is bad (short, too long, or its CRC wrong).
func record(data []byte) (payload []byte, n int, bad bool) {
	if len(data) < frameLen {
		return nil, len(data), true
	}
	size := binary.LittleEndian.Uint32(data)
	if size > maxRecord || int(size) > len(data)-frameLen {
		return nil, len(data), true
	}
	payload = data[frameLen : frameLen+int(size)]
	if crc32.Checksum(payload, crcTable) != binary.LittleEndian.Uint32(data[4:]) {
		return nil, frameLen + int(size), true
	}
	return payload, frameLen + int(size), false
}

// decode reads an event record's payload, which must be numbered seq
// and keyed under prefix.
func decode(payload []byte, seq uint64, prefix string) (*dsecv1.Event, bool) {
	got, n := binary.Uvarint(payload)
	if n <= 0 || got != seq {
		return nil, true
	}
	ev := &dsecv1.Event{}
	if err := proto.Unmarshal(payload[n:], ev); err != nil || ev.GetKey() != fmt.Sprintf("%s%d", prefix, seq) {
		return nil, true
	}
	return ev, false
}

// torn says whether a bad record of n bytes at data's start is a torn
// tail: it reaches the end, or zeros alone follow it.
func torn(data []byte, n int) bool {
	return n >= len(data) || len(bytes.Trim(data[n:], "\x00")) == 0
}

// readState reads dir's state file; a missing one reads as written in no
// boot and not closed.
func readState(dir string) (state, error) {
	var st state
	data, err := os.ReadFile(filepath.Join(dir, stateName))
	if errors.Is(err, os.ErrNotExist) {
		return st, nil
	}
	if err != nil {
		return st, err
	}
	return st, json.Unmarshal(data, &st)
}

// writeState replaces dir's state file, synced: it decides whether the
// epoch goes on after a machine restart, so it must be on the disk.
func writeState(dir string, st state) error {
	data, _ := json.Marshal(st)
	tmp := filepath.Join(dir, stateName+".tmp")
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("write the event log's state: %w", err)
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, filepath.Join(dir, stateName))
	}
	if err == nil {
		if d, derr := os.Open(dir); derr == nil {
			err = d.Sync()
			d.Close()
		}
	}
	if err != nil {
		return fmt.Errorf("write the event log's state: %w", err)
	}
	return nil
}

// ReadDir reads the events the log kept in dir holds, oldest first,
// without changing its files (an edge may be writing them): what a test,
// or an operator, finds on a node's disk. A torn last record is left out.
func ReadDir(dir string) (epoch string, evs []*dsecv1.Event, err error) {
	cur, curErr := readSegment(filepath.Join(dir, segmentName))
	prev, prevErr := readSegment(filepath.Join(dir, previousName))
	if curErr != nil {
		return "", nil, curErr
	}
	if prevErr == nil && prev.epoch == cur.epoch && prev.first+uint64(len(prev.events)) == cur.first {
		evs = prev.events
	}
	return cur.epoch, append(evs, cur.events...), nil
}

func newEpoch() string {
	var b [8]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// bootID names the running kernel's boot ("" where it cannot be read:
// then every restart counts as the same boot's).
func bootID() string {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}
