package network

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"

	"dsec.dev/dsec/internal/edge/netpolicy"
	"dsec.dev/dsec/internal/errdefs"
)

// Config is the node-wide network configuration. The zero value of every
// field but NetnsDir has a working default.
type Config struct {
	// NetnsDir holds one bind-mounted network namespace per sandbox,
	// named by sandbox id.
	NetnsDir string
	// Pool is the address range sandboxes get /32s from; its first address
	// is the gateway. Zero means 10.213.0.0/16.
	Pool netip.Prefix
	// EgressBytesPerSec caps what each sandbox sends. Zero means
	// 125_000_000 (1 Gbit/s).
	EgressBytesPerSec int64
	// MaxConns caps the concurrent connections of each sandbox. Zero means
	// 1024.
	MaxConns int
	// Audit receives every connection attempt (Kind "connect") and the end
	// of every allowed connection with its byte counts (Kind "close"). It is
	// called from one goroutine and must not block for long. Nil drops them.
	Audit func(netpolicy.Event)
	// Log is the node's logger. Nil discards.
	Log *slog.Logger

	// Table names the node's nftables table (family inet) and prefixes the
	// host veths' aliases; VethPrefix (three characters) starts every host
	// veth's name; LogGroup is the NFLOG group of the audit records. Two
	// networks on one host (a node and a test, say) need different values
	// of all three, and different pools. Zero values: "dsec", "dsv", 2130.
	Table      string
	VethPrefix string
	LogGroup   uint16
}

// Attachment is what Attach made for one sandbox.
type Attachment struct {
	ID        string
	NetnsPath string
	Addr      netip.Addr // the sandbox's address on its eth0
	Gateway   netip.Addr // its default gateway, held by the host side
	HostVeth  string     // the host side of the veth pair
}

const (
	defaultTable      = "dsec"
	defaultVethPrefix = "dsv"
	defaultLogGroup   = 2130
	// sandboxIface is the sandbox side of the veth pair.
	sandboxIface = "eth0"
)

var defaultPool = netip.MustParsePrefix("10.213.0.0/16")

func (c Config) withDefaults() (Config, error) {
	if c.NetnsDir == "" {
		return c, fmt.Errorf("check config: NetnsDir is empty: %w", errdefs.ErrInvalidArgument)
	}
	if !c.Pool.IsValid() {
		c.Pool = defaultPool
	}
	c.Pool = c.Pool.Masked()
	if !c.Pool.Addr().Is4() || c.Pool.Bits() > 30 {
		return c, fmt.Errorf("check config: pool %s must be IPv4 and hold at least 4 addresses: %w", c.Pool, errdefs.ErrInvalidArgument)
	}
	if c.EgressBytesPerSec <= 0 {
		c.EgressBytesPerSec = 125_000_000
	}
	if c.MaxConns <= 0 {
		c.MaxConns = 1024
	}
	if c.Log == nil {
		c.Log = slog.New(slog.DiscardHandler)
	}
	if c.Table == "" {
		c.Table = defaultTable
	}
	if c.VethPrefix == "" {
		c.VethPrefix = defaultVethPrefix
	}
	if c.LogGroup == 0 {
		c.LogGroup = defaultLogGroup
	}
	if len(c.VethPrefix) != 3 {
		return c, fmt.Errorf("check config: veth prefix %q must be 3 characters: %w", c.VethPrefix, errdefs.ErrInvalidArgument)
	}
	return c, nil
}

// hashOf is the 12 hex digits naming a sandbox's veth, chain and sets.
func hashOf(id string) string {
	h := sha256.Sum256([]byte(id))
	return hex.EncodeToString(h[:6])
}

func (c Config) vethName(id string) string { return c.VethPrefix + hashOf(id) }

// aliasPrefix starts the alias of every host veth of this network.
func (c Config) aliasPrefix() string { return c.Table + ":" }
func chainName(id string) string     { return "sb_" + hashOf(id) }
func setName(id string) string       { return "r_" + hashOf(id) }
func setAllName(id string) string {
	return "ra_" + hashOf(id)
}

// validID refuses ids that cannot be a file name in NetnsDir.
func validID(id string) error {
	if id == "" || len(id) > 200 || id == "." || id == ".." || strings.ContainsAny(id, "/\x00") {
		return fmt.Errorf("check sandbox id %q: %w", id, errdefs.ErrInvalidArgument)
	}
	return nil
}

// gatewayOf is the first usable address of the pool.
func gatewayOf(pool netip.Prefix) netip.Addr { return pool.Addr().Next() }
