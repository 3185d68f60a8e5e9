package network

import (
	"encoding/binary"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"github.com/ti-mo/netfilter"
	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/edge/netpolicy"
)

// nfnetlink_log message and attribute numbers (linux/netfilter/nfnetlink_log.h).
const (
	nfulnlMsgPacket   = 0
	nfulnlMsgConfig   = 1
	nfulaCfgCmd       = 1
	nfulaCfgMode      = 2
	nfulaCfgQthresh   = 5
	nfulnlCfgCmdBind  = 1
	nfulnlCfgCmdUnbnd = 2
	nfulnlCopyPacket  = 2
	nfulaPayload      = 9
	nfulaPrefix       = 10
)

// auditor turns NFLOG records and conntrack DESTROY events into
// netpolicy.Events, delivered to Config.Audit from one goroutine.
type auditor struct {
	n       *Node
	events  chan netpolicy.Event
	nflog   *netlink.Conn
	ct      *conntrack.Conn
	done    chan struct{}
	wg      sync.WaitGroup
	dropped atomic.Int64
	once    sync.Once
}

func startAuditor(n *Node) (*auditor, error) {
	a := &auditor{n: n, events: make(chan netpolicy.Event, 4096), done: make(chan struct{})}
	nl, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
	if err != nil {
		return nil, fmt.Errorf("open nflog socket: %w", err)
	}
	_ = nl.SetReadBuffer(4 << 20)
	if err := nflogConfig(nl, a.n.cfg.LogGroup, nfulnlCfgCmdBind); err != nil {
		nl.Close()
		return nil, fmt.Errorf("bind nflog group %d: %w", a.n.cfg.LogGroup, err)
	}
	a.nflog = nl
	ct, err := conntrack.Dial(nil)
	if err != nil {
		nl.Close()
		return nil, fmt.Errorf("open conntrack events: %w", err)
	}
	_ = ct.SetReadBuffer(4 << 20)
	ctEvents := make(chan conntrack.Event, 1024)
	ctErrs, err := ct.Listen(ctEvents, 1, []netfilter.NetlinkGroup{netfilter.GroupCTDestroy})
	if err != nil {
		nl.Close()
		ct.Close()
		return nil, fmt.Errorf("listen conntrack events: %w", err)
	}
	a.ct = ct
	a.wg.Add(3)
	go a.readNFLOG()
	go a.readConntrack(ctEvents, ctErrs)
	go a.deliver()
	return a, nil
}

func (a *auditor) stop() {
	a.once.Do(func() {
		close(a.done)
		a.nflog.Close()
		a.ct.Close()
		a.wg.Wait()
		if d := a.dropped.Load(); d > 0 {
			a.n.cfg.Log.Warn("network audit events dropped", "count", d)
		}
	})
}

func nflogConfig(c *netlink.Conn, group uint16, cmd uint8) error {
	hdr := []byte{unix.AF_UNSPEC, unix.NFNETLINK_V0, 0, 0}
	binary.BigEndian.PutUint16(hdr[2:], group)
	ae := netlink.NewAttributeEncoder()
	ae.Bytes(nfulaCfgCmd, []byte{cmd})
	if cmd == nfulnlCfgCmdBind {
		mode := make([]byte, 6)
		binary.BigEndian.PutUint32(mode, 96) // copy range: IP and L4 headers
		mode[4] = nfulnlCopyPacket
		ae.Bytes(nfulaCfgMode, mode)
		ae.Bytes(nfulaCfgQthresh, binary.BigEndian.AppendUint32(nil, 1))
	}
	attrs, err := ae.Encode()
	if err != nil {
		return err
	}
	_, err = c.Execute(netlink.Message{
		Header: netlink.Header{
			Type:  netlink.HeaderType(unix.NFNL_SUBSYS_ULOG<<8 | nfulnlMsgConfig),
			Flags: netlink.Request | netlink.Acknowledge,
		},
		Data: append(hdr, attrs...),
	})
	return err
}

