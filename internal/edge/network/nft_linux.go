package network

import (
	"encoding/binary"
	"net/netip"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// Names of the table's shared chains and map (see doc.go).
const (
	chainInput       = "input"
	chainForward     = "forward"
	chainPost        = "postrouting"
	chainDeny        = "deny"          // reject, no log
	chainDenyDefault = "deny_default"  // log and reject
	chainDenyReserve = "deny_reserved" // log and reject
	chainDenyLimit   = "deny_limit"    // log and reject
	chainAcceptRes   = "accept_resolved"
	chainHard        = "hard"        // hard-reserved ranges: goto deny_reserved
	chainSoft        = "soft"        // soft-reserved ranges: goto deny_reserved
	chainSoftAccept  = "soft_accept" // soft-reserved ranges: goto accept_resolved
	mapSandboxes     = "sandboxes"
)

var (
	resolvedType    = nftables.MustConcatSetType(nftables.TypeIPAddr, nftables.TypeInetProto, nftables.TypeInetService)
	resolvedAllType = nftables.MustConcatSetType(nftables.TypeIPAddr, nftables.TypeInetProto)
)

func tableOf(name string) *nftables.Table {
	return &nftables.Table{Name: name, Family: nftables.TableFamilyINet}
}

func regularChain(t *nftables.Table, name string) *nftables.Chain {
	return &nftables.Chain{Table: t, Name: name}
}

func sandboxMap(t *nftables.Table) *nftables.Set {
	return &nftables.Set{Table: t, Name: mapSandboxes, IsMap: true, KeyType: nftables.TypeIPAddr, DataType: nftables.TypeVerdict}
}

func resolvedSet(t *nftables.Table, id string) *nftables.Set {
	return &nftables.Set{Table: t, Name: setName(id), HasTimeout: true, Concatenation: true, KeyType: resolvedType}
}

func resolvedAllSet(t *nftables.Table, id string) *nftables.Set {
	return &nftables.Set{Table: t, Name: setAllName(id), HasTimeout: true, Concatenation: true, KeyType: resolvedAllType}
}

// --- expression helpers ---

func ifname(name string) []byte {
	b := make([]byte, unix.IFNAMSIZ)
	copy(b, name)
	return b
}

// iifPrefix matches the input interface name starting with prefix.
func iifPrefix(prefix string, op expr.CmpOp) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
		&expr.Cmp{Op: op, Register: 1, Data: []byte(prefix)},
	}
}

func oifPrefix(prefix string, op expr.CmpOp) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1},
		&expr.Cmp{Op: op, Register: 1, Data: []byte(prefix)},
	}
}

func isIPv4() []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.NFPROTO_IPV4}},
	}
}

func isNotIPv4() []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: []byte{unix.NFPROTO_IPV4}},
	}
}

// addrIn matches the IPv4 source (offset 12) or destination (16) in p.
func addrIn(offset uint32, p netip.Prefix) []expr.Any {
	mask := net4Mask(p.Bits())
	a := p.Masked().Addr().As4()
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: 4},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: mask, Xor: make([]byte, 4)},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: a[:]},
	}
}

func net4Mask(bits int) []byte {
	m := uint32(0)
	if bits > 0 {
		m = ^uint32(0) << (32 - bits)
	}
	return binary.BigEndian.AppendUint32(nil, m)
}

func l4proto(p uint8) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{p}},
	}
}

func dport(port uint16) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binary.BigEndian.AppendUint16(nil, port)},
	}
}

// inResolved matches daddr . l4proto . th dport in set s.
func inResolved(s string) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 9},
		&expr.Payload{DestRegister: 10, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Lookup{SourceRegister: 1, SetName: s},
	}
}

// inResolvedAll matches daddr . l4proto in set s.
func inResolvedAll(s string) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 9},
		&expr.Lookup{SourceRegister: 1, SetName: s},
	}
}

func ctState(bits uint32) []expr.Any {
	return []expr.Any{
		&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binary.NativeEndian.AppendUint32(nil, bits), Xor: make([]byte, 4)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: make([]byte, 4)},
	}
}

