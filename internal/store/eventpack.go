package store

import (
	"database/sql"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"time"
)

// Events are stored in packs (docs/events.md "Packs"): the events of one
// project in one pull, up to packMax of them, as one row whose IDs are the
// consecutive range [first, last]. A pack's row costs the store what one
// event's row did, whatever the events in it, and the row's project and
// times are what reads select packs by; ListEvents unpacks them.

// packMax is how many events one pack holds at most: a reader whose
// cursor is inside a pack decodes the whole pack to find its place.
const packMax = 512

// packFormat is the first byte of a pack's encoding: the only one so far.
const packFormat = 1

// eventPack is one pack to store: events of one project in order, IDs
// not yet given.
type eventPack struct {
	project       string
	events        []Event
	firstAt, last time.Time // the earliest and latest At
}

// packEvents groups evs into packs: by project, in order within each
// project, packMax at most to a pack.
func packEvents(evs []Event) []eventPack {
	var packs []eventPack
	open := map[string]int{} // project → index in packs of its open pack
	for _, ev := range evs {
		ev.At = nowOr(ev.At)
		i, ok := open[ev.Project]
		if !ok || len(packs[i].events) == packMax {
			packs = append(packs, eventPack{project: ev.Project, firstAt: ev.At, last: ev.At})
			i = len(packs) - 1
			open[ev.Project] = i
		}
		p := &packs[i]
		p.events = append(p.events, ev)
		if ev.At.Before(p.firstAt) {
			p.firstAt = ev.At
		}
		if ev.At.After(p.last) {
			p.last = ev.At
		}
	}
	return packs
}

// eventsIn is how many events packs hold.
func eventsIn(packs []eventPack) int {
	n := 0
	for _, p := range packs {
		n += len(p.events)
	}
	return n
}

// encodePack is the pack's events (as packEvents made them: each with its
// time) as stored: packFormat, then each event's time (Unix milliseconds)
// and its key, sandbox, kind, node, reason and message, each
// length-prefixed. The project and IDs are the row's.
func encodePack(evs []Event) []byte {
	n := 1
	for _, ev := range evs {
		n += 6*binary.MaxVarintLen32 + binary.MaxVarintLen64 + len(ev.Key) + len(ev.SandboxID) + len(ev.Kind) +
			len(ev.Node) + len(ev.Reason) + min(len(ev.Message), maxEventMessage)
	}
	b := make([]byte, 0, n)
	b = append(b, packFormat)
	str := func(s string) {
		b = binary.AppendUvarint(b, uint64(len(s)))
		b = append(b, s...)
	}
	for _, ev := range evs {
		b = binary.AppendVarint(b, ev.At.UnixMilli())
		str(ev.Key)
		str(ev.SandboxID)
		str(ev.Kind)
		str(ev.Node)
		str(ev.Reason)
		str(clip(ev.Message, maxEventMessage))
	}
	return b
}

// maxEventMessage is how much of an event's message is kept.
const maxEventMessage = 1000

var errPackTruncated = errors.New("truncated")

// packRow is a pack as its row holds it.
type packRow struct {
	first, last int64
	project     string
	events      []byte
}

// packColumns are the columns scanPack reads, in its order.
const packColumns = `first_id, last_id, project, events`

// scanPack reads a row of packColumns.
func scanPack(rows *sql.Rows) (packRow, error) {
	var p packRow
	err := rows.Scan(&p.first, &p.last, &p.project, &p.events)
	return p, err
}

// decode calls keep with each of the pack's events in order (false:
// stop).
func (p packRow) decode(keep func(Event) bool) error {
	return decodePack(p.events, p.project, p.first, p.last, keep)
}

// decodePack reads a pack stored with IDs first to last of project, and
// calls keep with each event in order (false: stop).
func decodePack(b []byte, project string, first, last int64, keep func(Event) bool) error {
	if len(b) == 0 || b[0] != packFormat {
		return fmt.Errorf("event pack %d–%d: unknown format", first, last)
	}
	r := packReader{b: b[1:]}
	for id := first; id <= last; id++ {
		ev := Event{ID: id, At: time.UnixMilli(r.varint()), Project: project}
		for _, f := range []*string{&ev.Key, &ev.SandboxID, &ev.Kind, &ev.Node, &ev.Reason, &ev.Message} {
			*f = r.str()
		}
		if r.short {
			return fmt.Errorf("event pack %d–%d: event %d: %w", first, last, id, errPackTruncated)
		}
		if !keep(ev) {
			return nil
		}
	}
	if len(r.b) != 0 {
		return fmt.Errorf("event pack %d–%d: %d bytes after its last event", first, last, len(r.b))
	}
	return nil
}

// packReader reads the fields of a pack (of events, or of ends) in turn;
// short says one was cut short, after which each reads zero.
type packReader struct {
	b     []byte
	short bool
}

// str reads a length-prefixed string.
func (r *packReader) str() string {
	n, k := binary.Uvarint(r.b)
	if r.short || k <= 0 || uint64(len(r.b)-k) < n {
		r.short = true
		return ""
	}
	s := string(r.b[k : k+int(n)])
	r.b = r.b[k+int(n):]
	return s
}

// varint reads a signed varint.
func (r *packReader) varint() int64 {
	v, k := binary.Varint(r.b)
	if r.short || k <= 0 {
		r.short = true
		return 0
	}
	r.b = r.b[k:]
	return v
}

// float reads a float64's 8 bytes, little-endian.
func (r *packReader) float() float64 {
	if r.short || len(r.b) < 8 {
		r.short = true
		return 0
	}
	v := math.Float64frombits(binary.LittleEndian.Uint64(r.b))
	r.b = r.b[8:]
	return v
}
