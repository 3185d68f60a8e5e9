package pullpack

import (
	"encoding/binary"
	"fmt"
	"math"
)

// A ledger page (EventsResponse.packed_usage) is the records of a node's
// cost ledger a pull brings, packed as its events are: a format byte (1),
// the node's name, how many records (4 bytes), then each record: its
// sandbox and project, its labels (how many, then each key and value,
// keys in order), its start, end (0 while it lives) and last update (Unix
// milliseconds, varints), its CPU microseconds, memory GiB-seconds and
// disk GiB-hours (the two as 8-byte floats), its disk's peak, snapshot and
// egress bytes (varints), and whether it is its sandbox's sole report (a
// byte). Strings are a length (uvarint) and their bytes.

// Record is a ledger record as packed.
type Record struct {
	SandboxID, Project string
	Labels             map[string]string
	StartedUnixMs      int64
	EndedUnixMs        int64 // 0 while it lives
	UpdatedUnixMs      int64
	CPUUsec            int64
	MemoryGiBSeconds   float64
	DiskGiBHours       float64
	DiskPeakBytes      int64
	SnapshotBytes      int64
	EgressBytes        int64
	Sole               bool
}

// maxSortedLabels is how many labels a record's keys are put in order
// for without allocating; more are still put in order.
const maxSortedLabels = 8

// RecordWriter writes a ledger page.
type RecordWriter struct {
	w Writer
}

// NewRecordWriter starts a page of node's ledger records in b's space
// (nil: a new one).
func NewRecordWriter(b []byte, node string) *RecordWriter {
	rw := &RecordWriter{w: Writer{b: append(b[:0], format)}}
	rw.w.str(node)
	rw.w.countAt = len(rw.w.b)
	rw.w.b = append(rw.w.b, 0, 0, 0, 0)
	return rw
}

// Add adds the page's next record.
func (rw *RecordWriter) Add(r *Record) {
	w := &rw.w
	w.str(r.SandboxID)
	w.str(r.Project)
	w.b = binary.AppendUvarint(w.b, uint64(len(r.Labels)))
	// Keys in order, so that records with the same labels pack them the
	// same: the reader makes one map for them.
	var small [maxSortedLabels]string
	keys := small[:0]
	if len(r.Labels) > maxSortedLabels {
		keys = make([]string, 0, len(r.Labels))
	}
	for k := range r.Labels {
		i := len(keys)
		keys = append(keys, k)
		for ; i > 0 && keys[i-1] > k; i-- {
			keys[i] = keys[i-1]
		}
		keys[i] = k
	}
	for _, k := range keys {
		w.str(k)
		w.str(r.Labels[k])
	}
	w.b = binary.AppendVarint(w.b, r.StartedUnixMs)
	w.b = binary.AppendVarint(w.b, r.EndedUnixMs)
	w.b = binary.AppendVarint(w.b, r.UpdatedUnixMs)
	w.b = binary.AppendVarint(w.b, r.CPUUsec)
	w.b = binary.BigEndian.AppendUint64(w.b, math.Float64bits(r.MemoryGiBSeconds))
	w.b = binary.BigEndian.AppendUint64(w.b, math.Float64bits(r.DiskGiBHours))
	w.b = binary.AppendVarint(w.b, r.DiskPeakBytes)
	w.b = binary.AppendVarint(w.b, r.SnapshotBytes)
	w.b = binary.AppendVarint(w.b, r.EgressBytes)
	sole := byte(0)
	if r.Sole {
		sole = 1
	}
	w.b = append(w.b, sole)
	w.n++
}

// Len is how many records the page holds.
func (rw *RecordWriter) Len() int { return rw.w.n }

// Bytes is the page.
func (rw *RecordWriter) Bytes() []byte { return rw.w.Bytes() }

// RecordCount is how many records ledger page data says it holds, for
// a reader to make room for them: at most one a byte of the page (a
// record takes more), 0 for a page that is not one.
func RecordCount(data []byte) int {
	r, _, n, err := readRecordHeader(data)
	if err != nil {
		return 0
	}
	return min(int(n), len(r.b))
}

// readRecordHeader reads ledger page data's header: the node's name and
// how many records follow, which r reads next.
func readRecordHeader(data []byte) (r *reader, node string, count uint32, err error) {
	if r, err = newReader(data); err != nil {
		return nil, "", 0, err
	}
	node = r.str(false)
	count = r.count()
	return r, node, count, r.err
}

// ReadRecords reads ledger page data, calling fn with the node's name and
// each record, in order; it stops at the first fault, which it returns (a
// page cut short, or with bytes past its last record, is one). Records
// with the same labels share one map, and projects repeated share their
// string: fn may keep them, and must not change the maps.
func ReadRecords(data []byte, fn func(node string, r Record)) error {
	r, node, count, err := readRecordHeader(data)
	if err != nil {
		return err
	}
	labelSets := map[string]map[string]string{} // by their packed bytes
	for range count {
		rec := Record{SandboxID: r.str(false), Project: r.str(true)}
		rec.Labels = r.labels(labelSets)
		rec.StartedUnixMs, rec.EndedUnixMs, rec.UpdatedUnixMs = r.varint(), r.varint(), r.varint()
		rec.CPUUsec = r.varint()
		rec.MemoryGiBSeconds, rec.DiskGiBHours = r.float(), r.float()
		rec.DiskPeakBytes, rec.SnapshotBytes, rec.EgressBytes = r.varint(), r.varint(), r.varint()
		switch b := r.byte(); b {
		case 0, 1:
			rec.Sole = b == 1
		default:
			if r.err == nil {
				r.err = fmt.Errorf("%w: sole is %d", ErrMalformed, b)
			}
		}
		if r.err != nil {
			return r.err
		}
		fn(node, rec)
	}
	if len(r.b) > 0 {
		return fmt.Errorf("%w: %d bytes past its %d records", ErrMalformed, len(r.b), count)
	}
	return nil
}

// labels reads a record's labels: the map made for the same bytes before
// in this page, or a new one (nil for none).
func (r *reader) labels(sets map[string]map[string]string) map[string]string {
	start := r.b
	n := r.uvarint()
	if r.err != nil || n == 0 {
		return nil
	}
	if n > uint64(len(r.b)) {
		r.err = fmt.Errorf("%w: %d labels where %d bytes are left", ErrMalformed, n, len(r.b))
		return nil
	}
	// Skip them first, to look the set up by its bytes.
	body := r.b
	for range 2 * n {
		r.raw()
	}
	if r.err != nil {
		return nil
	}
	raw := start[:len(start)-len(r.b)]
	if m, ok := sets[string(raw)]; ok {
		return m
	}
	m := make(map[string]string, n)
	sub := reader{b: body, seen: r.seen}
	for range n {
		k := sub.str(true)
		m[k] = sub.str(true)
	}
	sets[string(raw)] = m
	return m
}

func (r *reader) float() float64 {
	b := r.take(8, "a float cut short")
	if b == nil {
		return 0
	}
	return math.Float64frombits(binary.BigEndian.Uint64(b))
}

func (r *reader) byte() byte {
	b := r.take(1, "cut short")
	if b == nil {
		return 0
	}
	return b[0]
}
