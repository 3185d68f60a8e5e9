package agent

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
	"time"
)

// HoldMemoryMain is `dsec-agent hold-memory MIB [DIR]`, a helper for the
// pause tests and `dsec bench lifecycle`, run as a command inside a
// sandbox: it holds MIB MiB of anonymous memory filled with a known
// pattern, writes its pid to DIR/memhog.pid and the pattern's SHA-256 to
// DIR/memhog.sum (DIR defaults to /tmp) once filled, and on every SIGUSR1 reads the whole buffer again and
// writes "SHA256 NANOSECONDS" to DIR/memhog.check: whether a pause kept
// every byte, and how long touching all of it took.
func HoldMemoryMain(args []string) int {
	if len(args) < 1 || len(args) > 2 {
		fmt.Fprintln(os.Stderr, "usage: dsec-agent hold-memory MIB [DIR]")
		return 2
	}
	mib, err := strconv.Atoi(args[0])
	if err != nil || mib <= 0 {
		fmt.Fprintf(os.Stderr, "dsec-agent hold-memory: %q is not a positive number of MiB\n", args[0])
		return 2
	}
	dir := "/tmp"
	if len(args) == 2 {
		dir = args[1]
	}
	// In chunks of 1 MiB, each filled before the next is allocated, as a
	// program's memory grows: a kernel that refuses one allocation of more
	// than its RAM at once (a microVM's guest, whose RAM is the sandbox's
	// limit) runs out of memory as it would for a real program, by its
	// OOM killer, instead of failing the one big allocation.
	chunks := make([][]byte, mib)
	x := uint64(88172645463325252) // xorshift64: cheap, and no page is zero
	for c := range chunks {
		buf := make([]byte, 1<<20)
		for i := 0; i+8 <= len(buf); i += 8 {
			x ^= x << 13
			x ^= x >> 7
			x ^= x << 17
			for j := range 8 {
				buf[i+j] = byte(x >> (8 * j))
			}
		}
		chunks[c] = buf
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGUSR1)
	sum := sumChunks(chunks)
	if err := writeAtomic(filepath.Join(dir, "memhog.pid"), strconv.Itoa(os.Getpid())+"\n"); err != nil {
		fmt.Fprintln(os.Stderr, "dsec-agent hold-memory:", err)
		return 1
	}
	if err := writeAtomic(filepath.Join(dir, "memhog.sum"), hex.EncodeToString(sum[:])+"\n"); err != nil {
		fmt.Fprintln(os.Stderr, "dsec-agent hold-memory:", err)
		return 1
	}
	for range sigs {
		start := time.Now()
		var x byte
		for _, buf := range chunks {
			for i := 0; i < len(buf); i += 4096 {
				x ^= buf[i]
			}
		}
		touched := time.Since(start)
		sum := sumChunks(chunks)
		line := fmt.Sprintf("%s %d %d\n", hex.EncodeToString(sum[:]), touched.Nanoseconds(), x)
		if err := writeAtomic(filepath.Join(dir, "memhog.check"), line); err != nil {
			fmt.Fprintln(os.Stderr, "dsec-agent hold-memory:", err)
			return 1
		}
	}
	return 0
}

// sumChunks is the SHA-256 of the chunks one after the other.
func sumChunks(chunks [][]byte) []byte {
	h := sha256.New()
	for _, c := range chunks {
		h.Write(c)
	}
	return h.Sum(nil)
}

func writeAtomic(path, data string) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(data), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
