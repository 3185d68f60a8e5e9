// Package backend is the edge's seam to what runs sandboxes: the Runtime
// interface one backend implements, what it can do beyond the lifecycle
// (Features, and the Pauser, Snapshotter and Meter interfaces it may
// implement), the Spec of a sandbox to start, what Status, Usage, Pause and
// Resume report, the Dialer of the agent channel, and the errors contract.
//
// The edge (internal/edge/sandbox) holds one Runtime per backend the node
// offers and routes each sandbox's calls by the backend in its record. A
// runtime receives a sandbox's layers as descriptions (Spec.Layers: each
// layer's EROFS image file on the host, and where the edge mounted it), and
// its network as a namespace the edge made, starts the agent, and returns a
// Dialer for the agent channel; Features says what else it can do (pause,
// snapshots of the writable layer). Each backend uses the part of a layer
// it can: the container backend stacks the mounted directories with
// overlayfs, a VM's attaches the image files as read-only disks.
//
// Each backend lives in a sub-package: container (the container and fncall
// backends, on runc, crun or gVisor's runsc) and microvm (QEMU guests with
// their own kernel). Package backendtest is the conformance suite every
// Runtime runs (the lifecycle, a daemon restart, the limits of a Spec, the
// network contract, pause, capture, metering), with the deviations a
// backend documents as options; package fake is a Runtime that starts
// nothing, for the edge's own tests.
package backend

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"regexp"
	"time"

	"dsec.dev/dsec/internal/edge/snapshot"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/qos"
)

// Runtime runs the sandboxes of one backend on a node. The edge owns a
// sandbox's identity, record, layers and network; the runtime gets the
// layers' descriptions and the network namespace in a Spec, starts
// the agent inside, and says how to reach it.
//
// Lifecycle:
//
//   - Init, once when the daemon starts and before any other call: prepares
//     the node (state dirs, file systems, cgroup parents). It is idempotent
//     and safe while sandboxes of an earlier daemon run.
//   - Start, Channel, Status, Delete and List, per sandbox, from any
//     goroutine, concurrently for different IDs. A runtime finds everything
//     of a sandbox again from its ID on the host, so after a daemon restart
//     a new instance over the same configuration (Init called again) lists,
//     inspects, reaches (Channel), pauses and deletes the sandboxes an
//     earlier instance started; nothing a runtime keeps in memory is needed
//     for that. Its agents live on while no daemon runs.
//   - Teardown, when the node is emptied (dsecd teardown) after every
//     sandbox is deleted: undoes Init. Only Init may follow it.
//
// Errors wrap the kinds of package errdefs: ErrInvalidArgument for a spec
// or an ID the runtime refuses, ErrAlreadyExists for a Start of an ID it
// knows, ErrNotFound for Status or Channel of an ID it does not know,
// ErrNotSupported where the node lacks what the runtime needs.
type Runtime interface {
	// Features says what the runtime can do beyond this interface; it does
	// not change over the runtime's life.
	Features() Features
	Init(ctx context.Context) error
	// Start creates sandbox s.ID and starts its agent, and returns the
	// dialer of its agent channel. It returns once the agent runs, not once
	// it answers: the caller pings through the dialer. On any error
	// everything it made is removed again.
	Start(ctx context.Context, s Spec) (Dialer, error)
	// Channel returns the dialer of the agent channel of a sandbox this
	// instance or an earlier one started (a re-adopted sandbox), or
	// ErrNotFound.
	Channel(id string) (Dialer, error)
	// Status reports whether sandbox id runs. A sandbox whose agent died,
	// or that Start left half made, is known but not running; ErrNotFound
	// means nothing of it is left.
	Status(ctx context.Context, id string) (Status, error)
	// Delete stops sandbox id and removes everything the runtime made for
	// it. It is idempotent: an unknown, half-made, frozen or dead sandbox
	// is fine, and so is one an earlier instance started. Once it returns
	// nil, Status says ErrNotFound, List omits id and the agent channel
	// refuses connections. It goes on after ctx is cancelled.
	Delete(ctx context.Context, id string) error
	// List returns the IDs of every sandbox the runtime knows, running or
	// not: those Delete has yet to remove.
	List(ctx context.Context) ([]string, error)
	Teardown(ctx context.Context) error
}

