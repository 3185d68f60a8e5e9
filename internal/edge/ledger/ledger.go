// Package ledger keeps a node's cost ledger: for each sandbox, what it
// used so far (CPU time, memory integrated over time, its writable layer's
// size integrated over time and at its largest, the snapshots it produced,
// what it sent out of its network namespace), with its project and labels,
// for the apiservers to pull into the metadata store (docs/usage.md).
//
// The sandbox manager feeds it: Start when a sandbox is made (or claimed
// from a warm pool), Observe with each sample it reads of a sandbox's
// cgroup, writable layer and veth (every Interval, and a last time before
// the sandbox's cgroup goes), AddSnapshot, and End. A sandbox's end, a
// snapshot and a checkpoint (a sample Checkpoint or more after the
// record's last change was offered) raise the ledger's version; other
// samples change the record in place, unversioned: the store is written
// per end and per checkpoint, not per sample, and an apiserver's Usage
// reads the live records of the nodes at query time (Live). The edge
// service reports the version in its Status and answers the apiservers'
// pulls with the records changed since the version they have (Changed,
// which reads the changed records only, newest last). Figures are
// cumulative and only grow, so a record stored twice, or by two
// apiservers, or read live beside its stored checkpoint, counts once.
//
// The ledger is saved to a file after each round of samples and read back
// when the edge starts, so a restarted dsecd (whose sandboxes live on)
// keeps the integrals; what a crash loses is the last round's. An ended
// sandbox's record is kept until the store holds it (a pull asked, at
// least StoredAfter ago, for the records after a version at or past its
// end's: the apiservers ask after the cursor the store keeps) and
// LiveEnded has passed since its end, or for Keep after its end, for
// apiservers that were away, then dropped.
package ledger

import (
	"cmp"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/pullpack"
)

const (
	// DefaultInterval is how often the manager samples its sandboxes.
	DefaultInterval = 10 * time.Second
	// Keep is how long an ended sandbox's record stays on the node.
	Keep = time.Hour
	// DefaultCheckpoint is how often a live sandbox's record is offered
	// to the apiservers' pulls, to be stored: a node lost for good loses
	// at most this much of its live sandboxes' use.
	DefaultCheckpoint = 5 * time.Minute
	// LiveEnded is how long after its end a sandbox's record stays on the
	// node at least, stored or not, for Live to read: a pull stores it
	// within a second or two of its end. Live reads one not yet stored
	// for as long as it is kept.
	LiveEnded = 10 * time.Second
	// StoredAfter is how long after a pull asked for the records after a
	// version the ledger takes those up to it for stored: the apiservers
	// ask after the cursor of their last pull's commit, which PostgreSQL
	// may take back for a moment (it commits pulls without waiting for
	// the disk: a crash loses up to three wal_writer_delay of them, 600
	// ms by default). A minute kept six times the records on a busy
	// hollow edge, for its garbage collector to go through.
	StoredAfter = 10 * time.Second
	gib         = 1 << 30
)

// Sample is one reading of a sandbox's counters. CPUUsec and EgressBytes
// are the counters as read (cumulative since the cgroup or veth was made);
// MemoryBytes and DiskBytes the sizes at At.
type Sample struct {
	At          time.Time
	CPUUsec     int64
	MemoryBytes int64
	DiskBytes   int64
	EgressBytes int64
}

// Record is one sandbox's ledger entry as Get returns it and the
// ledger's file keeps it: the figures, and what the next sample is
// integrated from.
type Record struct {
	SandboxID     string            `json:"sandbox_id"`
	Project       string            `json:"project"`
	Labels        map[string]string `json:"labels,omitempty"`
	Started       time.Time         `json:"started"`
	Ended         time.Time         `json:"ended,omitzero"`
	Updated       time.Time         `json:"updated"`
	CPUUsec       int64             `json:"cpu_usec"`
	MemoryGiBSec  float64           `json:"memory_gib_s"`
	DiskGiBHours  float64           `json:"disk_gib_h"`
	DiskPeakBytes int64             `json:"disk_peak_bytes"`
	SnapshotBytes int64             `json:"snapshot_bytes"`
	EgressBytes   int64             `json:"egress_bytes"`

	// The last sample: counters as read, sizes, when.
	Last Sample `json:"last"`
	// Sampled is false until the first sample: a sandbox claimed from a
	// warm pool counts from its claim, so its first sample is the base.
	Sampled bool `json:"sampled"`
	// fromZero: the counters count from 0 at the first sample (a sandbox
	// made for its caller: its start is its own).
	FromZero bool `json:"from_zero"`
	// Offered is when the record was last offered to the pulls (its
	// version raised): the next checkpoint is Checkpoint after it.
	Offered time.Time `json:"offered,omitzero"`
	// Reported says a report of the record may have been stored before
	// its end: it was offered to the pulls while it lived (a checkpoint,
	// a snapshot, read back from the file), or adopted (sampled before
	// any Start: a sandbox an earlier epoch may have reported). An ended
	// record not Reported is sole: its end is the only report of it ever
	// offered, which the store appends rather than looking its key up
	// (store.UsageRow.Sole).
	Reported bool `json:"reported,omitempty"`
}

