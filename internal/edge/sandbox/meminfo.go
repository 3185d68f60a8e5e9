package sandbox

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"dsec.dev/dsec/internal/errdefs"
)

// MemTotalMB is the node's physical memory in MiB (MemTotal of
// /proc/meminfo). dsecd derives its default limits from it.
func MemTotalMB() (int64, error) { return meminfoMB("MemTotal") }

// memAvailableMB reads MemAvailable from /proc/meminfo.
func memAvailableMB() (int64, error) { return meminfoMB("MemAvailable") }

func meminfoMB(key string) (int64, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, fmt.Errorf("read meminfo: %w", err)
	}
	defer f.Close()
	return parseMeminfo(f, key)
}

// parseMeminfo returns the field key of a /proc/meminfo text, in MiB.
func parseMeminfo(r io.Reader, key string) (int64, error) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), key+":")
		if !ok {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("parse %s of /proc/meminfo: %w", key, err)
		}
		return kb / 1024, nil
	}
	if err := sc.Err(); err != nil {
		return 0, fmt.Errorf("read meminfo: %w", err)
	}
	return 0, fmt.Errorf("%s not in /proc/meminfo: %w", key, errdefs.ErrNotSupported)
}
