package provenance

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"sort"
	"strconv"
	"sync"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/refused"
)

// Bounds on what one sandbox's refused syscalls keep, whatever it calls:
// a count per syscall (at most maxSyscallNames of them; the profile refuses
// fewer) and its first calls one by one.
const (
	maxSyscallNames   = 256
	maxSyscallSamples = 32
)

// noSession is an audit session id never set (the kernel's AUDIT_SID_UNSET).
const noSession = 0xffffffff

// Denials is what a sandbox's seccomp profile refused, as the node's
// audit records told.
type Denials struct {
	Syscalls       []*dsecv1.ProvenanceSyscall // one per syscall, by name, with the first call's pid, command and time
	Samples        []*dsecv1.ProvenanceSyscall // the first calls, count 1 each
	SamplesDropped int64                       // calls after the samples
	Lost           int64                       // records the reader missed while the sandbox was tracked
}

// seccompRecord is one AUDIT_SECCOMP record's fields that matter here.
type seccompRecord struct {
	serial  uint64
	timeMs  int64
	session uint32
	pid     int32
	comm    string
	name    string
}

// Audit architectures (linux/audit.h) a sandbox's profile covers.
const (
	auditArchX86_64  = 0xc000003e
	auditArchI386    = 0x40000003
	auditArchAarch64 = 0xc00000b7
	x32Bit           = 0x40000000
)

// parseSeccomp reads an AUDIT_SECCOMP record's text:
//
//	audit(1796549478.182:17): auid=0 uid=0 gid=0 ses=42 pid=8963 comm="f" exe="/f" sig=0 arch=c000003e syscall=250 compat=0 ip=0x4398c9 code=0x50000
//
// A value the caller controls (comm, exe) is quoted, or hex when it holds a
// space or a quote, so it never reads as another field.
func parseSeccomp(data []byte) (seccompRecord, error) {
	var r seccompRecord
	rest, ok := bytes.CutPrefix(data, []byte("audit("))
	if !ok {
		return r, fmt.Errorf("parse seccomp record: no audit( stamp")
	}
	stamp, rest, ok := bytes.Cut(rest, []byte("):"))
	if !ok {
		return r, fmt.Errorf("parse seccomp record: unterminated stamp")
	}
	when, serial, ok := bytes.Cut(stamp, []byte(":"))
	if !ok {
		return r, fmt.Errorf("parse seccomp record: stamp %q", stamp)
	}
	var err error
	if r.serial, err = strconv.ParseUint(string(serial), 10, 64); err != nil {
		return r, fmt.Errorf("parse seccomp record: serial: %w", err)
	}
	sec, msec, _ := bytes.Cut(when, []byte("."))
	s, err1 := strconv.ParseInt(string(sec), 10, 64)
	ms, err2 := strconv.ParseInt(string(msec), 10, 64)
	if err1 != nil || err2 != nil {
		return r, fmt.Errorf("parse seccomp record: time %q", when)
	}
	r.timeMs = s*1000 + ms
	r.session = noSession
	arch, nr := uint64(0), int64(-1)
	for _, f := range bytes.Fields(rest) {
		k, v, ok := bytes.Cut(f, []byte("="))
		if !ok {
			continue
		}
		switch string(k) {
		case "ses":
			if n, err := strconv.ParseUint(string(v), 10, 32); err == nil {
				r.session = uint32(n)
			}
		case "pid":
			if n, err := strconv.ParseInt(string(v), 10, 32); err == nil {
				r.pid = int32(n)
			}
		case "comm":
			r.comm = untrusted(v)
		case "arch":
			arch, _ = strconv.ParseUint(string(v), 16, 32)
		case "syscall":
			nr, _ = strconv.ParseInt(string(v), 10, 64)
		}
	}
	if nr < 0 {
		return r, fmt.Errorf("parse seccomp record: no syscall")
	}
	r.name = syscallName(uint32(arch), nr)
	return r, nil
}

// untrusted decodes a value the kernel logs with audit_log_untrustedstring:
// quoted, or hex.
func untrusted(v []byte) string {
	if len(v) >= 2 && v[0] == '"' && v[len(v)-1] == '"' {
		return string(v[1 : len(v)-1])
	}
	if b, err := hex.DecodeString(string(v)); err == nil {
		return string(b)
	}
	return string(v)
}

