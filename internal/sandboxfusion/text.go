package sandboxfusion

import (
	"strings"
	"unicode/utf8"
)

// text renders a program's output as a JSON string. Valid UTF-8 passes
// byte for byte. Each invalid sequence becomes one U+FFFD, as Python's
// bytes.decode("utf-8", errors="replace") does (the Unicode "maximal
// subpart" rule: a truncated but well-formed prefix of a sequence is one
// replacement, a stray byte is one). Upstream SandboxFusion instead
// replaces the whole stream with "[DecodeError] ..." when any byte is
// invalid; keeping the valid part is more useful and still never valid
// for a grader comparing against clean text.
func text(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	var sb strings.Builder
	sb.Grow(len(b) + 8)
	for len(b) > 0 {
		r, n := utf8.DecodeRune(b)
		if r != utf8.RuneError || n > 1 {
			sb.Write(b[:n])
			b = b[n:]
			continue
		}
		sb.WriteRune(utf8.RuneError)
		b = b[maximalSubpart(b):]
	}
	return sb.String()
}

// maximalSubpart is how many bytes at the start of b (which does not
// start with a valid sequence) one replacement character stands for: the
// longest prefix that could begin a well-formed sequence, at least 1.
func maximalSubpart(b []byte) int {
	lead := b[0]
	var need int
	lo, hi := byte(0x80), byte(0xBF) // the range of the second byte
	switch {
	case lead >= 0xC2 && lead <= 0xDF:
		need = 1
	case lead == 0xE0:
		need, lo = 2, 0xA0
	case lead >= 0xE1 && lead <= 0xEC, lead == 0xEE, lead == 0xEF:
		need = 2
	case lead == 0xED:
		need, hi = 2, 0x9F
	case lead == 0xF0:
		need, lo = 3, 0x90
	case lead >= 0xF1 && lead <= 0xF3:
		need = 3
	case lead == 0xF4:
		need, hi = 3, 0x8F
	default:
		return 1
	}
	n := 1
	for i := 1; i <= need && i < len(b); i++ {
		c := b[i]
		if i == 1 && (c < lo || c > hi) || i > 1 && (c < 0x80 || c > 0xBF) {
			break
		}
		n++
	}
	return n
}
