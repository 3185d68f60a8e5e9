package store

import (
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"math"
	"time"
)

// Sole ends are stored in packs (docs/usage.md "Packs of ends"): the sole
// ends of one project that one call stores, up to endPackMax of them, as
// one row of ledger_end_packs, whose project and the earliest start and
// latest end of its records are what SumUsage selects packs by; it
// unpacks them and selects each record as it selects rows. A row each
// (ledger_ends, written before migration 00022 and still read) cost
// PostgreSQL 2.4–2.9 µs of CPU a row (BenchmarkPutUsagePG), about what
// the rest of a hollow sandbox's end cost the store.

// endPackMax is how many records one pack holds at most.
const endPackMax = 1024

// endPackFormat is the first byte of a pack's encoding: the only one so far.
const endPackFormat = 1

// endPack is one pack to store: the encoded sole ends of one project.
type endPack struct {
	project        string
	started, ended time.Time // the earliest start and the latest end of its records
	n              int
	records        []byte // encodeEnds
}

// packEnds groups rows (each appended: a sole end) into packs by project,
// in order within each project, endPackMax at most to a pack.
func packEnds(rows []UsageRow) []endPack {
	var groups [][]*UsageRow
	open := map[string]int{} // project → index in groups of its open group
	for i := range rows {
		r := &rows[i]
		g, ok := open[r.Project]
		if !ok || len(groups[g]) == endPackMax {
			groups = append(groups, nil)
			g = len(groups) - 1
			open[r.Project] = g
		}
		groups[g] = append(groups[g], r)
	}
	packs := make([]endPack, len(groups))
	for i, g := range groups {
		p := endPack{project: g[0].Project, started: ms(nowOr(g[0].Started)), ended: ms(g[0].Ended), n: len(g)}
		for _, r := range g {
			if s := ms(nowOr(r.Started)); s.Before(p.started) {
				p.started = s
			}
			if e := ms(r.Ended); e.After(p.ended) {
				p.ended = e
			}
		}
		p.records = encodeEnds(g)
		packs[i] = p
	}
	return packs
}

// encodeEnds is rows as a pack stores them: endPackFormat, then each
// row's key, sandbox, labels (as JSON, the labels column's text) and node,
// length-prefixed; its start, end and update (Unix milliseconds) and
// figures, as varints, but for the two floats (8 bytes each). The project
// is the pack's.
func encodeEnds(rows []*UsageRow) []byte {
	n := 1
	for _, r := range rows {
		n += 4*binary.MaxVarintLen32 + 8*binary.MaxVarintLen64 + 16 + len(r.Key) + len(r.SandboxID) + len(r.Node) + 16*len(r.Labels)
		for k, v := range r.Labels {
			n += len(k) + len(v)
		}
	}
	b := make([]byte, 1, n)
	b[0] = endPackFormat
	str := func(s string) {
		b = binary.AppendUvarint(b, uint64(len(s)))
		b = append(b, s...)
	}
	var labels []byte
	var last map[string]string
	for i, r := range rows {
		str(r.Key)
		str(r.SandboxID)
		// A pull's records of one set of labels share its map; its
		// JSON is made once.
		if i == 0 || !maps.Equal(r.Labels, last) || (r.Labels == nil) != (last == nil) {
			labels = appendLabelsJSON(labels[:0], r.Labels)
			last = r.Labels
		}
		b = binary.AppendUvarint(b, uint64(len(labels)))
		b = append(b, labels...)
		str(r.Node)
		b = binary.AppendVarint(b, nowOr(r.Started).UnixMilli())
		b = binary.AppendVarint(b, r.Ended.UnixMilli())
		b = binary.AppendVarint(b, nowOr(r.Updated).UnixMilli())
		b = binary.AppendVarint(b, r.CPUUsec)
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(r.MemoryGiBSec))
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(r.DiskGiBHours))
		b = binary.AppendVarint(b, r.DiskPeakBytes)
		b = binary.AppendVarint(b, r.SnapshotBytes)
		b = binary.AppendVarint(b, r.EgressBytes)
		b = binary.AppendVarint(b, r.FnCallCalls)
	}
	return b
}

// errEndPack is a pack that does not decode.
var errEndPack = errors.New("a pack of ended sandboxes' usage does not decode")

// decodeEnds calls fn with each row of pack b of project's (its labels
// as their JSON text, Labels left nil), in order.
func decodeEnds(project string, b []byte, fn func(r *UsageRow, labels string)) error {
	if len(b) == 0 || b[0] != endPackFormat {
		return fmt.Errorf("%w: format %v", errEndPack, b[:min(len(b), 1)])
	}
	rd := packReader{b: b[1:]}
	for len(rd.b) > 0 {
		r := UsageRow{Project: project, Sole: true}
		r.Key = rd.str()
		r.SandboxID = rd.str()
		labels := rd.str()
		r.Node = rd.str()
		r.Started = time.UnixMilli(rd.varint())
		r.Ended = time.UnixMilli(rd.varint())
		r.Updated = time.UnixMilli(rd.varint())
		r.CPUUsec = rd.varint()
		r.MemoryGiBSec = rd.float()
		r.DiskGiBHours = rd.float()
		r.DiskPeakBytes = rd.varint()
		r.SnapshotBytes = rd.varint()
		r.EgressBytes = rd.varint()
		r.FnCallCalls = rd.varint()
		if rd.short {
			return fmt.Errorf("%w: a record cut short", errEndPack)
		}
		fn(&r, labels)
	}
	return nil
}