// syscallName names syscall nr of arch: x86_64's refused ones by name,
// anything else as ARCH:NR.
func syscallName(arch uint32, nr int64) string {
	switch arch {
	case auditArchX86_64:
		if nr&x32Bit != 0 {
			return "x32:" + strconv.FormatInt(nr&^x32Bit, 10)
		}
		if n, ok := refused.Name(int(nr)); ok {
			return n
		}
		return "x86_64:" + strconv.FormatInt(nr, 10)
	case auditArchI386:
		return "i386:" + strconv.FormatInt(nr, 10)
	case auditArchAarch64:
		return "aarch64:" + strconv.FormatInt(nr, 10)
	}
	return fmt.Sprintf("arch%x:%d", arch, nr)
}

// syscallBook keeps each tracked sandbox's refusals, found by the audit
// session its processes share.
type syscallBook struct {
	mu         sync.Mutex
	bySession  map[uint32]*refusals
	byID       map[string]*refusals
	lost       int64  // records missed, node-wide
	lastSerial uint64 // the last record's serial, 0 before the first
}

type refusals struct {
	id          string
	session     uint32
	bySyscall   map[string]*dsecv1.ProvenanceSyscall
	samples     []*dsecv1.ProvenanceSyscall
	dropped     int64
	lostAtStart int64
}

func newSyscallBook() *syscallBook {
	return &syscallBook{bySession: map[uint32]*refusals{}, byID: map[string]*refusals{}}
}

// track attributes session's records to sandbox id from now on; a sandbox
// tracked again (an edge's restart re-adopting it) keeps what it had.
func (b *syscallBook) track(id string, session uint32) {
	b.mu.Lock()
	defer b.mu.Unlock()
	r := b.byID[id]
	if r == nil {
		r = &refusals{id: id, bySyscall: map[string]*dsecv1.ProvenanceSyscall{}, lostAtStart: b.lost}
		b.byID[id] = r
	}
	if r.session != session {
		delete(b.bySession, r.session)
	}
	r.session = session
	b.bySession[session] = r
}

// seen counts the records missed before serial (a gap in the kernel's
// serials is records this reader never got), whatever their kind.
func (b *syscallBook) seen(serial uint64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.lastSerial != 0 && serial > b.lastSerial+1 {
		b.lost += int64(serial - b.lastSerial - 1)
	}
	if serial > b.lastSerial {
		b.lastSerial = serial
	}
}

// add counts record rec for its session's sandbox, if any.
func (b *syscallBook) add(rec seccompRecord) {
	b.mu.Lock()
	defer b.mu.Unlock()
	r := b.bySession[rec.session]
	if r == nil {
		return
	}
	s := r.bySyscall[rec.name]
	if s == nil && len(r.bySyscall) < maxSyscallNames {
		s = &dsecv1.ProvenanceSyscall{Name: rec.name, Pid: rec.pid, Command: rec.comm, TimeUnixMs: rec.timeMs}
		r.bySyscall[rec.name] = s
	}
	if s != nil {
		s.Count++
	}
	if len(r.samples) < maxSyscallSamples {
		r.samples = append(r.samples, &dsecv1.ProvenanceSyscall{Name: rec.name, Pid: rec.pid, Command: rec.comm, TimeUnixMs: rec.timeMs, Count: 1})
	} else {
		r.dropped++
	}
}

// denials copies sandbox id's refusals; ok is false when it is not tracked.
func (b *syscallBook) denials(id string) (Denials, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	r := b.byID[id]
	if r == nil {
		return Denials{}, false
	}
	d := Denials{SamplesDropped: r.dropped, Lost: b.lost - r.lostAtStart}
	for _, s := range r.bySyscall {
		d.Syscalls = append(d.Syscalls, cloneSyscall(s))
	}
	sort.Slice(d.Syscalls, func(i, j int) bool { return d.Syscalls[i].Name < d.Syscalls[j].Name })
	for _, s := range r.samples {
		d.Samples = append(d.Samples, cloneSyscall(s))
	}
	return d, true
}

func cloneSyscall(s *dsecv1.ProvenanceSyscall) *dsecv1.ProvenanceSyscall {
	return &dsecv1.ProvenanceSyscall{Name: s.Name, Pid: s.Pid, Command: s.Command, Count: s.Count, TimeUnixMs: s.TimeUnixMs}
}

func (b *syscallBook) forget(id string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if r := b.byID[id]; r != nil {
		delete(b.bySession, r.session)
		delete(b.byID, id)
	}
}