func (a *auditor) emit(e netpolicy.Event) {
	select {
	case a.events <- e:
	default:
		a.dropped.Add(1)
	}
}

func (a *auditor) deliver() {
	defer a.wg.Done()
	for {
		select {
		case e := <-a.events:
			a.n.cfg.Audit(e)
		case <-a.done:
			// Deliver what is queued, then stop.
			for {
				select {
				case e := <-a.events:
					a.n.cfg.Audit(e)
				default:
					return
				}
			}
		}
	}
}

func (a *auditor) readNFLOG() {
	defer a.wg.Done()
	for {
		msgs, err := a.nflog.Receive()
		if err != nil {
			select {
			case <-a.done:
				return
			default:
			}
			a.n.cfg.Log.Warn("read nflog", "err", err)
			if strings.Contains(err.Error(), "closed") {
				return
			}
			continue
		}
		for _, m := range msgs {
			if m.Header.Type != netlink.HeaderType(unix.NFNL_SUBSYS_ULOG<<8|nfulnlMsgPacket) || len(m.Data) < 4 {
				continue
			}
			if e, ok := a.parseNFLOG(m.Data[4:]); ok {
				a.emit(e)
			}
		}
	}
}

// parseNFLOG turns one NFLOG packet record into an Event.
func (a *auditor) parseNFLOG(b []byte) (netpolicy.Event, bool) {
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return netpolicy.Event{}, false
	}
	var prefix string
	var payload []byte
	for ad.Next() {
		switch ad.Type() {
		case nfulaPrefix:
			prefix = strings.TrimRight(string(ad.Bytes()), "\x00")
		case nfulaPayload:
			payload = ad.Bytes()
		}
	}
	verdict, rule, ok := parsePrefix(prefix)
	if !ok {
		return netpolicy.Event{}, false
	}
	p, ok := parseIPv4(payload)
	if !ok {
		return netpolicy.Event{}, false
	}
	e := netpolicy.Event{
		Time: time.Now(), Kind: "connect", Verdict: verdict, Rule: rule,
		Proto: protoName(p.proto), Dest: p.dst, Port: p.dport,
	}
	a.n.mu.Lock()
	sb, known := a.n.byAddr[p.src]
	if known {
		e.SandboxID = sb.id
		e.Name = sb.nameFor(p.dst)
	}
	a.n.mu.Unlock()
	if !known {
		return netpolicy.Event{}, false
	}
	return e, true
}

func (a *auditor) readConntrack(events <-chan conntrack.Event, errs <-chan error) {
	defer a.wg.Done()
	for {
		select {
		case <-a.done:
			return
		case err := <-errs:
			select {
			case <-a.done:
				return
			default:
			}
			if err != nil {
				a.n.cfg.Log.Warn("read conntrack events", "err", err)
			}
			return
		case ev := <-events:
			if ev.Type != conntrack.EventDestroy || ev.Flow == nil {
				continue
			}
			f := ev.Flow
			src := f.TupleOrig.IP.SourceAddress.Unmap()
			if !a.n.cfg.Pool.Contains(src) {
				continue
			}
			dst := f.TupleOrig.IP.DestinationAddress.Unmap()
			e := netpolicy.Event{
				Time: time.Now(), Kind: "close", Verdict: "allow",
				Proto: protoName(f.TupleOrig.Proto.Protocol), Dest: dst, Port: f.TupleOrig.Proto.DestinationPort,
				BytesOut: int64(f.CountersOrig.Bytes), BytesIn: int64(f.CountersReply.Bytes),
			}
			a.n.mu.Lock()
			sb, known := a.n.byAddr[src]
			if known {
				e.SandboxID = sb.id
				e.Name = sb.nameFor(dst)
			}
			a.n.mu.Unlock()
			if known {
				a.emit(e)
			}
		}
	}
}