// Features is what a runtime can do beyond the lifecycle. The edge asks
// instead of assuming: a call a backend cannot serve is refused naming it.
type Features struct {
	// Pause: the runtime is a Pauser. Its sandboxes can be frozen (every
	// process stopped, memory kept or pushed out) and thawed, and a frozen
	// one stays frozen across a daemon restart.
	Pause bool
	// Snapshot: the runtime is a Snapshotter, whose sandboxes' writable
	// layer a snapshot captures while the sandbox is frozen (so Pause too).
	Snapshot bool
	// Network: Start joins Spec.NetnsPath and binds Spec.ResolvConf at
	// /etc/resolv.conf, so the edge's network rules reach the sandbox; a
	// NetnsPath that is no network namespace fails the Start. A sandbox
	// started without a NetnsPath has loopback and no other interface.
	// Without Network a sandbox has loopback only, the edge refuses creates
	// with network rules, and Start refuses a spec naming a NetnsPath or a
	// ResolvConf with errdefs.ErrNotSupported (never less network than
	// asked for).
	Network bool
	// Accelerator names what runs the sandboxes' kernel, for the node's
	// status: kvm or tcg for a microVM, gVisor's platform (systrap,
	// ptrace, kvm); "" for containers on the host's kernel.
	Accelerator string
}

// Pauser freezes and thaws sandboxes: a Runtime whose Features say Pause.
type Pauser interface {
	// Pause freezes sandbox id and, with reclaim, pushes its memory out of
	// RAM. A failure to reclaim leaves it frozen (and says so); a failure
	// to freeze leaves it running.
	Pause(ctx context.Context, id string, reclaim bool) (PauseStats, error)
	// Resume prefetches a paused sandbox's memory (with prefetch) and thaws
	// it.
	Resume(ctx context.Context, id string, prefetch bool) (ResumeStats, error)
	// Frozen reports whether sandbox id is frozen.
	Frozen(ctx context.Context, id string) (bool, error)
	// Freeze and Thaw stop and restart sandbox id's processes, memory
	// untouched (a snapshot's capture).
	Freeze(ctx context.Context, id string) error
	Thaw(ctx context.Context, id string) error
}

// Snapshotter captures sandboxes' writable layers: a Runtime whose Features
// say Snapshot.
type Snapshotter interface {
	// Capture copies sandbox id's writable layer into a capture of its own
	// named name and returns it: a directory on the host in the form of an
	// overlayfs upper dir (whiteouts as overlayfs writes them), which
	// package snapshot packs into a layer. Where the capture lives and how
	// it is made are the runtime's: a container's upper dir is snapshotted
	// or cloned on its own file system, a VM's writable disk would be
	// cloned and the upper dir in it mounted. The caller keeps the sandbox
	// frozen (Pauser.Freeze) while Capture runs and removes the capture
	// (Tree.Remove) once it is packed; Init removes the captures an earlier
	// instance left. name is a valid ID (ValidID), different for captures
	// of one sandbox under way at once: one in use is ErrAlreadyExists. An
	// unknown sandbox is ErrNotFound.
	Capture(ctx context.Context, id, name string) (*snapshot.Tree, error)
}

// Forker starts sandboxes as copies of a running one's memory: a Runtime
// whose sandboxes' whole state can be saved once and restored many times
// (microVMs). The edge calls SaveFork on the parent (frozen for the
// save's moment only, running on afterwards), StartFork once per child,
// then DropFork, which removes the save; Init removes saves an earlier
// instance left.
type Forker interface {
	// SaveFork saves running sandbox id's memory, devices and writable
	// disk as save name (a valid ID, unique among saves under way; one in
	// use is ErrAlreadyExists) and returns how long id stood still.
	SaveFork(ctx context.Context, id, name string) (time.Duration, error)
	// StartFork starts sandbox s.ID from save name, with copies of the
	// save's memory and writable disk of its own, s's network and limits
	// (s is the parent's spec with the child's ID, host name and
	// namespace), and gives it its own identity (host name, machine-id,
	// fresh entropy, MAC and address: its agent's Reidentify) before it
	// returns. s.Layers must be the parent's. On any error everything it
	// made is removed again.
	StartFork(ctx context.Context, name string, s Spec) (Dialer, error)
	// DropFork removes save name; an unknown one is no error.
	DropFork(ctx context.Context, name string) error
}

// Meter reads sandboxes' resource use: a Runtime that can say what its
// sandboxes use implements it (the edge asks by type; Metrics of another
// backend's sandbox is refused naming it).
type Meter interface {
	// Usage reads sandbox id's resource use now.
	Usage(ctx context.Context, id string) (Usage, error)
}

// Usage is a sandbox's resource use at one moment. A limit of 0 means the
// sandbox has none of its own.
type Usage struct {
	CPUUsec     int64 // CPU time used since it started
	MemoryBytes int64 // its cgroup's memory, page cache included
	MemoryLimit int64
	CacheBytes  int64 // of MemoryBytes, page cache
	DiskBytes   int64 // its writable layer
	DiskLimit   int64
	// DiskSize is the size of the file system holding the writable layer:
	// what bounds a layer without a limit of its own.
	DiskSize int64
}

