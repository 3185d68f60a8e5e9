package trajectory

import (
	"testing"
)

// BenchmarkStep is what recording adds to one exec with a little output.
func BenchmarkStep(b *testing.B) {
	src := newSource()
	src.add("sb-1", nil, nil)
	r, err := New(Config{Dir: b.TempDir()}, src)
	if err != nil {
		b.Fatal(err)
	}
	out := make([]byte, 700)
	for i := range out {
		out[i] = 'a' + byte(i%26)
	}
	b.ResetTimer()
	for range b.N {
		exec(r, "sb-1", "seq 200", string(out), 0)
	}
}
