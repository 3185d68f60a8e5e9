// Package cluster tests dsec's control plane as a cluster on one machine:
// apiservers and edges as processes of their own, mutual TLS between them.
// These run on hollow edges (dsecd edge --runtime fake), which need no
// root; the end-to-end suites with real sandboxes run against a cluster in
// test/root.
package cluster

import (
	"context"
	"crypto/tls"
	"errors"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	"dsec.dev/dsec/api/gen/dsec/edge/v1/edgev1connect"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/clustertls"
	"dsec.dev/dsec/internal/sandboxid"
	"dsec.dev/dsec/internal/testutil"
)

var hollow = []string{"--runtime", "fake", "--hollow-max-sandboxes", "400"}

// TestCreatesSpreadOverEdges: a batch of 300 over 3 edges gives no edge
// more than 1.5× its share, through either apiserver.
func TestCreatesSpreadOverEdges(t *testing.T) {
	c := testutil.StartCluster(t, testutil.ClusterOptions{APIServers: 2, Edges: 3, EdgeArgs: hollow})
	for i := range c.APIServers {
		sbs, err := c.Create(i, &dsecv1.SandboxSpec{Environment: "base:1"}, 300)
		if err != nil {
			t.Fatal(err)
		}
		per := map[string]int{}
		for _, sb := range sbs {
			node, err := sandboxid.Node(sb.GetId())
			if err != nil || node != sb.GetNode() {
				t.Fatalf("sandbox %s on %s: %v", sb.GetId(), sb.GetNode(), err)
			}
			per[node]++
		}
		for _, e := range c.Edges {
			if per[e.Name] > 150 {
				t.Errorf("through %s, edge %s got %d of 300 (share 100)", c.APIServers[i].Name, e.Name, per[e.Name])
			}
		}
		t.Logf("through %s: %v", c.APIServers[i].Name, per)
	}
	// Any apiserver routes any sandbox.
	sbs, err := c.Create(0, &dsecv1.SandboxSpec{Environment: "base:1"}, 5)
	if err != nil {
		t.Fatal(err)
	}
	for _, sb := range sbs {
		got, err := c.Client(1).Sandboxes.Get(context.Background(), connect.NewRequest(&dsecv1.GetRequest{Id: sb.GetId()}))
		if err != nil || got.Msg.GetId() != sb.GetId() {
			t.Errorf("get %s through the other apiserver: %v", sb.GetId(), err)
		}
	}
}

