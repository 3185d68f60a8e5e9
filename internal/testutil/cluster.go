package testutil

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	dsec "dsec.dev/dsec/sdk/go"
)

// Proc is a dsecd role a test started, stopped when the test ends.
type Proc struct {
	Name  string
	Addr  string // host:port it serves on
	Token string // an apiserver's: a token of its metadata store
	Root  string // an edge's state directory
	// DebugAddr serves an apiserver's or an edge's Go profiles
	// (/debug/pprof/), with ClusterOptions.Profiles.
	DebugAddr string
	cmd       *exec.Cmd
	args      []string // dsecd's flags, for a restart
	log       string
	t         testing.TB
}

// Pid is the process's ID.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// Stop freezes the process (SIGSTOP), as a hung machine would; Cont thaws it.
func (p *Proc) Stop() { p.cmd.Process.Signal(syscall.SIGSTOP) }
func (p *Proc) Cont() { p.cmd.Process.Signal(syscall.SIGCONT) }

// Kill ends the process with SIGKILL.
func (p *Proc) Kill() {
	if p.cmd.ProcessState != nil {
		return
	}
	p.cmd.Process.Signal(syscall.SIGCONT)
	p.cmd.Process.Kill()
	p.cmd.Wait()
}

// Log is what the process has written so far.
func (p *Proc) Log() string {
	b, _ := os.ReadFile(p.log)
	return string(b)
}

// Cluster is a cluster on one machine: apiservers and edges as processes
// of their own, with their own certificates from a throwaway CA.
type Cluster struct {
	Dir        string
	Bin        string
	BlobStore  string // the directory blob store real edges share
	APIServers []*Proc
	Edges      []*Proc
	t          testing.TB
}

// ClusterOptions shape StartCluster's cluster.
type ClusterOptions struct {
	APIServers int
	Edges      int
	// EdgeArgs are extra flags of every edge, e.g. --runtime fake.
	EdgeArgs []string
	// APIServerArgs are extra flags of every apiserver.
	APIServerArgs []string
	// DB is the apiservers' metadata store; "" = one SQLite file each.
	DB string
	// Registry makes the edges register in DB (a PostgreSQL DSN, which
	// Registry requires), and the apiservers find them there.
	Registry bool
	// RealEdges makes each edge a node with real runc sandboxes (root),
	// with its own root, address pool, nftables table, veth prefix, NFLOG
	// group and cgroup, and one blob store directory for all; each is torn
	// down when the test ends.
	RealEdges bool
	// Profiles makes each apiserver and edge serve Go's profiles on a
	// loopback address of its own (Proc.DebugAddr), for a benchmark to
	// read.
	Profiles bool
}

// nodeFlags are what makes real edge i a node of its own on this host;
// dsecd teardown takes the same ones.
func nodeFlags(root string, i int, blobs string) []string {
	return []string{"--root", root, "--network-pool", fmt.Sprintf("10.%d.0.0/16", 230+i), "--nft-table", fmt.Sprintf("dsect_e%d", i),
		"--veth-prefix", fmt.Sprintf("t%dv", i), "--nflog-group", fmt.Sprint(2150 + i), "--cgroup-parent", fmt.Sprintf("dsec-te%d", i),
		"--blob-store", blobs}
}

// StartCluster starts a cluster and waits until every apiserver answers
// and routes to every edge.
func StartCluster(t testing.TB, o ClusterOptions) *Cluster {
	t.Helper()
	if o.Registry && o.DB == "" {
		t.Fatal("StartCluster: Registry needs DB, a PostgreSQL DSN")
	}
	bin := Binaries(t)
	dir := t.TempDir()
	c := &Cluster{Dir: dir, Bin: bin, t: t}
	var apis, edges []string
	for i := range o.APIServers {
		apis = append(apis, fmt.Sprintf("api%d", i+1))
	}
	for i := range o.Edges {
		edges = append(edges, fmt.Sprintf("e%d", i+1))
	}
	initPKI(t, bin, filepath.Join(dir, "pki"), apis, edges)
	var edgeFlags []string
	if o.RealEdges {
		RequireRoot(t)
		RequireCommand(t, "runc")
		RequireCommand(t, "mkfs.erofs")
	}
	// Real edges' roots carry the prefix the root suite's leak check looks for.
	rootsDir := dir
	if o.RealEdges {
		var err error
		if rootsDir, err = os.MkdirTemp("", "dsec-test-root-cluster-"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(rootsDir) })
	}
	blobs := filepath.Join(rootsDir, "blobstore")
	c.BlobStore = blobs
	addrs := freeAddrs(t, o.Edges+o.APIServers) // distinct: picked together
	var debugAddrs []string
	if o.Profiles {
		debugAddrs = freeAddrs(t, o.Edges+o.APIServers) // the edges', then the apiservers'
	}
	debug := func(i int) []string {
		if debugAddrs == nil {
			return nil
		}
		return []string{"--debug-listen", debugAddrs[i]}
	}
	for i := range o.Edges {
		name := fmt.Sprintf("e%d", i+1)
		addr := addrs[i]
		root := filepath.Join(rootsDir, name)
		args := []string{"edge", "--node", name, "--listen", addr, "--tls-dir", filepath.Join(dir, "pki"), "--root", root}
		if o.RealEdges {
			flags := nodeFlags(root, i+1, blobs)
			args = append([]string{"edge", "--node", name, "--listen", addr, "--tls-dir", filepath.Join(dir, "pki")}, flags...)
			// Registered before the edge starts, so it runs after the
			// edge is killed (cleanups run last first).
			t.Cleanup(func() {
				out, err := exec.Command(filepath.Join(bin, "dsecd"), append([]string{"teardown", "--node", name}, flags...)...).CombinedOutput()
				if err != nil {
					t.Errorf("dsecd teardown of edge %s: %v\n%s", name, err, out)
				}
			})
		}
		if o.Registry {
			args = append(args, "--registry", o.DB)
		} else {
			edgeFlags = append(edgeFlags, "--edge", name+"=https://"+addr)
		}
		p := c.start(name, append(append(args, debug(i)...), o.EdgeArgs...), addr)
		p.Root = root
		if debugAddrs != nil {
			p.DebugAddr = debugAddrs[i]
		}
		c.Edges = append(c.Edges, p)
	}
	for i := range o.APIServers {
		name := fmt.Sprintf("api%d", i+1)
		addr := addrs[o.Edges+i]
		db := o.DB
		if db == "" {
			db = filepath.Join(dir, name+".db")
		}
		args := append([]string{"apiserver", "--name", name, "--listen", addr, "--tls-dir", filepath.Join(dir, "pki"),
			"--db", db, "--replicas", fmt.Sprint(o.APIServers)}, edgeFlags...)
		token := mintToken(t, bin, db)
		p := c.start(name, append(append(args, debug(o.Edges+i)...), o.APIServerArgs...), addr)
		p.Token = token
		if debugAddrs != nil {
			p.DebugAddr = debugAddrs[o.Edges+i]
		}
		c.APIServers = append(c.APIServers, p)
	}
	for _, a := range c.APIServers {
		c.waitRoutable(a, o.Edges)
	}
	return c
}

