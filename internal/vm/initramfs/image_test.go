package initramfs

import (
	"bytes"
	"debug/elf"
	"encoding/binary"
	"os"
	"path/filepath"
	"slices"
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

// relObject is an ELF64 little-endian relocatable object with sections of
// the given names and contents (each aligned to 8), then the section
// header string table and the section headers.
func relObject(t *testing.T, names []string, contents [][]byte) []byte {
	t.Helper()
	le := binary.LittleEndian
	strtab := []byte{0}
	nameOff := make([]uint32, len(names)+1)
	for i, n := range append(slices.Clone(names), ".shstrtab") {
		nameOff[i] = uint32(len(strtab))
		strtab = append(append(strtab, n...), 0)
	}
	b := make([]byte, 64)
	type sec struct{ name, off, size uint64 }
	var secs []sec
	for i, c := range append(slices.Clone(contents), strtab) {
		for len(b)%8 != 0 {
			b = append(b, 0)
		}
		secs = append(secs, sec{uint64(nameOff[i]), uint64(len(b)), uint64(len(c))})
		b = append(b, c...)
	}
	for len(b)%8 != 0 {
		b = append(b, 0)
	}
	copy(b, "\x7fELF\x02\x01\x01")
	le.PutUint16(b[0x10:], 1) // ET_REL
	le.PutUint16(b[0x12:], 62)
	le.PutUint32(b[0x14:], 1)
	le.PutUint64(b[0x28:], uint64(len(b)))
	le.PutUint16(b[0x34:], 64)
	le.PutUint16(b[0x3a:], 64)
	le.PutUint16(b[0x3c:], uint16(len(secs)+1))
	le.PutUint16(b[0x3e:], uint16(len(secs)))
	b = append(b, make([]byte, 64)...) // the null section
	for i, s := range secs {
		h := make([]byte, 64)
		le.PutUint32(h, uint32(s.name))
		typ := uint32(1) // PROGBITS
		if i == len(secs)-1 {
			typ = 3 // STRTAB
		}
		le.PutUint32(h[4:], typ)
		le.PutUint64(h[24:], s.off)
		le.PutUint64(h[32:], s.size)
		le.PutUint64(h[48:], 8)
		b = append(b, h...)
	}
	return b
}

func TestStripModuleBTF(t *testing.T) {
	text := bytes.Repeat([]byte{0x90}, 100)
	btf := bytes.Repeat([]byte{0xeb}, 1000)
	symtab := bytes.Repeat([]byte{0x5a}, 48)
	mod := relObject(t, []string{".text", ".BTF", ".symtab"}, [][]byte{text, btf, symtab})
	got := StripModuleBTF(mod)
	if len(got) != len(mod)-1000 {
		t.Errorf("stripped %d bytes of %d, want the 1000 of .BTF", len(mod)-len(got), len(mod))
	}
	f, err := elf.NewFile(bytes.NewReader(got))
	if err != nil {
		t.Fatalf("stripped module: %v", err)
	}
	for name, want := range map[string][]byte{".text": text, ".BTF": {}, ".symtab": symtab} {
		s := f.Section(name)
		if s == nil {
			t.Fatalf("stripped module: no %s", name)
		}
		b, err := s.Data()
		if err != nil || !bytes.Equal(b, want) {
			t.Errorf("%s: %d bytes (%v), want %d", name, len(b), err, len(want))
		}
	}
	// An odd size: the cut keeps the file's alignment, .BTF is empty.
	mod = relObject(t, []string{".text", ".BTF", ".symtab"}, [][]byte{text, btf[:1001-8], symtab})
	if got := StripModuleBTF(mod); len(got) != len(mod)-992 {
		t.Errorf("odd size: stripped %d bytes, want 992", len(mod)-len(got))
	} else if f, err := elf.NewFile(bytes.NewReader(got)); err != nil || f.Section(".BTF").Size != 0 {
		t.Errorf("odd size: %v", err)
	}
	// Without .BTF, or not an ELF object: the same bytes.
	plain := relObject(t, []string{".text"}, [][]byte{text})
	if got := StripModuleBTF(plain); !bytes.Equal(got, plain) {
		t.Error("without .BTF: bytes changed")
	}
	if got := StripModuleBTF([]byte("not an ELF file")); string(got) != "not an ELF file" {
		t.Error("not ELF: bytes changed")
	}
}

// TestStripModuleBTFKernel strips the guest kernel's modules (given
// DSEC_VM_KERNEL_DIR) and checks every other section is as it was.
func TestStripModuleBTFKernel(t *testing.T) {
	dir := os.Getenv("DSEC_VM_KERNEL_DIR")
	if dir == "" {
		t.Skip("DSEC_VM_KERNEL_DIR is not set")
	}
	mods, err := filepath.Glob(filepath.Join(dir, "modules", "*.ko"))
	if err != nil || len(mods) == 0 {
		t.Fatalf("no modules in %s (%v)", dir, err)
	}
	for _, m := range mods {
		b, err := os.ReadFile(m)
		if err != nil {
			t.Fatal(err)
		}
		b = StripModuleSignature(b)
		before, err := elf.NewFile(bytes.NewReader(b))
		if err != nil {
			t.Fatalf("%s: %v", m, err)
		}
		after, err := elf.NewFile(bytes.NewReader(StripModuleBTF(b)))
		if err != nil {
			t.Fatalf("%s stripped: %v", m, err)
		}
		for i, s := range before.Sections {
			a := after.Sections[i]
			if a.Name != s.Name {
				t.Fatalf("%s: section %d is %s, was %s", m, i, a.Name, s.Name)
			}
			if s.Name == ".BTF" {
				if a.Size != 0 {
					t.Errorf("%s: .BTF of %d bytes left", m, a.Size)
				}
				continue
			}
			if s.Type == elf.SHT_NOBITS {
				continue
			}
			x, _ := s.Data()
			y, _ := a.Data()
			if !bytes.Equal(x, y) {
				t.Errorf("%s: %s changed", m, s.Name)
			}
		}
	}
}
