package qos

import (
	"errors"
	"testing"

	"dsec.dev/dsec/internal/errdefs"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		in   string
		def  Class
		want Class
	}{
		{"", Latency, Latency},
		{"", BestEffort, BestEffort},
		{"latency", BestEffort, Latency},
		{"best_effort", Latency, BestEffort},
	} {
		got, err := Parse(tc.in, tc.def)
		if err != nil || got != tc.want {
			t.Errorf("Parse(%q, %s) = %q, %v; want %q", tc.in, tc.def, got, err, tc.want)
		}
	}
	for _, bad := range []string{"idle", "Latency", "best-effort", " latency"} {
		if _, err := Parse(bad, Latency); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Parse(%q) = %v, want InvalidArgument", bad, err)
		}
	}
	if Latency.Idle() || !BestEffort.Idle() {
		t.Error("only best_effort runs idle")
	}
}
