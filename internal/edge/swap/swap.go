// Package swap gives an edge swap of its own, so that pausing a sandbox can
// take its anonymous memory out of RAM: without swap only the page cache can
// leave. The edge provisions it only when configured (dsecd --swap), and
// never touches a swap area the host already has: it adds its own, a swap
// file on a file system that can hold one or a zram device, and removes it
// again when the node is torn down. A dsecd restart keeps it: paused
// sandboxes' memory lives there.
package swap

import (
	"fmt"
	"strconv"
	"strings"

	"dsec.dev/dsec/internal/errdefs"
)

// Kind is how the edge's swap is made.
type Kind string

const (
	None Kind = ""     // no swap of the edge's own
	File Kind = "file" // a swap file under the edge's root
	Zram Kind = "zram" // a compressed RAM device (/sys/class/zram-control)
)

// Config says what swap to provision.
type Config struct {
	Kind Kind
	Size int64 // bytes
}

// Parse reads dsecd's --swap value: "none" (or ""), "file:SIZE" or
// "zram:SIZE", SIZE in bytes or with a K, M, G or T suffix (powers of 1024).
func Parse(s string) (Config, error) {
	if s == "" || s == "none" {
		return Config{}, nil
	}
	kind, size, ok := strings.Cut(s, ":")
	if !ok || (kind != string(File) && kind != string(Zram)) {
		return Config{}, fmt.Errorf("swap %q: want none, file:SIZE or zram:SIZE (e.g. file:8G): %w", s, errdefs.ErrInvalidArgument)
	}
	n, err := ParseSize(size)
	if err != nil {
		return Config{}, fmt.Errorf("swap %q: %w", s, err)
	}
	if n < 16<<20 {
		return Config{}, fmt.Errorf("swap %q: at least 16M: %w", s, errdefs.ErrInvalidArgument)
	}
	return Config{Kind: Kind(kind), Size: n}, nil
}

// ParseSize reads a byte count with an optional K, M, G or T suffix.
func ParseSize(s string) (int64, error) {
	mult := int64(1)
	if s != "" {
		switch strings.ToUpper(s[len(s)-1:]) {
		case "K":
			mult = 1 << 10
		case "M":
			mult = 1 << 20
		case "G":
			mult = 1 << 30
		case "T":
			mult = 1 << 40
		}
		if mult > 1 {
			s = s[:len(s)-1]
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("size %q: want a positive number of bytes, optionally with K, M, G or T: %w", s, errdefs.ErrInvalidArgument)
	}
	return n * mult, nil
}

// String is the config as --swap takes it.
func (c Config) String() string {
	if c.Kind == None {
		return "none"
	}
	return fmt.Sprintf("%s:%dM", c.Kind, c.Size>>20)
}

// Node is what the node's swap lets a pause release.
type Node struct {
	Total, Free int64  // all swap areas of the node, the host's included
	Own         string // the edge's own area ("" without one)
}

// Releases says in words what a pause can take out of RAM on this node.
func (n Node) Releases() string {
	if n.Total == 0 {
		return "page cache only: the node has no swap, so anonymous memory stays in RAM (dsecd --swap file:SIZE or zram:SIZE gives the edge its own)"
	}
	own := ""
	if n.Own != "" {
		own = ", the edge's own at " + n.Own
	}
	return fmt.Sprintf("page cache and anonymous memory: %d MiB of swap free of %d MiB%s", n.Free>>20, n.Total>>20, own)
}
