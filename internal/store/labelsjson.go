package store

import (
	"encoding/json"
	"maps"
	"slices"
	"unicode/utf8"
)

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