// entry is a Record as the ledger holds it: its times in Unix
// nanoseconds (0: none), linked into the ledger's changed entries by
// itself. A hollow edge's ledger holds hundreds of thousands, each made
// and dropped within seconds: as a Record (288 bytes, and a list element
// of 48 for its place among the changed) they were a tenth of what the
// edge allocated in bench cluster.
type entry struct {
	id, project string
	labels      map[string]string
	started     int64
	ended       int64
	updated     int64
	offered     int64
	cpuUsec     int64
	memGiBSec   float64
	diskGiBH    float64
	diskPeak    int64
	snapshot    int64
	egress      int64
	last        sample
	sampled     bool
	fromZero    bool
	reported    bool
	// dropped: the ledger forgot it (no longer in Ledger.recs).
	dropped bool
	// seq is its version; 0 until it is first offered to the pulls,
	// when it joins the changed entries, between prev and next.
	seq        uint64
	prev, next *entry
}

// sample is a Sample as an entry keeps it.
type sample struct {
	at                         int64
	cpuUsec, mem, disk, egress int64
}

// nanos is t in Unix nanoseconds, 0 for the zero time.
func nanos(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

// timeOf is Unix nanoseconds ns as a time, the zero time for 0.
func timeOf(ns int64) time.Time {
	if ns == 0 {
		return time.Time{}
	}
	return time.Unix(0, ns)
}

// millis is Unix nanoseconds ns in Unix milliseconds.
func millis(ns int64) int64 { return ns / int64(time.Millisecond) }

// record is r as Get returns it and the file keeps it.
func (r *entry) record() Record {
	return Record{SandboxID: r.id, Project: r.project, Labels: r.labels, Started: timeOf(r.started), Ended: timeOf(r.ended),
		Updated: timeOf(r.updated), CPUUsec: r.cpuUsec, MemoryGiBSec: r.memGiBSec, DiskGiBHours: r.diskGiBH,
		DiskPeakBytes: r.diskPeak, SnapshotBytes: r.snapshot, EgressBytes: r.egress,
		Last: Sample{At: timeOf(r.last.at), CPUUsec: r.last.cpuUsec, MemoryBytes: r.last.mem, DiskBytes: r.last.disk,
			EgressBytes: r.last.egress},
		Sampled: r.sampled, FromZero: r.fromZero, Offered: timeOf(r.offered), Reported: r.reported}
}

// entryOf is r as the ledger holds it.
func entryOf(r *Record) *entry {
	return &entry{id: r.SandboxID, project: r.Project, labels: r.Labels, started: nanos(r.Started), ended: nanos(r.Ended),
		updated: nanos(r.Updated), offered: nanos(r.Offered), cpuUsec: r.CPUUsec, memGiBSec: r.MemoryGiBSec,
		diskGiBH: r.DiskGiBHours, diskPeak: r.DiskPeakBytes, snapshot: r.SnapshotBytes, egress: r.EgressBytes,
		last: sample{at: nanos(r.Last.At), cpuUsec: r.Last.CPUUsec, mem: r.Last.MemoryBytes, disk: r.Last.DiskBytes,
			egress: r.Last.EgressBytes},
		sampled: r.Sampled, fromZero: r.FromZero, reported: r.Reported}
}

// seqList is the entries offered to the pulls, by version, linked
// through the entries from the newest (back) to the oldest: the pulls
// read it from the back, so nothing keeps its front.
type seqList struct{ back *entry }

// remove takes r, which is in q, out of it.
func (q *seqList) remove(r *entry) {
	if r.prev != nil {
		r.prev.next = r.next
	}
	if r.next != nil {
		r.next.prev = r.prev
	} else {
		q.back = r.prev
	}
	r.prev, r.next = nil, nil
}

// pushBack puts r, which is not in q, at its back.
func (q *seqList) pushBack(r *entry) {
	r.prev, r.next = q.back, nil
	if q.back != nil {
		q.back.next = r
	}
	q.back = r
}

// Ledger is a node's cost ledger. It is safe for concurrent use; a nil
// *Ledger records nothing.
type Ledger struct {
	node  string
	epoch string
	path  string // where it is saved ("": nowhere)
	log   *slog.Logger
	// checkpoint is how often a live record is offered to the pulls.
	checkpoint time.Duration

	mu    sync.Mutex
	seq   uint64
	recs  map[string]*entry
	bySeq seqList // the entries offered to the pulls, by seq, oldest first
	// ends are the ended records in the order End was called, each with
	// its end, for Save to drop those stored or ended more than Keep ago
	// without reading every record (a hollow edge's ledger holds hundreds
	// of thousands); one since dropped or started again is passed over.
	ends endQueue
	// asks are the versions of this epoch the pulls asked after, in time
	// order, one a second at most, until StoredAfter has passed and Save
	// takes them for stored.
	asks []asked
	// stored is the version the store holds records of this epoch to.
	stored uint64
}

// asked is a pull's version asked after (the latest of its second), and
// when (Unix nanoseconds).
type asked struct {
	after uint64
	at    int64
}

// ending is a record and when it ended (Unix nanoseconds), in
// Ledger.ends.
type ending struct {
	r  *entry
	at int64
}

// endChunk is how many endings a chunk of an endQueue holds.
const endChunk = 4096

// endQueue is a FIFO of endings in chunks, so that a busy node's queue
// grows without copying what it holds (a slice's growth copied each
// ending about four times over, most of what End allocated).
type endQueue struct {
	chunks [][]ending
}

func (q *endQueue) push(e ending) {
	if n := len(q.chunks); n == 0 || len(q.chunks[n-1]) == cap(q.chunks[n-1]) {
		q.chunks = append(q.chunks, make([]ending, 0, endChunk))
	}
	last := &q.chunks[len(q.chunks)-1]
	*last = append(*last, e)
}

// front is the oldest ending; false when there is none.
func (q *endQueue) front() (ending, bool) {
	if len(q.chunks) == 0 {
		return ending{}, false
	}
	return q.chunks[0][0], true
}

// pop drops the oldest ending.
func (q *endQueue) pop() {
	c := q.chunks[0]
	c[0] = ending{}
	if len(c) > 1 {
		q.chunks[0] = c[1:]
		return
	}
	q.chunks[0] = nil
	q.chunks = q.chunks[1:]
}

// Open returns node's ledger, saved at path ("": kept in memory only) and
// read back from it if it is there, in a new epoch.
func Open(node, path string, log *slog.Logger) (*Ledger, error) {
	var b [8]byte
	rand.Read(b[:])
	l := &Ledger{node: node, epoch: hex.EncodeToString(b[:]), path: path, log: log, recs: map[string]*entry{},
		checkpoint: DefaultCheckpoint}
	if path == "" {
		return l, nil
	}
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return l, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read the cost ledger: %w", err)
	}
	var recs []*Record
	if err := json.Unmarshal(data, &recs); err != nil {
		// A torn file loses the integrals, not the node.
		log.Warn("the cost ledger's file is unreadable: starting a new one", "path", path, "err", err)
		return l, nil
	}
	var ends []ending
	for _, rec := range recs {
		r := entryOf(rec)
		if old := l.recs[r.id]; old != nil {
			l.drop(old) // twice in the file: the later one counts
		}
		l.recs[r.id] = r
		l.bump(r)
		if r.ended != 0 {
			ends = append(ends, ending{r, r.ended})
		}
	}
	slices.SortFunc(ends, func(a, b ending) int { return cmp.Compare(a.at, b.at) })
	for _, e := range ends {
		l.ends.push(e)
	}
	return l, nil
}

