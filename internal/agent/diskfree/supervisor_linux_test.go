//go:build linux && (amd64 || arm64)

package diskfree

import (
	"encoding/binary"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// TestFilter runs the BPF program on seccomp_data records: only native
// statfs, and fstatfs without the bypass marker, reach the supervisor.
func TestFilter(t *testing.T) {
	var prog []bpf.RawInstruction
	for _, f := range filter() {
		prog = append(prog, bpf.RawInstruction{Op: f.Code, Jt: f.Jt, Jf: f.Jf, K: f.K})
	}
	insns, ok := bpf.Disassemble(prog)
	if !ok {
		t.Fatal("filter does not disassemble")
	}
	vm, err := bpf.NewVM(insns)
	if err != nil {
		t.Fatal(err)
	}
	// The VM loads words in network order, seccomp in the machine's: store
	// each 32-bit word big-endian, at the offsets of a little-endian record.
	data := func(arch uint32, nr int, arg2 uint64) []byte {
		b := make([]byte, 64)
		binary.BigEndian.PutUint32(b[offNr:], uint32(nr))
		binary.BigEndian.PutUint32(b[offArch:], arch)
		binary.BigEndian.PutUint32(b[offArg2:], uint32(arg2))
		binary.BigEndian.PutUint32(b[offArg2+4:], uint32(arg2>>32))
		return b
	}
	for _, c := range []struct {
		name string
		in   []byte
		want uint32
	}{
		{"statfs", data(nativeArch, unix.SYS_STATFS, 0), unix.SECCOMP_RET_USER_NOTIF},
		{"statfs with the marker", data(nativeArch, unix.SYS_STATFS, bypass), unix.SECCOMP_RET_USER_NOTIF},
		{"fstatfs", data(nativeArch, unix.SYS_FSTATFS, 0), unix.SECCOMP_RET_USER_NOTIF},
		{"fstatfs with half the marker", data(nativeArch, unix.SYS_FSTATFS, bypass&0xffffffff), unix.SECCOMP_RET_USER_NOTIF},
		{"fstatfs with the marker", data(nativeArch, unix.SYS_FSTATFS, bypass), unix.SECCOMP_RET_ALLOW},
		{"getpid", data(nativeArch, unix.SYS_GETPID, 0), unix.SECCOMP_RET_ALLOW},
		{"statfs of another ABI", data(0x40000003, unix.SYS_STATFS, 0), unix.SECCOMP_RET_ALLOW}, // AUDIT_ARCH_I386
	} {
		got, err := vm.Run(c.in)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if uint32(got) != c.want {
			t.Errorf("%s: %#x, want %#x", c.name, got, c.want)
		}
	}
}

func TestReadCreds(t *testing.T) {
	dir, err := unix.Open("/proc/self", unix.O_PATH|unix.O_DIRECTORY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(dir)
	c, err := readCreds(dir)
	if err != nil {
		t.Fatal(err)
	}
	groups, _ := unix.Getgroups()
	if c.fsuid != unix.Geteuid() || c.fsgid != unix.Getegid() || len(c.groups) != len(groups) {
		t.Errorf("creds %+v, want uid %d gid %d groups %v", c, unix.Geteuid(), unix.Getegid(), groups)
	}
}

func TestRootStatfsArithmetic(t *testing.T) {
	// The figures are block counts of the root's statfs, rounded so that
	// used never shows less than the qgroup holds.
	for _, c := range []struct {
		limit, used       int64
		blocks, bfree, av uint64 // the file system's own
		want              string
	}{
		{256 << 20, 0, 1 << 30, 1 << 29, 1 << 29, "65536 65536 65536"},
		{256 << 20, 1, 1 << 30, 1 << 29, 1 << 29, "65536 65535 65535"},
		{256 << 20, 50 << 20, 1 << 30, 1 << 29, 1 << 29, "65536 52736 52736"},
		{256 << 20, 300 << 20, 1 << 30, 1 << 29, 1 << 29, "65536 0 0"}, // past the limit (metadata)
		{256 << 20, 0, 1 << 30, 1000, 900, "65536 1000 900"},           // the node is nearly full
		{256 << 20, 0, 10000, 5000, 5000, "10000 5000 5000"},           // the node is smaller than the limit
	} {
		st := unix.Statfs_t{Bsize: 4096, Frsize: 4096, Blocks: c.blocks, Bfree: c.bfree, Bavail: c.av}
		describe(&st, c.limit, c.used)
		if got := strings.Join([]string{u(st.Blocks), u(st.Bfree), u(st.Bavail)}, " "); got != c.want {
			t.Errorf("limit %d used %d on %d/%d/%d: %s, want %s", c.limit, c.used, c.blocks, c.bfree, c.av, got, c.want)
		}
	}
}

func u(v uint64) string { return strconv.FormatUint(v, 10) }
