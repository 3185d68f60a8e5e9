package sandboxfusion

import (
	"os/exec"
	"testing"
	"unicode/utf8"
)

func TestText(t *testing.T) {
	for _, tc := range []struct {
		in   []byte
		want string
	}{
		{[]byte("plain é ✓ \x00"), "plain é ✓ \x00"},
		{[]byte{0xff}, "\uFFFD"},
		{[]byte{'a', 0xe2, 0x82, 'b'}, "a\uFFFDb"},                   // a truncated sequence is one
		{[]byte{0xe2, 0x82}, "\uFFFD"},                               // cut at the end of the output
		{[]byte{0xc0, 0x80}, "\uFFFD\uFFFD"},                         // overlong: two stray bytes
		{[]byte{0xed, 0xa0, 0x80}, "\uFFFD\uFFFD\uFFFD"},             // a surrogate
		{[]byte{0xf0, 0x9f, 0x98}, "\uFFFD"},                         // 3 of 4 bytes
		{[]byte{0xf4, 0x90, 0x80, 0x80}, "\uFFFD\uFFFD\uFFFD\uFFFD"}, // over U+10FFFF
	} {
		got := text(tc.in)
		if got != tc.want || !utf8.ValidString(got) {
			t.Errorf("text(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

// TestTextMatchesPython checks the rendering against Python's own
// errors="replace" decoder on every 1- and 2-byte input and some longer.
func TestTextMatchesPython(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("no python3 on PATH")
	}
	var inputs [][]byte
	for a := 0x80; a < 0x100; a++ {
		inputs = append(inputs, []byte{byte(a)}, []byte{byte(a), 'x'})
		for _, b := range []byte{0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0} {
			inputs = append(inputs, []byte{byte(a), b, 'y'}, []byte{byte(a), b, 0x80, 'z'})
		}
	}
	var data []byte
	for _, in := range inputs {
		data = append(data, in...)
		data = append(data, '\n')
	}
	cmd := exec.Command(py, "-c", `import sys
for line in sys.stdin.buffer.read().split(b"\n")[:-1]:
    sys.stdout.buffer.write(line.decode("utf-8", "replace").encode("utf-8") + b"\n")`)
	cmd.Stdin = bytesReader(data)
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	if got := text(data); got != string(out) {
		t.Errorf("differs from Python's decoding")
		lines, want := splitLines(got), splitLines(string(out))
		for i := range min(len(lines), len(want)) {
			if lines[i] != want[i] {
				t.Errorf("input % x: got %q, Python %q", inputs[i], lines[i], want[i])
			}
		}
	}
}
