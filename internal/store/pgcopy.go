package store

import (
	"encoding/binary"
	"encoding/json"
	"maps"
	"math"
	"slices"
	"time"
	"unicode/utf8"
)

// copyRows builds the data of a COPY ... FROM STDIN (FORMAT binary): a
// header, each row's fields (a length and the value's bytes in the
// server's binary form, or -1 for NULL), a trailer. pgx's CopyFrom finds
// an encoder for each value of each row through its type map; for the
// ledger's ends, a row per sandbox, that and the labels' json.Marshal
// were most of an apiserver's cost of storing a row (BenchmarkPutUsagePG's
// client-µs/row).
type copyRows struct {
	b []byte
}

// copySignature opens a binary COPY's data, before its flags and its
// header extension's length (both 0).
const copySignature = "PGCOPY\n\xff\r\n\x00"

// y2kMicros is 2000-01-01 UTC in microseconds since the Unix epoch: a
// timestamptz is microseconds since it.
const y2kMicros = 946_684_800_000_000

// newCopyRows starts the data of rows rows of about size bytes each.
func newCopyRows(rows, size int) *copyRows {
	c := &copyRows{b: make([]byte, 0, len(copySignature)+8+rows*size+2)}
	c.b = append(c.b, copySignature...)
	c.b = binary.BigEndian.AppendUint32(c.b, 0) // flags
	c.b = binary.BigEndian.AppendUint32(c.b, 0) // header extension length
	return c
}

// row starts a row of fields fields.
func (c *copyRows) row(fields int) {
	c.b = binary.BigEndian.AppendUint16(c.b, uint16(fields))
}

// text adds a text field.
func (c *copyRows) text(s string) {
	c.b = binary.BigEndian.AppendUint32(c.b, uint32(len(s)))
	c.b = append(c.b, s...)
}

// int8 adds a bigint field.
func (c *copyRows) int8(v int64) {
	c.b = binary.BigEndian.AppendUint32(c.b, 8)
	c.b = binary.BigEndian.AppendUint64(c.b, uint64(v))
}

// float8 adds a double precision field.
func (c *copyRows) float8(v float64) {
	c.b = binary.BigEndian.AppendUint32(c.b, 8)
	c.b = binary.BigEndian.AppendUint64(c.b, math.Float64bits(v))
}

// timestamptz adds a timestamptz field, NULL for the zero time.
func (c *copyRows) timestamptz(t time.Time) {
	if t.IsZero() {
		c.b = binary.BigEndian.AppendUint32(c.b, math.MaxUint32) // -1: NULL
		return
	}
	c.b = binary.BigEndian.AppendUint32(c.b, 8)
	c.b = binary.BigEndian.AppendUint64(c.b, uint64(t.UnixMicro()-y2kMicros))
}

// labelsJSON adds labels as a text field, as json.Marshal writes them.
func (c *copyRows) labelsJSON(labels map[string]string) {
	at := len(c.b)
	c.b = append(c.b, 0, 0, 0, 0)
	c.b = appendLabelsJSON(c.b, labels)
	binary.BigEndian.PutUint32(c.b[at:], uint32(len(c.b)-at-4))
}

// data ends the rows and returns them.
func (c *copyRows) data() []byte {
	return binary.BigEndian.AppendUint16(c.b, math.MaxUint16) // -1: no more rows
}

// appendLabelsJSON appends labels in JSON exactly as json.Marshal writes
// a map[string]string (keys sorted, the same escapes; nil is null), which
// the rows of a key stored by either way must agree on. A string of
// plain printable ASCII is copied; anything else goes through
// json.Marshal.
func appendLabelsJSON(b []byte, labels map[string]string) []byte {
	if labels == nil {
		return append(b, "null"...)
	}
	b = append(b, '{')
	str := func(s string) {
		if plainJSON(s) {
			b = append(b, '"')
			b = append(b, s...)
			b = append(b, '"')
			return
		}
		q, _ := json.Marshal(s) // a string always marshals
		b = append(b, q...)
	}
	pair := func(i int, k, v string) {
		if i > 0 {
			b = append(b, ',')
		}
		str(k)
		b = append(b, ':')
		str(v)
	}
	if len(labels) == 1 {
		for k, v := range labels {
			pair(0, k, v)
		}
	} else {
		for i, k := range slices.Sorted(maps.Keys(labels)) {
			pair(i, k, labels[k])
		}
	}
	return append(b, '}')
}

// plainJSON says whether json.Marshal writes s as it is between quotes:
// printable ASCII without a quote, a backslash or one of the HTML
// characters it escapes (<, >, &).
func plainJSON(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < 0x20 || c >= utf8.RuneSelf || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			return false
		}
	}
	return true
}