// TestStoppedEdge: an edge frozen with SIGSTOP is unroutable within 3 s;
// its sandboxes' calls then fail at once with Unavailable naming it, and
// creates go to the other edges; once thawed, it serves again.
func TestStoppedEdge(t *testing.T) {
	c := testutil.StartCluster(t, testutil.ClusterOptions{APIServers: 1, Edges: 2, EdgeArgs: hollow})
	sbs, err := c.Create(0, &dsecv1.SandboxSpec{Environment: "base:1"}, 20)
	if err != nil {
		t.Fatal(err)
	}
	var onE1 string
	for _, sb := range sbs {
		if sb.GetNode() == "e1" {
			onE1 = sb.GetId()
		}
	}
	if onE1 == "" {
		t.Fatal("no sandbox landed on e1")
	}
	cl := c.Client(0)
	// A call already sent to the frozen edge waits for its deadline; one
	// made once the edge is unroutable fails at once.
	getWithin := func(d time.Duration) error {
		ctx, cancel := context.WithTimeout(context.Background(), d)
		defer cancel()
		_, err := cl.Sandboxes.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: onE1}))
		return err
	}
	get := func() error { return getWithin(100 * time.Millisecond) }
	c.Edges[0].Stop()
	stopped := time.Now()
	defer c.Edges[0].Cont()
	for {
		err := get()
		if connect.CodeOf(err) == connect.CodeUnavailable && strings.Contains(err.Error(), "unreachable") {
			if !strings.Contains(err.Error(), "node e1 is unreachable") {
				t.Errorf("unavailable, but says %v", err)
			}
			break
		}
		if time.Since(stopped) > 6*time.Second {
			t.Fatalf("a frozen edge's sandbox still answered %v after 6 s", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("unroutable after %s", time.Since(stopped).Round(10*time.Millisecond))
	// Unavailable, not DeadlineExceeded: the call is not sent to the
	// frozen edge, where it would wait out its deadline.
	if err := getWithin(10 * time.Second); connect.CodeOf(err) != connect.CodeUnavailable {
		t.Errorf("a call for a sandbox on an unroutable edge: %v, want Unavailable before its deadline", err)
	}
	more, err := c.Create(0, &dsecv1.SandboxSpec{Environment: "base:1"}, 10)
	if err != nil {
		t.Fatalf("creates with one edge frozen: %v", err)
	}
	for _, sb := range more {
		if sb.GetNode() != "e2" {
			t.Errorf("sandbox %s placed on the frozen edge", sb.GetId())
		}
	}
	c.Edges[0].Cont()
	deadline := time.Now().Add(10 * time.Second)
	for get() != nil {
		if time.Now().After(deadline) {
			t.Fatal("the thawed edge did not serve again within 10 s")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestEdgeAcceptsOnlyApiservers: an edge refuses a client without a
// certificate, one of another CA, and another edge's.
func TestEdgeAcceptsOnlyApiservers(t *testing.T) {
	c := testutil.StartCluster(t, testutil.ClusterOptions{APIServers: 1, Edges: 2, EdgeArgs: hollow})
	other := filepath.Join(t.TempDir(), "pki")
	if out, err := exec.Command(filepath.Join(c.Bin, "dsecd"), "init-cluster", "--dir", other, "--apiserver", "api1").CombinedOutput(); err != nil {
		t.Fatalf("init another cluster: %v\n%s", err, out)
	}
	pki := filepath.Join(c.Dir, "pki")
	status := func(tc *tls.Config) error {
		tr := &http.Transport{TLSClientConfig: tc, ForceAttemptHTTP2: true}
		defer tr.CloseIdleConnections()
		cl := edgev1connect.NewEdgeServiceClient(&http.Client{Transport: tr}, "https://"+c.Edges[0].Addr)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := cl.Status(ctx, connect.NewRequest(&edgev1.StatusRequest{}))
		return err
	}
	good, err := clustertls.ClientConfig(clustertls.ComponentFiles(pki, clustertls.RoleAPIServer, "api1"), clustertls.RoleEdge, "e1")
	if err != nil {
		t.Fatal(err)
	}
	if err := status(good); err != nil {
		t.Fatalf("the cluster's apiserver: %v", err)
	}
	// The other CA's apiserver cert, checking the edge against our CA so
	// that only the edge's verdict counts.
	foreign, err := clustertls.ClientConfig(clustertls.Files{
		Cert: filepath.Join(other, "apiserver-api1.crt"), Key: filepath.Join(other, "apiserver-api1.key"),
		CABundle: filepath.Join(pki, "ca.crt")}, clustertls.RoleEdge, "e1")
	if err != nil {
		t.Fatal(err)
	}
	asEdge, err := clustertls.ClientConfig(clustertls.ComponentFiles(pki, clustertls.RoleEdge, "e2"), clustertls.RoleEdge, "e1")
	if err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]*tls.Config{
		"no certificate": {InsecureSkipVerify: true},
		"another CA":     foreign,
		"another edge's": asEdge,
	} {
		if err := status(tc); err == nil {
			t.Errorf("%s: the edge answered", name)
		}
	}
	// The edge says why in its log.
	if log := c.Edges[0].Log(); !strings.Contains(log, "TLS handshake error") {
		t.Logf("edge log:\n%s", log)
	}
	var ce *connect.Error
	if err := status(foreign); !errors.As(err, &ce) && err == nil {
		t.Error("no error")
	}
}

// TestRegistry: edges register in PostgreSQL and apiservers find them
// there; IDs carry each edge's slot and generation; an edge claiming a
// live node's name with another certificate is refused and says so.
func TestRegistry(t *testing.T) {
	pg := testutil.StartPostgres(t)
	c := testutil.StartCluster(t, testutil.ClusterOptions{APIServers: 2, Edges: 2, EdgeArgs: hollow, DB: pg, Registry: true})
	sbs, err := c.Create(1, &dsecv1.SandboxSpec{Environment: "base:1"}, 20)
	if err != nil {
		t.Fatal(err)
	}
	slots := map[string]uint16{}
	for _, sb := range sbs {
		id, err := sandboxid.Parse(sb.GetId())
		if err != nil || id.Slot == 0 || id.Generation == 0 {
			t.Fatalf("ID %s: %+v, %v; want a slot and generation", sb.GetId(), id, err)
		}
		if s, ok := slots[id.Node]; ok && s != id.Slot {
			t.Errorf("node %s minted slots %d and %d", id.Node, s, id.Slot)
		}
		slots[id.Node] = id.Slot
		if _, err := c.Client(0).Sandboxes.Get(context.Background(), connect.NewRequest(&dsecv1.GetRequest{Id: sb.GetId()})); err != nil {
			t.Errorf("get %s through the other apiserver: %v", sb.GetId(), err)
		}
	}
	if len(slots) != 2 || slots["e1"] == slots["e2"] {
		t.Errorf("slots %v, want two distinct", slots)
	}
	// An ID of the same node name at another generation is not routed.
	stale := sandboxid.New("e1", slots["e1"], 99)
	if _, err := c.Client(0).Sandboxes.Get(context.Background(), connect.NewRequest(&dsecv1.GetRequest{Id: stale})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("get of an ID from another generation of e1's slot: %v", err)
	}

	// Another machine claims e1's name with a certificate of its own.
	pki := filepath.Join(c.Dir, "pki")
	ca, err := clustertls.LoadCA(pki)
	if err != nil {
		t.Fatal(err)
	}
	crt, key, err := ca.Issue(clustertls.RoleEdge, "e1", []string{"127.0.0.1"}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	impostor := t.TempDir()
	if err := clustertls.WriteCert(impostor, "edge-e1", crt, key); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(filepath.Join(c.Bin, "dsecd"), "edge", "--node", "e1", "--runtime", "fake", "--listen", "127.0.0.1:0",
		"--registry", pg, "--tls-cert", filepath.Join(impostor, "edge-e1.crt"), "--tls-key", filepath.Join(impostor, "edge-e1.key"),
		"--tls-ca", filepath.Join(pki, "ca.crt"))
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "e1") || !strings.Contains(string(out), "already exists") {
		t.Errorf("an edge claiming a live node's name: %v\n%s", err, out)
	}
}
