package network

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/google/nftables"
	"github.com/ti-mo/conntrack"
	"github.com/ti-mo/netfilter"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/edge/netpolicy"
	"dsec.dev/dsec/internal/errdefs"
)

// Node is the network side of one edge node. Its methods are safe for
// concurrent use.
type Node struct {
	cfg Config
	gw  netip.Addr

	mu        sync.Mutex
	nft       *nftables.Conn
	sandboxes map[string]*sandbox
	byAddr    map[netip.Addr]*sandbox
	next      netip.Addr // where the address search starts

	audit *auditor
}

type sandbox struct {
	id    string
	veth  string
	addr  netip.Addr
	netns string
	pol   *netpolicy.Policy
	steps []step
	// resolved mirrors the kernel's resolved sets.
	resolved map[resolvedKey]resolvedEntry
}

type resolvedEntry struct {
	name    string
	expires time.Time
}

// Setup prepares the node: sysctls, the nftables table and the audit
// readers. It is idempotent: sandboxes a previous daemon attached stay
// attached and are learned again (call Recover to say which to keep).
func Setup(ctx context.Context, cfg Config) (*Node, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.NetnsDir, 0o755); err != nil {
		return nil, fmt.Errorf("create netns dir: %w", err)
	}
	nft, err := nftables.New(nftables.AsLasting())
	if err != nil {
		return nil, fmt.Errorf("open nftables: %w", err)
	}
	n := &Node{
		cfg:       cfg,
		gw:        gatewayOf(cfg.Pool),
		nft:       nft,
		sandboxes: map[string]*sandbox{},
		byAddr:    map[netip.Addr]*sandbox{},
	}
	n.next = n.gw.Next()
	addBase(nft, cfg)
	if err := nft.Flush(); err != nil {
		nft.CloseLasting()
		return nil, fmt.Errorf("install nftables table %s: %w", n.cfg.Table, err)
	}
	for _, s := range []struct{ path, value string }{
		{"/proc/sys/net/ipv4/ip_forward", "1"},
		{"/proc/sys/net/netfilter/nf_conntrack_acct", "1"},
	} {
		if err := os.WriteFile(s.path, []byte(s.value), 0o644); err != nil {
			nft.CloseLasting()
			return nil, fmt.Errorf("set sysctl %s: %w", s.path, err)
		}
	}
	if err := n.learn(); err != nil {
		nft.CloseLasting()
		return nil, err
	}
	if cfg.Audit != nil {
		a, err := startAuditor(n)
		if err != nil {
			nft.CloseLasting()
			return nil, err
		}
		n.audit = a
	}
	return n, nil
}

// linkList lists the host's links, again when the kernel says the dump
// was interrupted by a change (another node's veths coming and going), so
// no link is missed.
func linkList() ([]netlink.Link, error) {
	return redump(netlink.LinkList)
}

// routeList lists l's IPv4 routes, again after an interrupted dump.
func routeList(l netlink.Link) ([]netlink.Route, error) {
	return redump(func() ([]netlink.Route, error) { return netlink.RouteList(l, unix.AF_INET) })
}

// redump runs a netlink dump until one is not interrupted. A host where
// many sandboxes start and stop at once can interrupt ten dumps in a row,
// so the retries back off (1 ms, doubling to 64 ms, about 2 s in all)
// rather than racing the churn that interrupted them.
func redump[T any](dump func() ([]T, error)) ([]T, error) {
	wait := time.Millisecond
	for range 40 {
		got, err := dump()
		if !errors.Is(err, netlink.ErrDumpInterrupted) {
			return got, err
		}
		time.Sleep(wait)
		wait = min(2*wait, 64*time.Millisecond)
	}
	return dump()
}