// SetCheckpoint sets how often a live sandbox's record is offered to the
// pulls (0: DefaultCheckpoint); call it before the first sample.
func (l *Ledger) SetCheckpoint(d time.Duration) {
	if l == nil {
		return
	}
	if d <= 0 {
		d = DefaultCheckpoint
	}
	l.mu.Lock()
	l.checkpoint = d
	l.mu.Unlock()
}

// Checkpoint is how often a live sandbox's record is offered to the pulls.
func (l *Ledger) Checkpoint() time.Duration {
	if l == nil {
		return DefaultCheckpoint
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.checkpoint
}

// Node is the node whose ledger it is.
func (l *Ledger) Node() string { return l.node }

// Start records that sandbox id was made for a caller (fresh) or claimed
// from a warm pool (not fresh: what it used before its claim is nobody's).
// The record keeps labels as given, not a copy (a copy each sandbox was a
// tenth of what a busy node's ledger allocated): the caller never changes
// the map after, as a sandbox's spec, whose labels are replaced and never
// changed in place.
func (l *Ledger) Start(id, project string, labels map[string]string, at time.Time, fresh bool) {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.recs[id]
	if r != nil && r.ended == 0 {
		return
	}
	if r != nil {
		l.drop(r)
	}
	// Not bumped: nothing to pull until its first checkpoint or its end.
	ns := at.UnixNano()
	l.recs[id] = &entry{id: id, project: project, labels: labels, started: ns, updated: ns, fromZero: fresh, offered: ns}
}

// bump raises the ledger's version to r's: r is the newest change,
// offered to the pulls; the caller holds l.mu.
func (l *Ledger) bump(r *entry) {
	if r.seq != 0 {
		l.bySeq.remove(r)
	}
	l.seq++
	r.seq = l.seq
	l.bySeq.pushBack(r)
	r.offered = r.updated
	if r.ended == 0 {
		r.reported = true
	}
}

// drop forgets r; the caller holds l.mu.
func (l *Ledger) drop(r *entry) {
	if r.seq != 0 {
		l.bySeq.remove(r)
	}
	r.dropped = true
	delete(l.recs, r.id)
}

// Observe adds sample s of sandbox id: the CPU time and egress since the
// last sample (a counter that went back, a cgroup or veth made again,
// counts from 0), memory and disk integrated over the time since (the
// mean of the two samples). A sandbox the ledger does not know (one a
// restarted edge re-adopted without a saved ledger) starts at s. The
// record is offered to the pulls when a checkpoint is due (Live reads it
// in between).
func (l *Ledger) Observe(id, project string, labels map[string]string, s Sample) {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.observe(id, project, labels, s)
}

// Observation is one sandbox's sample, for ObserveAll.
type Observation struct {
	ID, Project string
	Labels      map[string]string
	Sample      Sample
}

// ObserveAll is Observe of each of obs, under one lock: a round of
// samples of many sandboxes.
func (l *Ledger) ObserveAll(obs []Observation) {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, o := range obs {
		l.observe(o.ID, o.Project, o.Labels, o.Sample)
	}
}

// observe is Observe, and returns the record; the caller holds l.mu.
func (l *Ledger) observe(id, project string, labels map[string]string, s Sample) *entry {
	at := s.At.UnixNano()
	r := l.recs[id]
	if r == nil {
		r = &entry{id: id, project: project, labels: maps.Clone(labels), started: at, offered: at, reported: true}
		l.recs[id] = r
	}
	switch {
	case !r.sampled && r.fromZero:
		r.cpuUsec += s.CPUUsec
		r.egress += s.EgressBytes
		// Nothing before the first sample is known but the start: the
		// sizes grew from 0 since then.
		if dt := seconds(at - r.started); dt > 0 {
			r.memGiBSec += float64(s.MemoryBytes) / 2 * dt / gib
			r.diskGiBH += float64(s.DiskBytes) / 2 * dt / gib / 3600
		}
	case r.sampled:
		r.cpuUsec += delta(r.last.cpuUsec, s.CPUUsec)
		r.egress += delta(r.last.egress, s.EgressBytes)
		if dt := seconds(at - r.last.at); dt > 0 {
			r.memGiBSec += float64(r.last.mem+s.MemoryBytes) / 2 * dt / gib
			r.diskGiBH += float64(r.last.disk+s.DiskBytes) / 2 * dt / gib / 3600
		}
	}
	r.sampled = true
	r.last = sample{at: at, cpuUsec: s.CPUUsec, mem: s.MemoryBytes, disk: s.DiskBytes, egress: s.EgressBytes}
	r.diskPeak = max(r.diskPeak, s.DiskBytes)
	r.updated = at
	if project != "" || r.project == "" {
		r.project = project
	}
	if labels != nil && !maps.Equal(r.labels, labels) {
		r.labels = maps.Clone(labels)
	}
	if at-r.offered >= int64(l.checkpoint) {
		l.bump(r)
	}
	return r
}

// seconds is ns nanoseconds in seconds.
func seconds(ns int64) float64 { return time.Duration(ns).Seconds() }

// delta is what a counter grew by from prev to now; a counter that went
// back was made again and counts from 0.
func delta(prev, now int64) int64 {
	if now < prev {
		return now
	}
	return now - prev
}

// AddSnapshot adds bytes of a snapshot sandbox id produced.
func (l *Ledger) AddSnapshot(id string, bytes int64) {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if r := l.recs[id]; r != nil {
		r.snapshot += bytes
		r.updated = time.Now().UnixNano()
		l.bump(r)
	}
}

// End records that sandbox id ended at at: its figures are final (the
// manager observed it a last time before its cgroup went).
func (l *Ledger) End(id string, at time.Time) {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.end(l.recs[id], at)
}

// Finish is Observe of last, sandbox id's last sample, then End at its
// time, under one lock.
func (l *Ledger) Finish(id, project string, labels map[string]string, last Sample) {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.end(l.observe(id, project, labels, last), last.At)
}

// end is End of r (nil: a sandbox the ledger does not know); the caller
// holds l.mu.
func (l *Ledger) end(r *entry, at time.Time) {
	if r != nil && r.ended == 0 {
		r.ended = at.UnixNano()
		r.updated = r.ended
		l.ends.push(ending{r, r.ended})
		l.bump(r)
	}
}

// Head is the ledger's epoch and version (0: nothing recorded yet).
func (l *Ledger) Head() (epoch string, seq uint64) {
	if l == nil {
		return "", 0
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.epoch, l.seq
}

// Changed returns the records changed after version after of epoch (of
// another epoch: every record kept), the ledger's epoch, and the version
// they bring the caller to.
func (l *Ledger) Changed(epoch string, after uint64) (recs []*dsecv1.UsageRecord, cur string, next uint64) {
	if l == nil {
		return nil, "", 0
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.changed(epoch, after, func(r *entry) { recs = append(recs, l.msg(r)) })
	return recs, l.epoch, l.seq
}

// changed calls fn with each record changed after version after of epoch
// (of another epoch: every record kept), newest first, back to the
// caller's version: a pull reads what changed, not the whole ledger. The
// caller holds l.mu.
func (l *Ledger) changed(epoch string, after uint64, fn func(r *entry)) {
	if epoch != l.epoch {
		after = 0
	} else {
		l.ask(after, time.Now())
	}
	for r := l.bySeq.back; r != nil && r.seq > after; r = r.prev {
		fn(r)
	}
}

// ask notes that a pull asked for the records after version after of
// this epoch: the store holds those up to it (a pull not due asks after
// the largest version, which says nothing, and is passed over). The
// caller holds l.mu.
func (l *Ledger) ask(after uint64, now time.Time) {
	if after > l.seq || after <= l.stored {
		return
	}
	if n := len(l.asks); n > 0 {
		last := &l.asks[n-1]
		if after <= last.after {
			return // an apiserver behind another: nothing new
		}
		if now.UnixNano()-last.at < int64(time.Second) {
			last.after = after
			return
		}
	}
	l.asks = append(l.asks, asked{after, now.UnixNano()})
}

// sole says r's end is the only report of it ever offered (Reported).
func (r *entry) sole() bool { return r.ended != 0 && !r.reported }

// ChangedPacked is Changed with the records packed (pullpack), in buf's
// space (nil: new), where it made a message of each.
func (l *Ledger) ChangedPacked(epoch string, after uint64, buf []byte) (page []byte, n int, cur string, next uint64) {
	if l == nil {
		return nil, 0, "", 0
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var w *pullpack.RecordWriter
	l.changed(epoch, after, func(r *entry) {
		if w == nil {
			if buf == nil {
				// Room for the records changed, as a hollow node's take:
				// growing by doubling was most of what a pull allocated.
				buf = make([]byte, 0, 64+min(l.seq-after, uint64(len(l.recs)))*96)
			}
			w = pullpack.NewRecordWriter(buf, l.node)
		}
		p := pullpack.Record{SandboxID: r.id, Project: r.project, Labels: r.labels, StartedUnixMs: millis(r.started),
			UpdatedUnixMs: millis(r.updated), EndedUnixMs: millis(r.ended), CPUUsec: r.cpuUsec, MemoryGiBSeconds: r.memGiBSec,
			DiskGiBHours: r.diskGiBH, DiskPeakBytes: r.diskPeak, SnapshotBytes: r.snapshot, EgressBytes: r.egress, Sole: r.sole()}
		w.Add(&p)
	})
	if w == nil {
		return nil, 0, l.epoch, l.seq
	}
	return w.Bytes(), w.Len(), l.epoch, l.seq
}

// Live returns the records of the sandboxes that live, and of those that
// ended less than LiveEnded before now or are not known stored yet, of the
// projects given and those under them (none: every project), for an
// apiserver's Usage to add to the store's rows.
func (l *Ledger) Live(projects []string, now time.Time) []*dsecv1.UsageRecord {
	if l == nil {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []*dsecv1.UsageRecord
	for _, r := range l.recs {
		if r.ended != 0 && now.UnixNano()-r.ended > int64(LiveEnded) && r.seq <= l.stored {
			continue
		}
		if len(projects) > 0 && !slices.ContainsFunc(projects, func(p string) bool { return under(r.project, p) }) {
			continue
		}
		out = append(out, l.msg(r))
	}
	return out
}

// under says whether project is path or under it ("" and "/": the root).
func under(project, path string) bool {
	path = strings.Trim(path, "/")
	project = strings.Trim(project, "/")
	return path == "" || project == path || strings.HasPrefix(project, path+"/")
}

// msg is r as the pulls and Live send it. Its labels are r's map, not a
// copy: the ledger never changes a record's map in place (a change of
// labels replaces it), and the message is only read.
func (l *Ledger) msg(r *entry) *dsecv1.UsageRecord {
	return &dsecv1.UsageRecord{SandboxId: r.id, Project: r.project, Labels: r.labels, Node: l.node,
		StartedUnixMs: millis(r.started), UpdatedUnixMs: millis(r.updated), EndedUnixMs: millis(r.ended), Sole: r.sole(),
		Usage: &dsecv1.UsageFigures{CpuUsec: r.cpuUsec, MemoryGibSeconds: r.memGiBSec, DiskGibHours: r.diskGiBH,
			DiskPeakBytes: r.diskPeak, SnapshotBytes: r.snapshot, EgressBytes: r.egress, Sandboxes: 1}}
}

// Get returns a copy of sandbox id's record.
func (l *Ledger) Get(id string) (Record, bool) {
	if l == nil {
		return Record{}, false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	r, ok := l.recs[id]
	if !ok {
		return Record{}, false
	}
	return r.record(), true
}

// Save drops the records of sandboxes that ended more than LiveEnded ago
// and are stored (a pull asked after their version at least StoredAfter
// ago), or ended more than Keep ago, and writes the rest to the ledger's
// file (replaced whole: a crash leaves the old one or the new); a ledger
// kept in memory only drops them.
func (l *Ledger) Save(now time.Time) error {
	if l == nil {
		return nil
	}
	l.mu.Lock()
	i := 0
	for ; i < len(l.asks) && now.UnixNano()-l.asks[i].at >= int64(StoredAfter); i++ {
		l.stored = max(l.stored, l.asks[i].after)
	}
	l.asks = append(l.asks[:0], l.asks[i:]...)
	// Ends come about in time order, their versions in order too: the
	// first neither stored nor past Keep ends the drops (one out of order
	// waits for those before it).
	for {
		d, ok := l.ends.front()
		if !ok {
			break
		}
		age := now.UnixNano() - d.at
		current := !d.r.dropped && d.r.ended == d.at
		if age <= int64(Keep) && (age <= int64(LiveEnded) || current && d.r.seq > l.stored) {
			break
		}
		if current {
			l.drop(d.r)
		}
		l.ends.pop()
	}
	var recs []Record
	if l.path != "" {
		recs = make([]Record, 0, len(l.recs))
		for _, r := range l.recs {
			recs = append(recs, r.record())
		}
	}
	l.mu.Unlock()
	if l.path == "" {
		return nil
	}
	data, err := json.Marshal(recs)
	if err != nil {
		return fmt.Errorf("save the cost ledger: %w", err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(l.path), ".ledger-*")
	if err != nil {
		return fmt.Errorf("save the cost ledger: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return fmt.Errorf("save the cost ledger: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("save the cost ledger: %w", err)
	}
	if err := os.Rename(tmp.Name(), l.path); err != nil {
		return fmt.Errorf("save the cost ledger: %w", err)
	}
	return nil
}