func (c *Cluster) start(name string, args []string, addr string) *Proc {
	c.t.Helper()
	logPath := filepath.Join(c.Dir, name+".log")
	logf, err := os.Create(logPath)
	if err != nil {
		c.t.Fatal(err)
	}
	defer logf.Close()
	cmd := exec.Command(filepath.Join(c.Bin, "dsecd"), append(args, "--log-level", "debug")...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		c.t.Fatal(err)
	}
	p := &Proc{Name: name, Addr: addr, cmd: cmd, args: args, log: logPath, t: c.t}
	c.t.Cleanup(func() {
		p.Kill()
		if c.t.Failed() {
			c.t.Logf("%s log (last 3 KiB):\n%s", name, tail([]byte(p.Log()), 3072))
		}
	})
	return p
}

// RestartAPIServer kills apiserver i (if it runs) and starts it again with
// the same flags, and waits until it routes to every edge.
func (c *Cluster) RestartAPIServer(i int) {
	c.t.Helper()
	old := c.APIServers[i]
	old.Kill()
	p := c.start(old.Name, old.args, old.Addr)
	p.Token, p.DebugAddr = old.Token, old.DebugAddr
	c.APIServers[i] = p
	c.waitRoutable(p, len(c.Edges))
}

// waitRoutable waits until apiserver a listens and routes to every edge
// (a List fans out to routable edges only, so it cannot tell; the
// apiserver logs each edge it can route to, which it may do before it
// listens, and then that it is ready).
func (c *Cluster) waitRoutable(a *Proc, edges int) {
	c.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		log := a.Log()
		if strings.Count(log, `msg="node routable"`) >= edges && strings.Contains(log, `msg="apiserver ready"`) {
			return
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("apiserver %s did not route to its %d edges in 30 s:\n%s", a.Name, edges, tail([]byte(a.Log()), 3072))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Client returns API clients of apiserver i.
func (c *Cluster) Client(i int) *dsec.Conn {
	c.t.Helper()
	cl, err := dsec.Dial(c.APIServers[i].Addr, dsec.DialOptions{Token: c.APIServers[i].Token})
	if err != nil {
		c.t.Fatal(err)
	}
	return cl
}

// ClientAll returns API clients of every apiserver, failing over between
// them as the CLI and SDKs do.
func (c *Cluster) ClientAll() *dsec.Conn {
	c.t.Helper()
	var addrs []string
	for _, a := range c.APIServers {
		addrs = append(addrs, a.Addr)
	}
	cl, err := dsec.Dial(strings.Join(addrs, ","), dsec.DialOptions{Token: c.APIServers[0].Token})
	if err != nil {
		c.t.Fatal(err)
	}
	return cl
}

// Create makes n sandboxes of spec through apiserver i.
func (c *Cluster) Create(i int, spec *dsecv1.SandboxSpec, n int) ([]*dsecv1.Sandbox, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	resp, err := c.Client(i).Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: spec, Count: int32(n)}))
	if err != nil {
		return nil, err
	}
	return resp.Msg.GetSandboxes(), nil
}

// initPKI makes a cluster CA in dir and the certificates of the named
// apiservers and edges (served on 127.0.0.1), with dsecd init-cluster.
func initPKI(t testing.TB, bin, dir string, apiservers, edges []string) {
	t.Helper()
	args := []string{"init-cluster", "--dir", dir}
	for _, a := range apiservers {
		args = append(args, "--apiserver", a)
	}
	for _, e := range edges {
		args = append(args, "--edge", e+"=127.0.0.1")
	}
	if out, err := exec.Command(filepath.Join(bin, "dsecd"), args...).CombinedOutput(); err != nil {
		t.Fatalf("dsecd init-cluster: %v\n%s", err, out)
	}
}

// mintToken mints a token in the metadata store db, with dsecd token.
func mintToken(t testing.TB, bin, db string) string {
	t.Helper()
	out, err := exec.Command(filepath.Join(bin, "dsecd"), "token", "--db", db, "--principal", "test").Output()
	if err != nil {
		t.Fatalf("dsecd token: %v", err)
	}
	return strings.TrimSpace(string(out))
}
