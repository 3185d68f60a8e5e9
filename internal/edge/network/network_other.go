//go:build !linux

package network

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"time"

	"dsec.dev/dsec/internal/edge/netpolicy"
	"dsec.dev/dsec/internal/errdefs"
)

// Node is the network side of one edge node; only Linux has one.
type Node struct{}

var errNotSupported = fmt.Errorf("sandbox network: %w", errdefs.ErrNotSupported)

// Setup returns errdefs.ErrNotSupported outside Linux.
func Setup(ctx context.Context, cfg Config) (*Node, error) { return nil, errNotSupported }

func (n *Node) Attach(ctx context.Context, id string, pol *netpolicy.Policy) (*Attachment, error) {
	return nil, errNotSupported
}

func (n *Node) Update(ctx context.Context, id string, pol *netpolicy.Policy, cut bool) error {
	return errNotSupported
}

func (n *Node) AllowResolved(id string, addr netip.Addr, ports []netpolicy.Port, ttl time.Duration, name string) error {
	return errNotSupported
}

func (n *Node) ListenDNS(id string) (net.PacketConn, net.Listener, error) {
	return nil, nil, errNotSupported
}

func (n *Node) Detach(ctx context.Context, id string) error { return errNotSupported }

func (n *Node) Recover(ctx context.Context, keep map[string]*netpolicy.Policy) error {
	return errNotSupported
}

func (n *Node) Close() error { return errNotSupported }

func (n *Node) Teardown(ctx context.Context) error { return errNotSupported }

// HostRoutes returns errdefs.ErrNotSupported outside Linux.
func HostRoutes() ([]netip.Prefix, error) { return nil, errNotSupported }

func (n *Node) EgressBytes(id string) (int64, error) { return 0, errNotSupported }