func logAs(group uint16, prefix string) expr.Any {
	return &expr.Log{
		Key:   1<<unix.NFTA_LOG_GROUP | 1<<unix.NFTA_LOG_PREFIX | 1<<unix.NFTA_LOG_SNAPLEN | 1<<unix.NFTA_LOG_QTHRESHOLD,
		Group: group,
		// Send each record at once instead of batching for up to a second.
		QThreshold: 1,
		Snaplen:    64,
		Data:       []byte(prefix),
	}
}

func verdict(k expr.VerdictKind, chain string) expr.Any {
	return &expr.Verdict{Kind: k, Chain: chain}
}

func cat(parts ...[]expr.Any) []expr.Any {
	var out []expr.Any
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// --- table layout ---

// addBase adds (or re-adds) the table, its shared chains and the sandbox
// map, and rewrites the shared chains' rules. Sandbox chains, their sets and
// the map's elements are left alone.
func addBase(c *nftables.Conn, cfg Config) {
	pool, vethPrefix := cfg.Pool, cfg.VethPrefix
	t := c.AddTable(tableOf(cfg.Table))
	accept := nftables.ChainPolicyAccept

	input := c.AddChain(&nftables.Chain{Table: t, Name: chainInput, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: &accept})
	forward := c.AddChain(&nftables.Chain{Table: t, Name: chainForward, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &accept})
	post := c.AddChain(&nftables.Chain{Table: t, Name: chainPost, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource, Policy: &accept})
	shared := map[string]*nftables.Chain{}
	for _, name := range []string{chainDeny, chainDenyDefault, chainDenyReserve, chainDenyLimit, chainAcceptRes, chainHard, chainSoft, chainSoftAccept} {
		shared[name] = c.AddChain(regularChain(t, name))
	}
	// The map must exist before rules refer to it.
	c.AddSet(sandboxMap(t), nil)

	for _, ch := range []*nftables.Chain{input, forward, post} {
		c.FlushChain(ch)
	}
	for _, ch := range shared {
		c.FlushChain(ch)
	}
	add := func(ch *nftables.Chain, exprs ...expr.Any) {
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: exprs})
	}

	// input: nothing on the node is reachable from a sandbox.
	add(input, cat(iifPrefix(vethPrefix, expr.CmpOpEq), []expr.Any{verdict(expr.VerdictDrop, "")})...)

	// forward.
	add(forward, cat(ctState(expr.CtStateBitESTABLISHED|expr.CtStateBitRELATED), []expr.Any{verdict(expr.VerdictAccept, "")})...)
	add(forward, cat(iifPrefix(vethPrefix, expr.CmpOpEq), isNotIPv4(), []expr.Any{verdict(expr.VerdictDrop, "")})...)
	add(forward, cat(iifPrefix(vethPrefix, expr.CmpOpEq), isIPv4(), []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4},
		&expr.Lookup{SourceRegister: 1, SetName: mapSandboxes, DestRegister: 0, IsDestRegSet: true},
	})...)
	add(forward, cat(iifPrefix(vethPrefix, expr.CmpOpEq), []expr.Any{verdict(expr.VerdictDrop, "")})...)
	add(forward, cat(oifPrefix(vethPrefix, expr.CmpOpEq), []expr.Any{verdict(expr.VerdictDrop, "")})...)

	// postrouting: masquerade sandbox traffic leaving the node.
	add(post, cat(isIPv4(), addrIn(12, pool), oifPrefix(vethPrefix, expr.CmpOpNeq), []expr.Any{&expr.Masq{}})...)

	// deny: TCP gets a reset, the rest ICMP admin-prohibited.
	add(shared[chainDeny], cat(l4proto(protoTCP), []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_TCP_RST}})...)
	add(shared[chainDeny], &expr.Reject{Type: unix.NFT_REJECT_ICMPX_UNREACH, Code: unix.NFT_REJECT_ICMPX_ADMIN_PROHIBITED})
	for name, rule := range map[string]string{chainDenyDefault: "default", chainDenyReserve: "reserved", chainDenyLimit: "limit"} {
		add(shared[name], logAs(cfg.LogGroup, logPrefix(false, rule)), verdict(expr.VerdictGoto, chainDeny))
	}
	add(shared[chainAcceptRes], logAs(cfg.LogGroup, logPrefix(true, "resolved")), verdict(expr.VerdictAccept, ""))
	for _, p := range hardSet(pool) {
		add(shared[chainHard], cat(addrIn(16, p), []expr.Any{verdict(expr.VerdictGoto, chainDenyReserve)})...)
	}
	for _, p := range softReserved {
		add(shared[chainSoft], cat(addrIn(16, p), []expr.Any{verdict(expr.VerdictGoto, chainDenyReserve)})...)
		add(shared[chainSoftAccept], cat(addrIn(16, p), []expr.Any{verdict(expr.VerdictGoto, chainAcceptRes)})...)
	}
}

