package testutil

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// Postgres is a throwaway PostgreSQL cluster a test started: its own data
// directory, reachable only on a private Unix socket directory (no TCP
// listener). Commits are durable (fsync and synchronous_commit stay on);
// only initdb skips its syncs. It is stopped and its directory removed when
// the test ends, whether it passed or not.
type Postgres struct {
	// DSN is a libpq keyword string for the database "dsec".
	DSN string
	// SocketDir is the directory holding the server's socket.
	SocketDir string
	bin       string // the directory of initdb, pg_ctl, createdb
	data      string
	log       string
	dbs       atomic.Int64
	t         testing.TB // the test that started it
	settings  []string   // NAME=VALUE server settings beyond the defaults
}

// StartPostgres starts a throwaway PostgreSQL cluster with an empty
// database and returns its DSN. It needs root (the server runs as the
// postgres user) and PostgreSQL installed: it skips without them, or fails
// under DSEC_TEST_ROOT=1.
func StartPostgres(t testing.TB) string {
	t.Helper()
	return StartPostgresServer(t).DSN
}

// StartPostgresServer is StartPostgres returning the cluster's handle, for
// tests that restart the server or need more databases. Settings are
// server settings (NAME=VALUE, as postgres -c takes them) beyond the
// defaults.
func StartPostgresServer(t testing.TB, settings ...string) *Postgres {
	t.Helper()
	RequireRoot(t)
	bin := postgresBinDir()
	Require(t, bin != "", "PostgreSQL is not installed (no initdb in /usr/lib/postgresql/*/bin or on PATH)")
	RequireCommand(t, "runuser")
	u, err := user.Lookup("postgres")
	Require(t, err == nil, "there is no postgres user (the PostgreSQL server package makes it)")
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)

	// Not t.TempDir: a socket path must stay under 108 bytes, and a long
	// test name would push it past.
	dir, err := os.MkdirTemp("", "dsec-pg-")
	if err != nil {
		t.Fatal(err)
	}
	p := &Postgres{
		SocketDir: filepath.Join(dir, "sock"),
		bin:       bin,
		data:      filepath.Join(dir, "data"),
		log:       filepath.Join(dir, "postgres.log"),
		t:         t,
		settings:  settings,
	}
	t.Cleanup(func() {
		// A server is running (or was left half started) while its
		// data directory holds postmaster.pid.
		if fileExists(filepath.Join(p.data, "postmaster.pid")) {
			p.Thaw() // a benchmark that failed frozen
			p.stop()
		}
		if t.Failed() {
			if log, err := os.ReadFile(p.log); err == nil {
				t.Logf("postgres log (last 4 KiB):\n%s", tail(log, 4096))
			}
		}
		os.RemoveAll(dir)
	})
	for _, d := range []string{dir, p.SocketDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(d, uid, gid); err != nil {
			t.Fatal(err)
		}
	}
	p.run(t, "initdb", "-D", p.data, "-A", "trust", "--no-sync", "-U", "postgres", "-E", "UTF8", "--locale=C")
	p.run(t, "pg_ctl", "-D", p.data, "-l", p.log, "-o", p.serverOptions(), "-w", "-t", "60", "start")
	p.run(t, "createdb", "-h", p.SocketDir, "-U", "postgres", "dsec")
	p.DSN = p.dsn("dsec")
	return p
}

// NewDatabase creates another empty database in the cluster and returns its
// DSN.
func (p *Postgres) NewDatabase(t testing.TB) string {
	t.Helper()
	name := fmt.Sprintf("dsec_%d", p.dbs.Add(1))
	p.run(t, "createdb", "-h", p.SocketDir, "-U", "postgres", name)
	return p.dsn(name)
}

// Restart stops the server (fast: open sessions are cut) and starts it
// again on the same data and socket; it returns once it accepts
// connections.
func (p *Postgres) Restart(t testing.TB) {
	t.Helper()
	p.run(t, "pg_ctl", "-D", p.data, "-l", p.log, "-o", p.serverOptions(), "-m", "fast", "-w", "-t", "60", "restart")
}

// Stop stops the server (fast) before the test ends, to see what its
// clients do without it. The cleanup still removes its directory.
func (p *Postgres) Stop(t testing.TB) {
	t.Helper()
	p.run(t, "pg_ctl", "-D", p.data, "-m", "fast", "-w", "-t", "60", "stop")
}

func (p *Postgres) dsn(db string) string {
	return fmt.Sprintf("host=%s dbname=%s user=postgres sslmode=disable", p.SocketDir, db)
}

func (p *Postgres) serverOptions() string {
	o := fmt.Sprintf("-k %s -c listen_addresses=''", p.SocketDir)
	for _, s := range p.settings {
		o += " -c " + s
	}
	return o
}

