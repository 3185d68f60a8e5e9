// Package sandboxid makes and parses sandbox IDs. An ID names the node that
// holds the sandbox, sb-<node>-<random>, so any apiserver routes any call by
// parsing it, with no catalogue to look up; the edge names each sandbox it
// makes (a create may take a sandbox its warm pool started earlier).
package sandboxid

import (
	"crypto/rand"
	"encoding/base32"
	"fmt"
	"strings"

	"dsec.dev/dsec/internal/errdefs"
)

var encoding = base32.StdEncoding.WithPadding(base32.NoPadding)

// New returns a fresh sandbox ID owned by node: sb-<node>-<random>, with 50
// random bits.
func New(node string) string {
	var b [10]byte
	rand.Read(b[:])
	return "sb-" + node + "-" + strings.ToLower(encoding.EncodeToString(b[:]))
}

// Node returns the node encoded in a sandbox ID.
func Node(id string) (string, error) {
	rest, ok := strings.CutPrefix(id, "sb-")
	i := strings.LastIndexByte(rest, '-')
	if !ok || i <= 0 || i == len(rest)-1 {
		return "", fmt.Errorf("sandbox id %q is not of the form sb-<node>-<random>: %w", id, errdefs.ErrInvalidArgument)
	}
	return rest[:i], nil
}