// addSandboxRules fills a sandbox's (already added, empty) chain.
func addSandboxRules(c *nftables.Conn, cfg Config, ch *nftables.Chain, id, veth string, addr netip.Addr, steps []step, maxConns int) {
	t := ch.Table
	add := func(exprs ...expr.Any) {
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: exprs})
	}
	// Only the sandbox's own veth may use its address.
	add(&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: ifname(veth)},
		verdict(expr.VerdictDrop, ""))
	// Mark the sandbox's connections with its address, so its conntrack
	// entries can be found and flushed without walking everyone's.
	add(&expr.Immediate{Register: 1, Data: binary.NativeEndian.AppendUint32(nil, markOf(addr))},
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1, SourceRegister: true})
	// ct count over maxConns.
	add(&expr.Connlimit{Count: uint32(maxConns), Flags: 1}, verdict(expr.VerdictGoto, chainDenyLimit))
	rs, ra := setName(id), setAllName(id)
	for _, s := range steps {
		switch s.kind {
		case stepCIDR:
			m := addrIn(16, s.prefix)
			if s.proto != 0 {
				m = append(m, l4proto(s.proto)...)
			}
			if s.port != 0 {
				m = append(m, dport(s.port)...)
			}
			m = append(m, logAs(cfg.LogGroup, logPrefix(s.allow, s.rule)))
			if s.allow {
				m = append(m, verdict(expr.VerdictAccept, ""))
			} else {
				m = append(m, verdict(expr.VerdictGoto, chainDeny))
			}
			add(m...)
		case stepHard:
			add(verdict(expr.VerdictJump, chainHard))
		case stepResolvedSoft:
			add(cat(inResolved(rs), []expr.Any{verdict(expr.VerdictJump, chainSoftAccept)})...)
			add(cat(inResolvedAll(ra), []expr.Any{verdict(expr.VerdictJump, chainSoftAccept)})...)
		case stepSoft:
			add(verdict(expr.VerdictJump, chainSoft))
		case stepResolved:
			add(cat(inResolved(rs), []expr.Any{verdict(expr.VerdictGoto, chainAcceptRes)})...)
			add(cat(inResolvedAll(ra), []expr.Any{verdict(expr.VerdictGoto, chainAcceptRes)})...)
		case stepDefault:
			add(verdict(expr.VerdictGoto, chainDenyDefault))
		}
	}
}

func mapElement(addr netip.Addr, chain string) nftables.SetElement {
	a := addr.As4()
	return nftables.SetElement{Key: a[:], VerdictData: &expr.Verdict{Kind: expr.VerdictJump, Chain: chain}}
}

func resolvedElement(k resolvedKey, ttl time.Duration) nftables.SetElement {
	a := k.addr.As4()
	key := append([]byte{}, a[:]...)
	key = append(key, k.proto, 0, 0, 0)
	if k.port != 0 {
		key = binary.BigEndian.AppendUint16(key, k.port)
		key = append(key, 0, 0)
	}
	return nftables.SetElement{Key: key, Timeout: ttl}
}

// markOf is the conntrack mark of a sandbox's connections: its address.
func markOf(addr netip.Addr) uint32 {
	return binary.BigEndian.Uint32(addr.AsSlice())
}