// run runs one of the cluster's programs as the postgres user.
func (p *Postgres) run(t testing.TB, prog string, args ...string) {
	t.Helper()
	if out, err := p.command(prog, args...); err != nil {
		t.Fatalf("%s %s: %v\n%s", prog, strings.Join(args, " "), err, out)
	}
}

func (p *Postgres) command(prog string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "runuser", append([]string{"-u", "postgres", "--", filepath.Join(p.bin, prog)}, args...)...)
	cmd.Dir = "/"
	return cmd.CombinedOutput()
}

// ServerPID is the postmaster's process ID (0 when it is not running): its
// children are the server's sessions and background workers.
func (p *Postgres) ServerPID() int {
	b, err := os.ReadFile(filepath.Join(p.data, "postmaster.pid"))
	if err != nil {
		return 0
	}
	first, _, _ := strings.Cut(string(b), "\n")
	pid, _ := strconv.Atoi(strings.TrimSpace(first))
	return pid
}

// stop stops the server; if pg_ctl cannot, it kills the postmaster it
// started, by the PID in its data directory.
func (p *Postgres) stop() {
	out, err := p.command("pg_ctl", "-D", p.data, "-m", "fast", "-w", "-t", "60", "stop")
	if err == nil {
		return
	}
	p.t.Errorf("pg_ctl stop: %v\n%s", err, out)
	b, rerr := os.ReadFile(filepath.Join(p.data, "postmaster.pid"))
	if rerr != nil {
		return
	}
	first, _, _ := strings.Cut(string(b), "\n")
	if pid, err := strconv.Atoi(strings.TrimSpace(first)); err == nil && pid > 1 {
		if proc, err := os.FindProcess(pid); err == nil {
			proc.Kill()
		}
	}
}

// postgresBinDir finds the directory holding initdb: the newest
// /usr/lib/postgresql/N/bin (Debian puts it off PATH), else PATH.
func postgresBinDir() string {
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	slices.SortFunc(dirs, func(a, b string) int {
		va, _ := strconv.Atoi(filepath.Base(filepath.Dir(a)))
		vb, _ := strconv.Atoi(filepath.Base(filepath.Dir(b)))
		return vb - va
	})
	for _, d := range dirs {
		if fileExists(filepath.Join(d, "initdb")) {
			return d
		}
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		return filepath.Dir(p)
	}
	return ""
}

// CPU is the CPU time the server's processes used so far: the
// postmaster's own and its ended sessions', and each living session's
// (USER_HZ ticks: 10 ms), for benchmarks that say what the server spent.
func (p *Postgres) CPU() time.Duration {
	pid := p.ServerPID()
	if pid <= 0 {
		return 0
	}
	d := ProcCPU(pid, true)
	for _, child := range children(pid) {
		d += ProcCPU(child, false)
	}
	return d
}

// Freeze stops the whole server (SIGSTOP), its postmaster and every
// process it started, and Thaw lets it run again (SIGCONT): a
// benchmark's way to keep a server's background work (checkpoints,
// autovacuum, the WAL writer) within the turns its clients are measured
// in. A server still frozen when its test ends is thawed to be stopped.
func (p *Postgres) Freeze() { p.signalAll(syscall.SIGSTOP) }

// Thaw lets a server Freeze stopped run again.
func (p *Postgres) Thaw() { p.signalAll(syscall.SIGCONT) }

// signalAll sends sig to the postmaster and its children: the postmaster
// first when stopping (it starts no child while stopped), last when
// continuing.
func (p *Postgres) signalAll(sig syscall.Signal) {
	pid := p.ServerPID()
	if pid <= 0 {
		return
	}
	if sig == syscall.SIGSTOP {
		syscall.Kill(pid, sig)
	}
	for _, child := range children(pid) {
		syscall.Kill(child, sig)
	}
	if sig != syscall.SIGSTOP {
		syscall.Kill(pid, sig)
	}
}

// children lists the processes whose parent is pid.
func children(pid int) []int {
	var out []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		child, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ppid, _ := procStat(child); ppid == pid {
			out = append(out, child)
		}
	}
	return out
}

// procStat returns the fields of /proc/PID/stat after the command, from
// the state (field 3) on, and the parent's pid.
func procStat(pid int) (ppid int, fields []string) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, nil
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0, nil
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 15 {
		return 0, nil
	}
	ppid, _ = strconv.Atoi(f[1])
	return ppid, f
}

// ProcCPU is the user and system CPU time process pid used (all its
// threads: utime and stime), with its reaped children's (cutime and
// cstime) when children is set; 0 when it is gone. Benchmarks read it to
// say what each process spent.
func ProcCPU(pid int, children bool) time.Duration {
	_, f := procStat(pid)
	if f == nil {
		return 0
	}
	n := 2
	if children {
		n = 4
	}
	var ticks int64
	for _, s := range f[11 : 11+n] {
		v, _ := strconv.ParseInt(s, 10, 64)
		ticks += v
	}
	return time.Duration(ticks) * time.Second / 100 // USER_HZ
}
