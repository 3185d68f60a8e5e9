package clustertls

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"dsec.dev/dsec/internal/errdefs"
)

// snapshot is every file of dir with its contents.
func snapshot(t *testing.T, dir string) map[string]string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, e := range entries {
		data, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		out[e.Name()] = string(data)
	}
	return out
}

func names(m map[string]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func TestInitCluster(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pki")
	edges := []EdgeSpec{{Name: "node-1", Hosts: []string{"127.0.0.1", "node-1.internal"}}, {Name: "node-2", Hosts: []string{"::1"}}}
	if err := InitCluster(dir, []string{"api-1", "api-2"}, edges); err != nil {
		t.Fatal(err)
	}
	first := snapshot(t, dir)
	want := []string{
		"apiserver-api-1.crt", "apiserver-api-1.key", "apiserver-api-2.crt", "apiserver-api-2.key",
		"ca.crt", "ca.key",
		"edge-node-1.crt", "edge-node-1.key", "edge-node-2.crt", "edge-node-2.key",
	}
	if diff := cmp.Diff(want, names(first)); diff != "" {
		t.Fatalf("layout (-want +got):\n%s", diff)
	}
	if got := mode(t, dir); got != 0o700 {
		t.Errorf("directory mode %v, want 0700", got)
	}
	for _, n := range want {
		wantMode := os.FileMode(0o644)
		if strings.HasSuffix(n, ".key") {
			wantMode = 0o600
		}
		if got := mode(t, filepath.Join(dir, n)); got != wantMode {
			t.Errorf("%s has mode %v, want %v", n, got, wantMode)
		}
	}
	ca, err := LoadCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Until(ca.Certificate().NotAfter); d < 9*365*24*time.Hour {
		t.Errorf("the CA is valid for only %v", d)
	}
	for _, c := range []struct {
		role  Role
		name  string
		hosts []string
	}{
		{RoleAPIServer, "api-1", nil},
		{RoleAPIServer, "api-2", nil},
		{RoleEdge, "node-1", []string{"127.0.0.1", "node-1.internal"}},
		{RoleEdge, "node-2", []string{"::1"}},
	} {
		files := ComponentFiles(dir, c.role, c.name)
		if err := checkIssued(ca, files, Identity{Role: c.role, Name: c.name}, c.hosts); err != nil {
			t.Errorf("%s %s: %v", c.role, c.name, err)
		}
	}

	// The same call again changes nothing.
	if err := InitCluster(dir, []string{"api-1", "api-2"}, edges); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(first, snapshot(t, dir)); diff != "" {
		t.Errorf("second run changed files (-before +after):\n%s", diff)
	}

	// A node more: only its files are new.
	if err := InitCluster(dir, []string{"api-1"}, append(edges, EdgeSpec{Name: "node-3", Hosts: []string{"10.0.0.3"}})); err != nil {
		t.Fatal(err)
	}
	third := snapshot(t, dir)
	for n, data := range first {
		if third[n] != data {
			t.Errorf("adding node-3 changed %s", n)
		}
	}
	if added := len(third) - len(first); added != 2 || third["edge-node-3.crt"] == "" || third["edge-node-3.key"] == "" {
		t.Errorf("adding node-3 added %d files: %v", added, names(third))
	}
}

// TestInitClusterHandshake runs the files InitCluster makes, where the
// daemons will find them.
func TestInitClusterHandshake(t *testing.T) {
	dir := t.TempDir()
	if err := InitCluster(dir, []string{"api-1"}, []EdgeSpec{{Name: "node-1", Hosts: []string{"127.0.0.1"}}}); err != nil {
		t.Fatal(err)
	}
	srv := serverConfig(t, ComponentFiles(dir, RoleEdge, "node-1"), RoleAPIServer)
	cli := clientConfig(t, ComponentFiles(dir, RoleAPIServer, "api-1"), RoleEdge, "node-1")
	res := handshake(t, srv, cli)
	if res.serverErr != nil || res.clientErr != nil {
		t.Fatalf("handshake: server: %v; client: %v", res.serverErr, res.clientErr)
	}
	if res.peerOfServer.String() != "apiserver api-1" || res.peerOfClient.String() != "edge node-1" {
		t.Errorf("peers %v and %v", res.peerOfServer, res.peerOfClient)
	}
}

func TestInitClusterRefusals(t *testing.T) {
	other := testCA(t, "other CA")
	foreign := issue(t, other, RoleEdge, "node-1", "10.0.0.1")
	one := []EdgeSpec{{Name: "node-1", Hosts: []string{"10.0.0.1"}}}
	tests := []struct {
		name       string
		before     func(t *testing.T, dir string) // on a directory InitCluster made for api-1 and node-1
		apiservers []string
		edges      []EdgeSpec
		want       string
		kind       error
	}{
		{
			name: "duplicate apiserver", apiservers: []string{"api-1", "api-1"},
			want: "apiserver api-1 is named twice", kind: errdefs.ErrInvalidArgument,
		},
		{
			name: "duplicate edge", edges: []EdgeSpec{{Name: "n"}, {Name: "n"}},
			want: "edge n is named twice", kind: errdefs.ErrInvalidArgument,
		},
		{
			name: "bad name", edges: []EdgeSpec{{Name: "node 1"}},
			want: `check component name "node 1"`, kind: errdefs.ErrInvalidArgument,
		},
		{
			name: "bad host", edges: []EdgeSpec{{Name: "n", Hosts: []string{"a b"}}},
			want: `check host "a b"`, kind: errdefs.ErrInvalidArgument,
		},
		{
			name:   "hosts changed",
			before: func(t *testing.T, dir string) {},
			edges:  []EdgeSpec{{Name: "node-1", Hosts: []string{"10.0.0.1", "10.0.0.2"}}},
			want:   "is for hosts [10.0.0.1], not [10.0.0.1 10.0.0.2]", kind: errdefs.ErrAlreadyExists,
		},
		{
			name: "key gone",
			before: func(t *testing.T, dir string) {
				if err := os.Remove(filepath.Join(dir, "edge-node-1.key")); err != nil {
					t.Fatal(err)
				}
			},
			edges: one, want: "only one of", kind: errdefs.ErrFailedPrecondition,
		},
		{
			name: "from another CA",
			before: func(t *testing.T, dir string) {
				if err := WriteCert(dir, "edge-node-1", foreign.cert, foreign.key); err != nil {
					t.Fatal(err)
				}
			},
			edges: one, want: "was not issued by the CA", kind: errdefs.ErrFailedPrecondition,
		},
		{
			name: "CA key gone",
			before: func(t *testing.T, dir string) {
				if err := os.Remove(filepath.Join(dir, "ca.key")); err != nil {
					t.Fatal(err)
				}
			},
			edges: one, want: "ca.key", kind: errdefs.ErrNotFound,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "pki")
			if tt.before != nil {
				if err := InitCluster(dir, []string{"api-1"}, one); err != nil {
					t.Fatal(err)
				}
				tt.before(t, dir)
			}
			err := InitCluster(dir, tt.apiservers, tt.edges)
			if err == nil || !strings.Contains(err.Error(), tt.want) || !errors.Is(err, tt.kind) {
				t.Fatalf("InitCluster: %v, want %v containing %q", err, tt.kind, tt.want)
			}
			if _, err := os.Stat(dir); tt.before == nil && err == nil {
				t.Error("a refused InitCluster wrote files")
			}
		})
	}
}