// learn finds the sandboxes already attached: every veth whose alias names
// a dsec sandbox, with the pool address routed to it.
func (n *Node) learn() error {
	links, err := linkList()
	if err != nil {
		return fmt.Errorf("list links: %w", err)
	}
	for _, l := range links {
		id, ok := n.sandboxIDOf(l)
		if !ok {
			continue
		}
		routes, err := routeList(l)
		if err != nil {
			return fmt.Errorf("list routes of %s: %w", l.Attrs().Name, err)
		}
		for _, r := range routes {
			if r.Dst == nil {
				continue
			}
			a, ok := netip.AddrFromSlice(r.Dst.IP.To4())
			ones, _ := r.Dst.Mask.Size()
			if ok && ones == 32 && n.cfg.Pool.Contains(a) && a != n.gw {
				sb := &sandbox{id: id, veth: l.Attrs().Name, addr: a, netns: filepath.Join(n.cfg.NetnsDir, id), resolved: map[resolvedKey]resolvedEntry{}}
				n.sandboxes[id] = sb
				n.byAddr[a] = sb
				break
			}
		}
	}
	return nil
}

// sandboxIDOf is the sandbox id of a dsec veth, from its alias.
func (n *Node) sandboxIDOf(l netlink.Link) (string, bool) {
	a := l.Attrs()
	if !strings.HasPrefix(a.Name, n.cfg.VethPrefix) || !strings.HasPrefix(a.Alias, n.cfg.aliasPrefix()) {
		return "", false
	}
	id := strings.TrimPrefix(a.Alias, n.cfg.aliasPrefix())
	return id, n.cfg.vethName(id) == a.Name
}

// allocate picks a free address of the pool; n.mu is held.
func (n *Node) allocate() (netip.Addr, error) {
	last := lastAddr(n.cfg.Pool)
	a := n.next
	for range 1 << (32 - n.cfg.Pool.Bits()) {
		if !n.cfg.Pool.Contains(a) || a == last {
			a = n.gw.Next()
		}
		if _, used := n.byAddr[a]; !used {
			n.next = a.Next()
			return a, nil
		}
		a = a.Next()
	}
	return netip.Addr{}, fmt.Errorf("allocate address in %s: %w", n.cfg.Pool, errdefs.ErrResourceExhausted)
}

