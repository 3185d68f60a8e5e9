package initramfs

import (
	"bytes"
	"encoding/binary"
	"testing"
)

func TestStripModuleSignature(t *testing.T) {
	mod := []byte("\x7fELF module body")
	sig := bytes.Repeat([]byte{0xa5}, 300)
	info := make([]byte, 12)
	binary.BigEndian.PutUint32(info[8:], uint32(len(sig)))
	signed := append(append(append(append([]byte{}, mod...), sig...), info...), moduleSigMagic...)
	if got := StripModuleSignature(signed); !bytes.Equal(got, mod) {
		t.Errorf("signed: got %q, want %q", got, mod)
	}
	if got := StripModuleSignature(mod); !bytes.Equal(got, mod) {
		t.Errorf("unsigned: got %q", got)
	}
	// A length past the start is not a signature: the bytes stay.
	binary.BigEndian.PutUint32(info[8:], 1<<20)
	bad := append(append(append([]byte{}, mod...), info...), moduleSigMagic...)
	if got := StripModuleSignature(bad); !bytes.Equal(got, bad) {
		t.Errorf("bad length: got %q", got)
	}
}