// Dialer opens a new connection to a sandbox's agent: the agent channel
// (a Unix socket for containers; vsock or virtio-serial for VMs). Package
// agentclient speaks the agent's protocol over the connections it opens.
type Dialer func(ctx context.Context) (net.Conn, error)

// UnixDialer dials the Unix socket at path.
func UnixDialer(path string) Dialer {
	return func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}
}

// Spec describes one sandbox to start.
type Spec struct {
	ID          string
	Layers      []Layer // read-only layers, bottom first
	DiskBytes   int64   // hard limit of the writable layer; 0 = none
	Inodes      int64   // inode limit of the writable layer; 0 = DiskBytes/16KiB, at least 16384
	CPUs        float64 // fractional cores; 0 = unlimited
	MemoryBytes int64   // 0 = unlimited; no swap either way
	Pids        int64   // 0 = 4096
	// TmpBytes caps the tmpfs at /tmp of a backend that gives one
	// (fncall); its pages count against MemoryBytes. 0 = half of
	// MemoryBytes, or 256 MiB without a memory limit.
	TmpBytes int64
	Hostname string
	// AllowPrivilegeEscalation lifts no_new_privs from the sandbox's
	// processes, so setuid programs (sudo) work inside it.
	AllowPrivilegeEscalation bool
	// QoS is the sandbox's CPU class: a best_effort sandbox's cpu cgroup
	// is made idle (SCHED_IDLE); "" is latency.
	QoS qos.Class
	// Agent configures the agent the runtime starts in the sandbox.
	Agent   Agent
	LogPath string // host file for the agent's stdout and stderr
	// NetnsPath joins a network namespace the edge made (a networked
	// sandbox); "" gives the sandbox a new one with loopback only.
	NetnsPath string
	// ResolvConf is a host file bind-mounted read-only at /etc/resolv.conf.
	ResolvConf string
}

// Layer describes one read-only layer of a sandbox's root. The edge fills
// in what the node has of it; a runtime uses what it needs and refuses a
// layer lacking that part with ErrInvalidArgument.
type Layer struct {
	Digest string // sha256:…
	// File is the layer's EROFS image on the host, readable: the layer
	// store's own file, the whole file pulled from the blob store, or the
	// lazy file system's file served on demand. "" where the node has none
	// (a layer extracted from a tar).
	File string
	// FSType is the file system of File, or of Dir where there is no file:
	// FSTypeEROFS, or FSTypeDir for a plain extracted tree.
	FSType string
	Size   int64 // File's size in bytes
	// Dir is where the edge mounted the layer on the host; "" if it is not
	// mounted.
	Dir string
}

// The file system types of a Layer.
const (
	FSTypeEROFS = "erofs"
	FSTypeDir   = "dir"
)

// check refuses a layer description no runtime can use.
func (l Layer) check() error {
	switch {
	case l.FSType != FSTypeEROFS && l.FSType != FSTypeDir:
		return fmt.Errorf("layer %q: unknown file system type %q", l.Digest, l.FSType)
	case l.File == "" && l.Dir == "":
		return fmt.Errorf("layer %q: neither a file nor a mounted dir", l.Digest)
	case l.FSType == FSTypeDir && l.Dir == "":
		return fmt.Errorf("layer %q: a plain tree without its dir", l.Digest)
	case l.File != "" && !filepath.IsAbs(l.File):
		return fmt.Errorf("layer %q: file %q is not absolute", l.Digest, l.File)
	case l.Dir != "" && !filepath.IsAbs(l.Dir):
		return fmt.Errorf("layer %q: dir %q is not absolute", l.Digest, l.Dir)
	case l.Size < 0:
		return fmt.Errorf("layer %q: negative size", l.Digest)
	}
	return nil
}

// Agent is the configuration of a sandbox's agent. Each runtime delivers
// it its own way: the container backend as flags of the agent's serve
// command, to which it adds those of the agent channel and the cgroup fds;
// a VM's runtime over its boot or its channel. Zero values leave the
// agent's defaults.
type Agent struct {
	User     string            // who commands run as, by default (name or uid[:gid])
	Workdir  string            // where commands start, by default
	Hostname string            // the host name the agent writes to /etc/hostname and /etc/hosts
	Address  string            // the sandbox's own IP address, for /etc/hosts
	Env      map[string]string // every command's environment, beside the image's
	// OutputLimit is the output the agent keeps per command and stream
	// for a later attach.
	OutputLimit int64
}

var idPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$`)

// ValidID reports whether id can name a sandbox to a runtime: letters,
// digits and _ . -, at most 128, starting with a letter or digit.
func ValidID(id string) bool { return idPattern.MatchString(id) }

// Validate refuses a spec no runtime can start, with ErrInvalidArgument.
func (s Spec) Validate() error {
	bad := func(why string) error {
		return fmt.Errorf("check sandbox spec %q: %s: %w", s.ID, why, errdefs.ErrInvalidArgument)
	}
	switch {
	case !ValidID(s.ID):
		return bad("bad id")
	case len(s.Layers) == 0:
		return bad("no layer")
	case s.LogPath == "":
		return bad("no log path")
	case s.DiskBytes < 0 || s.Inodes < 0 || s.CPUs < 0 || s.MemoryBytes < 0 || s.Pids < 0 || s.TmpBytes < 0:
		return bad("negative limit")
	case len(s.Hostname) > 64:
		return bad("hostname longer than 64 bytes")
	}
	for _, l := range s.Layers {
		if err := l.check(); err != nil {
			return bad(err.Error())
		}
	}
	return nil
}

// Status is what Status reports of a sandbox.
type Status struct {
	Running bool
	// Pid is the host pid of the agent while Running, or of what holds the
	// sandbox where the agent is no host process (a microVM's QEMU); 0
	// for a microVM paused to disk, which has no process.
	Pid         int
	OOMKills    int64
	MemoryBytes int64
	// Reason says why a sandbox that is not running stopped, where the
	// runtime can tell (a VM's QEMU that exited or was killed, a guest
	// kernel that panicked), with what it printed last; "" otherwise.
	Reason string
	// Accel is how a VM's CPUs run, "kvm" or "tcg"; "" for a sandbox that
	// is not a VM.
	Accel string
}

// PauseStats is what Pause did.
type PauseStats struct {
	Frozen  time.Duration // from the call to every process frozen
	Reclaim time.Duration // pushing memory out of RAM, after the freeze
	// Resident and Released are the sandbox's memory in RAM before the
	// pause and what left RAM; Swapped is what of it went to swap (the
	// rest was page cache, dropped).
	Resident, Released, Swapped int64
	// Kept is what stayed in RAM (Resident - Released), by kind, and
	// KeptReason why, in words, where the node can tell ("" when nothing
	// worth a word stayed).
	Kept       KeptMemory
	KeptReason string
}

// KeptMemory is what of a paused sandbox's memory stayed in RAM, by kind,
// in bytes.
type KeptMemory struct {
	Anon  int64 // its processes' private anonymous memory
	Shmem int64 // shared memory: files in tmpfs (/dev/shm, a tmpfs /tmp), System V segments, shared mappings
	Cache int64 // page cache of files on disk
	// Kernel is kernel memory charged to the sandbox (page tables, kernel
	// objects), which never leaves RAM.
	Kernel int64
}

// Total is all of k.
func (k KeptMemory) Total() int64 { return k.Anon + k.Shmem + k.Cache + k.Kernel }

// ResumeStats is what Resume did.
type ResumeStats struct {
	Prefetch time.Duration // reading swapped memory back, while still frozen
	Thaw     time.Duration
	// Advised is the bytes of anonymous and shared memory mappings the
	// kernel was asked to bring back; AdvisedTmpfs the bytes of files in
	// the sandbox's tmpfs mounts (/dev/shm, a tmpfs /tmp).
	Advised, AdvisedTmpfs int64
}

// Inspector lets the edge look at a running sandbox from the host, for
// its provenance: a Runtime whose sandboxes' writable layer, root file
// system and processes the host can see implements it (the container
// backend; the edge asks by type and falls back to a Snapshotter's
// capture for the writable layer).
type Inspector interface {
	// Upper returns the host dir holding sandbox id's writable layer in
	// overlayfs's upper form, live: it changes while the sandbox runs.
	Upper(id string) (string, error)
	// Root returns a host path at which sandbox id's root file system is
	// seen as its processes see it (the same inodes), and the host pid of
	// its agent; ErrNotSupported where the host cannot see it so.
	Root(ctx context.Context, id string) (root string, agentPid int, err error)
	// Processes lists the processes running in sandbox id other than its
	// agent.
	Processes(ctx context.Context, id string) ([]Process, error)
}

// SyscallAuditor is a runtime whose sandboxes' refused syscalls reach the
// node's audit records, each sandbox's under an audit session of its own
// (the container backend under runc or crun).
type SyscallAuditor interface {
	// AuditSession returns the audit session of sandbox id's processes;
	// ErrNotSupported when its refusals are not logged.
	AuditSession(ctx context.Context, id string) (uint32, error)
}

// Process is a process running in a sandbox.
type Process struct {
	Pid     int // in the sandbox's pid namespace where known, else the host's
	Command string
}