func lastAddr(p netip.Prefix) netip.Addr {
	a := p.Masked().Addr().As4()
	host := uint32(1)<<(32-p.Bits()) - 1
	v := uint32(a[0])<<24 | uint32(a[1])<<16 | uint32(a[2])<<8 | uint32(a[3]) | host
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// Attach gives sandbox id a network namespace, a veth pair and an address,
// and installs pol (nil denies everything). The namespace is at
// Attachment.NetnsPath until Detach.
func (n *Node) Attach(ctx context.Context, id string, pol *netpolicy.Policy) (*Attachment, error) {
	if err := validID(id); err != nil {
		return nil, err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if _, ok := n.sandboxes[id]; ok {
		return nil, fmt.Errorf("attach sandbox %s: %w", id, errdefs.ErrAlreadyExists)
	}
	veth := n.cfg.vethName(id)
	if _, err := netlink.LinkByName(veth); err == nil {
		return nil, fmt.Errorf("attach sandbox %s: link %s exists: %w", id, veth, errdefs.ErrAlreadyExists)
	}
	addr, err := n.allocate()
	if err != nil {
		return nil, err
	}
	sb := &sandbox{
		id: id, veth: veth, addr: addr,
		netns:    filepath.Join(n.cfg.NetnsDir, id),
		pol:      pol,
		steps:    plan(pol, n.cfg.Pool),
		resolved: map[resolvedKey]resolvedEntry{},
	}
	ok := false
	var undo []func()
	defer func() {
		if !ok {
			for i := len(undo) - 1; i >= 0; i-- {
				undo[i]()
			}
		}
	}()

	if err := createNetns(sb.netns); err != nil {
		return nil, fmt.Errorf("attach sandbox %s: %w", id, err)
	}
	undo = append(undo, func() { removeNetns(sb.netns) })
	if err := n.plumb(sb); err != nil {
		return nil, fmt.Errorf("attach sandbox %s: %w", id, err)
	}
	undo = append(undo, func() { deleteLink(veth) })

	t := tableOf(n.cfg.Table)
	ch := n.nft.AddChain(regularChain(t, chainName(id)))
	if err := n.nft.AddSet(resolvedSet(t, id), nil); err != nil {
		return nil, fmt.Errorf("attach sandbox %s: add set: %w", id, err)
	}
	if err := n.nft.AddSet(resolvedAllSet(t, id), nil); err != nil {
		return nil, fmt.Errorf("attach sandbox %s: add set: %w", id, err)
	}
	addSandboxRules(n.nft, n.cfg, ch, id, veth, addr, sb.steps, n.cfg.MaxConns)
	if err := n.nft.SetAddElements(sandboxMap(t), []nftables.SetElement{mapElement(addr, ch.Name)}); err != nil {
		return nil, fmt.Errorf("attach sandbox %s: add map element: %w", id, err)
	}
	if err := n.nft.Flush(); err != nil {
		return nil, fmt.Errorf("attach sandbox %s: install rules: %w", id, err)
	}
	ok = true
	n.sandboxes[id] = sb
	n.byAddr[addr] = sb
	n.cfg.Log.Debug("sandbox network attached", "sandbox", id, "addr", addr, "veth", veth)
	return &Attachment{ID: id, NetnsPath: sb.netns, Addr: addr, Gateway: n.gw, HostVeth: veth}, nil
}

// plumb creates the veth pair with its addresses, routes and qdisc.
func (n *Node) plumb(sb *sandbox) error {
	nsf, err := os.Open(sb.netns)
	if err != nil {
		return fmt.Errorf("open netns: %w", err)
	}
	defer nsf.Close()
	la := netlink.NewLinkAttrs()
	la.Name = sb.veth
	la.Alias = n.cfg.aliasPrefix() + sb.id
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: sandboxIface, PeerNamespace: netlink.NsFd(int(nsf.Fd()))}); err != nil {
		return fmt.Errorf("add veth %s: %w", sb.veth, err)
	}
	host, err := netlink.LinkByName(sb.veth)
	if err != nil {
		return fmt.Errorf("find veth %s: %w", sb.veth, err)
	}
	if host.Attrs().Alias == "" {
		if err := netlink.LinkSetAlias(host, la.Alias); err != nil {
			return fmt.Errorf("set alias of %s: %w", sb.veth, err)
		}
	}
	gw32 := &net.IPNet{IP: n.gw.AsSlice(), Mask: net.CIDRMask(32, 32)}
	if err := netlink.AddrAdd(host, &netlink.Addr{IPNet: gw32, Scope: unix.RT_SCOPE_LINK}); err != nil {
		return fmt.Errorf("add gateway address to %s: %w", sb.veth, err)
	}
	if err := netlink.LinkSetUp(host); err != nil {
		return fmt.Errorf("set %s up: %w", sb.veth, err)
	}
	sb32 := &net.IPNet{IP: sb.addr.AsSlice(), Mask: net.CIDRMask(32, 32)}
	if err := netlink.RouteReplace(&netlink.Route{LinkIndex: host.Attrs().Index, Dst: sb32, Scope: netlink.SCOPE_LINK, Src: n.gw.AsSlice()}); err != nil {
		return fmt.Errorf("add route to %s: %w", sb.addr, err)
	}

	h, err := netlink.NewHandleAt(netns.NsHandle(nsf.Fd()))
	if err != nil {
		return fmt.Errorf("open netlink in sandbox netns: %w", err)
	}
	defer h.Close()
	lo, err := h.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("find sandbox lo: %w", err)
	}
	if err := h.LinkSetUp(lo); err != nil {
		return fmt.Errorf("set sandbox lo up: %w", err)
	}
	eth, err := h.LinkByName(sandboxIface)
	if err != nil {
		return fmt.Errorf("find sandbox %s: %w", sandboxIface, err)
	}
	if err := h.AddrAdd(eth, &netlink.Addr{IPNet: sb32}); err != nil {
		return fmt.Errorf("add sandbox address: %w", err)
	}
	if err := h.LinkSetUp(eth); err != nil {
		return fmt.Errorf("set sandbox %s up: %w", sandboxIface, err)
	}
	if err := h.RouteAdd(&netlink.Route{LinkIndex: eth.Attrs().Index, Gw: n.gw.AsSlice(), Flags: int(netlink.FLAG_ONLINK)}); err != nil {
		return fmt.Errorf("add sandbox default route: %w", err)
	}
	if err := h.QdiscReplace(tbf(eth.Attrs().Index, n.cfg.EgressBytesPerSec)); err != nil {
		return fmt.Errorf("add egress qdisc: %w", err)
	}
	return nil
}

