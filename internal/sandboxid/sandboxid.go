// Package sandboxid makes and parses sandbox IDs. An ID names the node that
// holds the sandbox, so any apiserver routes any call by parsing it, with no
// catalogue to look up; the edge names each sandbox it makes (a create may
// take a sandbox its warm pool started earlier).
//
// An ID is sb-<node>-<tail>. The tail, 23 base32 characters, holds the
// node's slot in the cluster's registry (2 bytes), the slot's generation (4
// bytes) and 8 random bytes. A slot reused by another machine has a higher
// generation, so an ID minted for the slot's earlier owner never routes to
// the new one. The all-in-one dsecd, with no registry, mints slot 0,
// generation 0. IDs made before slots existed (a 16-character tail of
// random bytes) parse as slot 0 too.
package sandboxid

import (
	"crypto/rand"
	"encoding/base32"
	"encoding/binary"
	"fmt"
	"strings"

	"dsec.dev/dsec/internal/errdefs"
)

var encoding = base32.StdEncoding.WithPadding(base32.NoPadding)

// ID is a parsed sandbox ID.
type ID struct {
	Node       string
	Slot       uint16 // 0: no registry (all-in-one) or a legacy ID
	Generation uint32
}

const (
	tailBytes   = 14 // slot, generation, random
	legacyBytes = 10 // random only
)

// New returns a fresh ID of a sandbox on node, which holds slot at
// generation gen (0, 0 without a registry).
func New(node string, slot uint16, gen uint32) string {
	var b [tailBytes]byte
	binary.BigEndian.PutUint16(b[0:2], slot)
	binary.BigEndian.PutUint32(b[2:6], gen)
	rand.Read(b[6:])
	return "sb-" + node + "-" + strings.ToLower(encoding.EncodeToString(b[:]))
}

// Parse reads a sandbox ID.
func Parse(id string) (ID, error) {
	bad := func() (ID, error) {
		return ID{}, fmt.Errorf("sandbox id %q is not of the form sb-<node>-<tail>: %w", id, errdefs.ErrInvalidArgument)
	}
	rest, ok := strings.CutPrefix(id, "sb-")
	i := strings.LastIndexByte(rest, '-')
	if !ok || i <= 0 || i == len(rest)-1 {
		return bad()
	}
	b, err := encoding.DecodeString(strings.ToUpper(rest[i+1:]))
	if err != nil {
		return bad()
	}
	out := ID{Node: rest[:i]}
	switch len(b) {
	case tailBytes:
		out.Slot = binary.BigEndian.Uint16(b[0:2])
		out.Generation = binary.BigEndian.Uint32(b[2:6])
	case legacyBytes:
	default:
		return bad()
	}
	return out, nil
}

// Node returns the node named in a sandbox ID.
func Node(id string) (string, error) {
	p, err := Parse(id)
	return p.Node, err
}
