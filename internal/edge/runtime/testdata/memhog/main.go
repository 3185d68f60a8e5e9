// memhog holds N MiB of anonymous memory filled with a known pattern for
// the pause tests: it writes the pattern's SHA-256 to /tmp/memhog.sum once
// filled, and on every SIGUSR1 reads the whole buffer again and writes the
// checksum to /tmp/memhog.check, so a test can tell whether a pause lost or
// changed a byte.
package main

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"os/signal"
	"strconv"
	"syscall"
)

func main() {
	mib, err := strconv.Atoi(os.Args[1])
	if err != nil {
		os.Exit(2)
	}
	buf := make([]byte, mib<<20)
	x := uint64(88172645463325252)
	for i := 0; i+8 <= len(buf); i += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		for j := range 8 {
			buf[i+j] = byte(x >> (8 * j))
		}
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGUSR1)
	write("/tmp/memhog.sum", buf)
	for range sigs {
		write("/tmp/memhog.check", buf)
	}
}

func write(path string, buf []byte) {
	sum := sha256.Sum256(buf)
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(hex.EncodeToString(sum[:])+"\n"), 0o644); err != nil {
		os.Exit(1)
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Exit(1)
	}
}