// tbf is the egress cap: rate bytes/s, a burst of 4 ms of traffic (at least
// 128 KiB so a GSO packet fits) and up to 50 ms of queue.
func tbf(ifindex int, rate int64) *netlink.Tbf {
	burst := max(uint64(rate)/250, 128<<10)
	limit := uint64(rate)/20 + burst
	return &netlink.Tbf{
		QdiscAttrs: netlink.QdiscAttrs{LinkIndex: ifindex, Handle: netlink.MakeHandle(1, 0), Parent: netlink.HANDLE_ROOT},
		Rate:       uint64(rate),
		Limit:      uint32(min(limit, 1<<31)),
		Buffer:     netlink.Xmittime(uint64(rate), uint32(min(burst, 1<<31))),
	}
}

func deleteLink(name string) error {
	l, err := netlink.LinkByName(name)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			return nil
		}
		return fmt.Errorf("find link %s: %w", name, err)
	}
	if err := netlink.LinkDel(l); err != nil {
		return fmt.Errorf("delete link %s: %w", name, err)
	}
	return nil
}

// Update replaces sandbox id's policy in one nftables transaction. Resolved
// addresses whose name the new policy no longer allows are dropped. With cut
// set, the sandbox's tracked connections the new policy would not allow are
// deleted, so they break instead of living on.
func (n *Node) Update(ctx context.Context, id string, pol *netpolicy.Policy, cut bool) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	sb, ok := n.sandboxes[id]
	if !ok {
		return fmt.Errorf("update sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	if err := n.install(sb, pol); err != nil {
		return fmt.Errorf("update sandbox %s: %w", id, err)
	}
	if cut {
		if err := n.cut(sb); err != nil {
			return fmt.Errorf("update sandbox %s: %w", id, err)
		}
	}
	return nil
}

// install rewrites sb's chain and resolved sets for pol; n.mu is held.
func (n *Node) install(sb *sandbox, pol *netpolicy.Policy) error {
	t := tableOf(n.cfg.Table)
	steps := plan(pol, n.cfg.Pool)
	ch := n.nft.AddChain(regularChain(t, chainName(sb.id)))
	rs, ra := resolvedSet(t, sb.id), resolvedAllSet(t, sb.id)
	if err := n.nft.AddSet(rs, nil); err != nil {
		return fmt.Errorf("add set: %w", err)
	}
	if err := n.nft.AddSet(ra, nil); err != nil {
		return fmt.Errorf("add set: %w", err)
	}
	n.nft.FlushChain(ch)
	addSandboxRules(n.nft, n.cfg, ch, sb.id, sb.veth, sb.addr, steps, n.cfg.MaxConns)

	// Keep the resolved addresses the new policy still allows: flush both
	// sets and put them back with what is left of their timeouts.
	now := time.Now()
	keep := map[resolvedKey]resolvedEntry{}
	var elems, elemsAll []nftables.SetElement
	for k, e := range sb.resolved {
		left := e.expires.Sub(now)
		if left < time.Millisecond || !nameAllowed(pol, e.name) {
			continue
		}
		keep[k] = e
		if k.port == 0 {
			elemsAll = append(elemsAll, resolvedElement(k, left))
		} else {
			elems = append(elems, resolvedElement(k, left))
		}
	}
	n.nft.FlushSet(rs)
	n.nft.FlushSet(ra)
	if len(elems) > 0 {
		if err := n.nft.SetAddElements(rs, elems); err != nil {
			return fmt.Errorf("add set elements: %w", err)
		}
	}
	if len(elemsAll) > 0 {
		if err := n.nft.SetAddElements(ra, elemsAll); err != nil {
			return fmt.Errorf("add set elements: %w", err)
		}
	}
	if err := n.nft.SetAddElements(sandboxMap(t), []nftables.SetElement{mapElement(sb.addr, ch.Name)}); err != nil {
		return fmt.Errorf("add map element: %w", err)
	}
	if err := n.nft.Flush(); err != nil {
		return fmt.Errorf("install rules: %w", err)
	}
	sb.pol, sb.steps, sb.resolved = pol, steps, keep
	return nil
}

