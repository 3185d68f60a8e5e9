package sandboxfusion

import (
	"math"
	"strconv"
	"strings"
)

// outputMatches compares a program's stdout with a case's expected one as
// SandboxFusion's check_stdio_test_case does: both stripped and split
// into lines, the same number of lines, each pair equal once stripped and
// lowercased, or both numbers within a relative tolerance of 1e-5.
func outputMatches(got, want string) bool {
	gl := strings.Split(strings.TrimSpace(got), "\n")
	wl := strings.Split(strings.TrimSpace(want), "\n")
	if len(gl)-len(wl) == 1 && gl[len(gl)-1] == "" {
		gl = gl[:len(gl)-1]
	}
	if len(wl)-len(gl) == 1 && wl[len(wl)-1] == "" {
		wl = wl[:len(wl)-1]
	}
	if len(gl) != len(wl) {
		return false
	}
	for i := range gl {
		g, w := strings.ToLower(gl[i]), strings.ToLower(wl[i])
		if strings.TrimSpace(g) == strings.TrimSpace(w) {
			continue
		}
		gf, gok := parseFloat(g)
		wf, wok := parseFloat(w)
		if gok && wok && math.Abs(gf-wf)/math.Max(math.Abs(wf), 1e-10) < 1e-5 {
			continue
		}
		return false
	}
	return true
}

// parseFloat parses s as Python's float() would: surrounding white space
// allowed, "inf", "nan" and "infinity" in any case, out-of-range values
// as ±inf or 0; Go's hexadecimal floats are not numbers there.
func parseFloat(s string) (float64, bool) {
	s = strings.TrimSpace(s)
	if strings.ContainsAny(s, "xX") {
		return 0, false
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil {
		if ne, ok := err.(*strconv.NumError); ok && ne.Err == strconv.ErrRange {
			return f, true
		}
		return 0, false
	}
	return f, true
}