// resolvedNow reports whether sb's resolved sets hold addr/proto/port.
func (sb *sandbox) resolvedNow(addr netip.Addr, proto uint8, port uint16, now time.Time) (string, bool) {
	for _, k := range []resolvedKey{{addr, proto, port}, {addr, proto, 0}} {
		if e, ok := sb.resolved[k]; ok && e.expires.After(now) {
			return e.name, true
		}
	}
	return "", false
}

// nameFor is the name addr was resolved from, if any.
func (sb *sandbox) nameFor(addr netip.Addr) string {
	for k, e := range sb.resolved {
		if k.addr == addr {
			return e.name
		}
	}
	return ""
}

// cut deletes sb's tracked connections its current policy denies.
func (n *Node) cut(sb *sandbox) error {
	c, err := conntrack.Dial(nil)
	if err != nil {
		return fmt.Errorf("open conntrack: %w", err)
	}
	defer c.Close()
	flows, err := c.DumpFilter(conntrack.NewFilter().Family(netfilter.ProtoIPv4).Mark(markOf(sb.addr)), nil)
	if err != nil {
		return fmt.Errorf("dump conntrack: %w", err)
	}
	now := time.Now()
	var errs []error
	for _, f := range flows {
		o := f.TupleOrig
		if o.IP.SourceAddress.Unmap() != sb.addr {
			continue
		}
		dst := o.IP.DestinationAddress.Unmap()
		_, res := sb.resolvedNow(dst, o.Proto.Protocol, o.Proto.DestinationPort, now)
		if allow, _ := evaluate(sb.steps, n.cfg.Pool, dst, o.Proto.Protocol, o.Proto.DestinationPort, res); allow {
			continue
		}
		if err := c.Delete(f); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("delete conntrack entry to %s: %w", dst, err))
		}
	}
	return errors.Join(errs...)
}

// deleteFlows deletes every tracked connection of the sandbox with addr,
// found by its conntrack mark.
func deleteFlows(addr netip.Addr) error {
	c, err := conntrack.Dial(nil)
	if err != nil {
		return fmt.Errorf("open conntrack: %w", err)
	}
	defer c.Close()
	if err := c.FlushFilter(conntrack.NewFilter().Family(netfilter.ProtoIPv4).Mark(markOf(addr))); err != nil {
		return fmt.Errorf("flush conntrack entries of %s: %w", addr, err)
	}
	return nil
}

// AllowResolved lets sandbox id reach addr on ports (none: every port) for
// ttl, because the resolver answered name with it. Calling it again extends
// the time, never shortens it. Only IPv4 is supported.
func (n *Node) AllowResolved(id string, addr netip.Addr, ports []netpolicy.Port, ttl time.Duration, name string) error {
	addr = addr.Unmap()
	if !addr.Is4() {
		return fmt.Errorf("allow %s for sandbox %s: only IPv4: %w", addr, id, errdefs.ErrNotSupported)
	}
	ttl = min(max(ttl, time.Second), 24*time.Hour)
	n.mu.Lock()
	defer n.mu.Unlock()
	sb, ok := n.sandboxes[id]
	if !ok {
		return fmt.Errorf("allow %s for sandbox %s: %w", addr, id, errdefs.ErrNotFound)
	}
	t := tableOf(n.cfg.Table)
	now := time.Now()
	expires := now.Add(ttl)
	var elems, elemsAll []nftables.SetElement
	var keys []resolvedKey
	for _, k := range resolvedKeys(addr, ports) {
		if e, ok := sb.resolved[k]; ok && e.expires.After(expires) {
			continue
		}
		keys = append(keys, k)
		if k.port == 0 {
			elemsAll = append(elemsAll, resolvedElement(k, ttl))
		} else {
			elems = append(elems, resolvedElement(k, ttl))
		}
	}
	if len(keys) == 0 {
		return nil
	}
	if len(elems) > 0 {
		if err := n.nft.SetAddElements(resolvedSet(t, id), elems); err != nil {
			return fmt.Errorf("allow %s for sandbox %s: %w", addr, id, err)
		}
	}
	if len(elemsAll) > 0 {
		if err := n.nft.SetAddElements(resolvedAllSet(t, id), elemsAll); err != nil {
			return fmt.Errorf("allow %s for sandbox %s: %w", addr, id, err)
		}
	}
	if err := n.nft.Flush(); err != nil {
		return fmt.Errorf("allow %s for sandbox %s: %w", addr, id, err)
	}
	for k, e := range sb.resolved { // forget expired entries
		if !e.expires.After(now) {
			delete(sb.resolved, k)
		}
	}
	for _, k := range keys {
		sb.resolved[k] = resolvedEntry{name: name, expires: expires}
	}
	return nil
}

// ListenDNS opens a UDP socket and a TCP listener on 127.0.0.53:53 inside
// sandbox id's namespace, for the node's resolver to serve. The caller owns
// them and must close them when the sandbox goes: an open socket keeps the
// namespace alive after Detach.
func (n *Node) ListenDNS(id string) (net.PacketConn, net.Listener, error) {
	n.mu.Lock()
	sb, ok := n.sandboxes[id]
	n.mu.Unlock()
	if !ok {
		return nil, nil, fmt.Errorf("listen dns in sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	var pc net.PacketConn
	var ln net.Listener
	err := inNetns(sb.netns, func() error {
		var err error
		if pc, err = net.ListenPacket("udp4", "127.0.0.53:53"); err != nil {
			return err
		}
		if ln, err = net.Listen("tcp4", "127.0.0.53:53"); err != nil {
			pc.Close()
			return err
		}
		return nil
	})
	if err != nil {
		return nil, nil, fmt.Errorf("listen dns in sandbox %s: %w", id, err)
	}
	return pc, ln, nil
}

// Detach removes sandbox id's namespace, veth, address, chain and sets, and
// forgets its tracked connections.
func (n *Node) Detach(ctx context.Context, id string) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	sb, ok := n.sandboxes[id]
	if !ok {
		return fmt.Errorf("detach sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	if err := n.remove(id, sb.addr); err != nil {
		return fmt.Errorf("detach sandbox %s: %w", id, err)
	}
	delete(n.sandboxes, id)
	delete(n.byAddr, sb.addr)
	return nil
}

// remove deletes everything of sandbox id; a zero addr means its map
// element is unknown. n.mu is held. Missing pieces are not errors.
func (n *Node) remove(id string, addr netip.Addr) error {
	var errs []error
	if err := n.removeRules(id, addr); err != nil {
		errs = append(errs, err)
	}
	if err := deleteLink(n.cfg.vethName(id)); err != nil {
		errs = append(errs, err)
	}
	if err := removeNetns(filepath.Join(n.cfg.NetnsDir, id)); err != nil {
		errs = append(errs, err)
	}
	if addr.IsValid() {
		if err := deleteFlows(addr); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// removeRules deletes a sandbox's map element, chain and sets by hash.
func (n *Node) removeRules(id string, addr netip.Addr) error {
	return n.removeByHash(hashOf(id), addr)
}

func (n *Node) removeByHash(hash string, addr netip.Addr) error {
	t := tableOf(n.cfg.Table)
	chains, err := n.nft.ListChainsOfTableFamily(nftables.TableFamilyINet)
	if err != nil {
		return fmt.Errorf("list chains: %w", err)
	}
	hasChain := false
	for _, c := range chains {
		if c.Table.Name == n.cfg.Table && c.Name == "sb_"+hash {
			hasChain = true
		}
	}
	sets, err := n.nft.GetSets(t)
	if err != nil {
		return fmt.Errorf("list sets: %w", err)
	}
	if addr.IsValid() {
		elems, err := n.nft.GetSetElements(sandboxMap(t))
		if err != nil {
			return fmt.Errorf("list map elements: %w", err)
		}
		for _, e := range elems {
			if a, ok := netip.AddrFromSlice(e.Key); ok && a == addr {
				if err := n.nft.SetDeleteElements(sandboxMap(t), []nftables.SetElement{{Key: e.Key}}); err != nil {
					return fmt.Errorf("delete map element: %w", err)
				}
			}
		}
	}
	if hasChain {
		ch := regularChain(t, "sb_"+hash)
		n.nft.FlushChain(ch)
		n.nft.DelChain(ch)
	}
	for _, s := range sets {
		if s.Name == "r_"+hash || s.Name == "ra_"+hash {
			n.nft.DelSet(s)
		}
	}
	if err := n.nft.Flush(); err != nil {
		return fmt.Errorf("remove rules: %w", err)
	}
	return nil
}

// Recover keeps the sandboxes in keep (re-installing their policies) and
// removes every other dsec namespace, veth, chain and set on the node. It is
// meant for the start of a daemon, after Setup.
func (n *Node) Recover(ctx context.Context, keep map[string]*netpolicy.Policy) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	var errs []error
	keepHash := map[string]bool{}
	for id := range keep {
		keepHash[hashOf(id)] = true
	}
	// Known sandboxes not kept.
	for id, sb := range n.sandboxes {
		if _, ok := keep[id]; ok {
			continue
		}
		if err := n.remove(id, sb.addr); err != nil {
			errs = append(errs, err)
		}
		delete(n.sandboxes, id)
		delete(n.byAddr, sb.addr)
	}
	// Stray veths (no route, so not learned).
	links, err := linkList()
	if err != nil {
		return fmt.Errorf("recover: list links: %w", err)
	}
	for _, l := range links {
		if id, ok := n.sandboxIDOf(l); ok {
			if _, kept := keep[id]; !kept {
				if err := deleteLink(l.Attrs().Name); err != nil {
					errs = append(errs, err)
				}
			}
		}
	}
	// Stray namespaces.
	ents, err := os.ReadDir(n.cfg.NetnsDir)
	if err != nil {
		return fmt.Errorf("recover: read %s: %w", n.cfg.NetnsDir, err)
	}
	for _, e := range ents {
		if _, kept := keep[e.Name()]; !kept && e.Type().IsRegular() {
			if err := removeNetns(filepath.Join(n.cfg.NetnsDir, e.Name())); err != nil {
				errs = append(errs, err)
			}
		}
	}
	// Stray chains, sets and map elements.
	if err := n.removeStrays(keepHash); err != nil {
		errs = append(errs, err)
	}
	// Kept sandboxes: re-install.
	for id, pol := range keep {
		sb, ok := n.sandboxes[id]
		if !ok {
			errs = append(errs, fmt.Errorf("recover sandbox %s: no veth with its address: %w", id, errdefs.ErrNotFound))
			continue
		}
		if _, err := os.Stat(sb.netns); err != nil {
			errs = append(errs, fmt.Errorf("recover sandbox %s: netns: %w", id, errdefs.ErrNotFound))
		}
		if err := n.install(sb, pol); err != nil {
			errs = append(errs, fmt.Errorf("recover sandbox %s: %w", id, err))
		}
	}
	return errors.Join(errs...)
}

func (n *Node) removeStrays(keepHash map[string]bool) error {
	t := tableOf(n.cfg.Table)
	elems, err := n.nft.GetSetElements(sandboxMap(t))
	if err != nil {
		return fmt.Errorf("list map elements: %w", err)
	}
	for _, e := range elems {
		if e.VerdictData == nil || !keepHash[strings.TrimPrefix(e.VerdictData.Chain, "sb_")] {
			if err := n.nft.SetDeleteElements(sandboxMap(t), []nftables.SetElement{{Key: e.Key}}); err != nil {
				return fmt.Errorf("delete map element: %w", err)
			}
		}
	}
	if err := n.nft.Flush(); err != nil {
		return fmt.Errorf("delete map elements: %w", err)
	}
	chains, err := n.nft.ListChainsOfTableFamily(nftables.TableFamilyINet)
	if err != nil {
		return fmt.Errorf("list chains: %w", err)
	}
	for _, c := range chains {
		if c.Table.Name == n.cfg.Table && strings.HasPrefix(c.Name, "sb_") && !keepHash[strings.TrimPrefix(c.Name, "sb_")] {
			n.nft.FlushChain(c)
			n.nft.DelChain(c)
		}
	}
	if err := n.nft.Flush(); err != nil {
		return fmt.Errorf("delete chains: %w", err)
	}
	sets, err := n.nft.GetSets(t)
	if err != nil {
		return fmt.Errorf("list sets: %w", err)
	}
	for _, s := range sets {
		h, ok := strings.CutPrefix(s.Name, "r_")
		if !ok {
			h, ok = strings.CutPrefix(s.Name, "ra_")
		}
		if ok && !keepHash[h] {
			n.nft.DelSet(s)
		}
	}
	if err := n.nft.Flush(); err != nil {
		return fmt.Errorf("delete sets: %w", err)
	}
	return nil
}

// Close stops the audit readers. Sandboxes and rules stay: use it when the
// daemon exits and its sandboxes live on. Teardown removes everything.
func (n *Node) Close() error {
	if n.audit != nil {
		n.audit.stop()
		n.audit = nil
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.nft.CloseLasting()
}

// Teardown removes everything this package made on the node: every dsec
// veth and namespace and the nftables table. ip_forward and conntrack
// accounting stay on (see the package comment). The Node must not be used
// afterwards.
func (n *Node) Teardown(ctx context.Context) error {
	if n.audit != nil {
		n.audit.stop()
		n.audit = nil
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	var errs []error
	links, err := linkList()
	if err != nil {
		errs = append(errs, fmt.Errorf("list links: %w", err))
	}
	for _, l := range links {
		if _, ok := n.sandboxIDOf(l); ok {
			if err := deleteLink(l.Attrs().Name); err != nil {
				errs = append(errs, err)
			}
		}
	}
	ents, err := os.ReadDir(n.cfg.NetnsDir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("read %s: %w", n.cfg.NetnsDir, err))
	}
	for _, e := range ents {
		if e.Type().IsRegular() {
			if err := removeNetns(filepath.Join(n.cfg.NetnsDir, e.Name())); err != nil {
				errs = append(errs, err)
			}
		}
	}
	for _, sb := range n.sandboxes {
		deleteFlows(sb.addr)
	}
	n.nft.DelTable(tableOf(n.cfg.Table))
	if err := n.nft.Flush(); err != nil && !errors.Is(err, unix.ENOENT) {
		errs = append(errs, fmt.Errorf("delete table %s: %w", n.cfg.Table, err))
	}
	n.sandboxes = map[string]*sandbox{}
	n.byAddr = map[netip.Addr]*sandbox{}
	n.nft.CloseLasting()
	if len(errs) > 0 {
		return fmt.Errorf("tear down network: %w", errors.Join(errs...))
	}
	return nil
}

// HostRoutes lists the destinations of the host's IPv4 routes in its main
// table (a default route as 0.0.0.0/0), so a node picking an address pool
// passes over one the host already routes elsewhere.
func HostRoutes() ([]netip.Prefix, error) {
	routes, err := routeList(nil)
	if err != nil {
		return nil, fmt.Errorf("list routes: %w", err)
	}
	var out []netip.Prefix
	for _, r := range routes {
		if r.Dst == nil {
			out = append(out, netip.PrefixFrom(netip.IPv4Unspecified(), 0))
			continue
		}
		addr, ok := netip.AddrFromSlice(r.Dst.IP)
		if !ok {
			continue
		}
		bits, _ := r.Dst.Mask.Size()
		out = append(out, netip.PrefixFrom(addr.Unmap(), bits))
	}
	return out, nil
}

// EgressBytes is what sandbox id sent out of its network namespace: the
// receive counter of its veth's host side (every frame the sandbox sent,
// headers included, whatever the rules then did with it). A sandbox
// without a veth is errdefs.ErrNotFound.
func (n *Node) EgressBytes(id string) (int64, error) {
	b, err := os.ReadFile(filepath.Join("/sys/class/net", n.cfg.vethName(id), "statistics", "rx_bytes"))
	if errors.Is(err, os.ErrNotExist) {
		return 0, fmt.Errorf("egress of sandbox %s: no veth: %w", id, errdefs.ErrNotFound)
	}
	if err != nil {
		return 0, fmt.Errorf("egress of sandbox %s: %w", id, err)
	}
	v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("egress of sandbox %s: read its veth's counter: %w", id, err)
	}
	return v, nil
}
