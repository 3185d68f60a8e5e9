package claims

import (
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"dsec.dev/dsec/internal/errdefs"
)

func newRegistry(t *testing.T) Registry {
	t.Helper()
	return Registry{Dir: filepath.Join(t.TempDir(), "claims")}
}

func newRoot(t *testing.T) string {
	t.Helper()
	return t.TempDir()
}

func TestDefaultSetsDiffer(t *testing.T) {
	seen := map[string]bool{}
	for i := range maxSets {
		d := Defaults(i)
		if len(d.VethPrefix) != 3 {
			t.Errorf("set %d: veth prefix %q is not 3 characters", i, d.VethPrefix)
		}
		for _, k := range kinds {
			v := k.key + "=" + k.get(d)
			if seen[v] {
				t.Errorf("set %d repeats %s", i, v)
			}
			seen[v] = true
		}
		for j := range i {
			if Defaults(j).Pool.Overlaps(d.Pool) {
				t.Errorf("pools of sets %d and %d overlap", j, i)
			}
		}
	}
}

// TestTwoRootsDoNotCollide: a second root left to the defaults takes the
// next set, whole; each root keeps its own across restarts, whatever the
// other does.
func TestTwoRootsDoNotCollide(t *testing.T) {
	reg := newRegistry(t)
	a, b := newRoot(t), newRoot(t)
	na, err := reg.Claim(a, Names{}, false)
	if err != nil {
		t.Fatal(err)
	}
	if na != Defaults(0) {
		t.Fatalf("first root got %+v, want the first default set", na)
	}
	nb, err := reg.Claim(b, Names{}, false)
	if err != nil {
		t.Fatal(err)
	}
	if nb != Defaults(1) {
		t.Fatalf("second root got %+v, want the second default set", nb)
	}
	// Restarts keep them.
	for _, tc := range []struct {
		root string
		want Names
	}{{a, na}, {b, nb}, {a, na}} {
		got, err := reg.Claim(tc.root, Names{}, false)
		if err != nil {
			t.Fatal(err)
		}
		if got != tc.want {
			t.Fatalf("restart of %s got %+v, want %+v", tc.root, got, tc.want)
		}
	}
	// Once a is torn down, its names are free again for a new root.
	if err := reg.Release(a); err != nil {
		t.Fatal(err)
	}
	if _, ok, _ := Recall(a); ok {
		t.Fatal("a still remembers its names after Release")
	}
	c := newRoot(t)
	if nc, err := reg.Claim(c, Names{}, false); err != nil || nc != Defaults(0) {
		t.Fatalf("a new root after a's teardown got %+v, %v; want the first default set", nc, err)
	}
}

// TestExplicitConflictRefused: a name asked for that another root holds is
// refused, naming that root; a pool that overlaps another's is too.
func TestExplicitConflictRefused(t *testing.T) {
	reg := newRegistry(t)
	a, b := newRoot(t), newRoot(t)
	if _, err := reg.Claim(a, Names{}, false); err != nil {
		t.Fatal(err)
	}
	for _, asked := range []Names{
		{Table: "dsec"},
		{CgroupParent: "dsec"},
		{VethPrefix: "dsv"},
		{LogGroup: 2130},
		{Pool: netip.MustParsePrefix("10.213.7.0/24")},
	} {
		_, err := reg.Claim(b, asked, false)
		if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), a) {
			t.Errorf("claim %+v: %v, want FailedPrecondition naming %s", asked, err, a)
		}
	}
	if _, ok, _ := Recall(b); ok {
		t.Fatal("a refused root remembers names")
	}
	// Explicit names nobody holds are kept, the rest filled.
	got, err := reg.Claim(b, Names{Table: "mine_1", Pool: netip.MustParsePrefix("10.100.0.0/16")}, false)
	if err != nil {
		t.Fatal(err)
	}
	if got.Table != "mine_1" || got.Pool.String() != "10.100.0.0/16" || got.CgroupParent != Defaults(1).CgroupParent {
		t.Fatalf("got %+v", got)
	}
}

// TestRememberedNamesWin: a restart with a flag that differs from what the
// root was started with is refused; the defaults never replace them.
func TestRememberedNamesWin(t *testing.T) {
	reg := newRegistry(t)
	a := newRoot(t)
	first, err := reg.Claim(a, Names{Table: "tbl_a", VethPrefix: "xav"}, false)
	if err != nil {
		t.Fatal(err)
	}
	got, err := reg.Claim(a, Names{}, false)
	if err != nil || got != first {
		t.Fatalf("restart with no flags got %+v, %v; want %+v", got, err, first)
	}
	if _, err := reg.Claim(a, Names{Table: "other"}, false); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "--nft-table tbl_a") {
		t.Fatalf("restart with another table: %v", err)
	}
}

// TestStaleRegistrations: a registration whose root is gone, or no longer
// remembers the name, is taken over.
func TestStaleRegistrations(t *testing.T) {
	reg := newRegistry(t)
	a := filepath.Join(t.TempDir(), "gone")
	if err := os.Mkdir(a, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := reg.Claim(a, Names{}, false); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(a); err != nil {
		t.Fatal(err)
	}
	b := newRoot(t)
	if got, err := reg.Claim(b, Names{}, false); err != nil || got != Defaults(0) {
		t.Fatalf("got %+v, %v; want the first set, a's registration being stale", got, err)
	}
}

// TestLegacyRoot: a root holding sandboxes of a dsecd from before the
// registry keeps the names such a dsecd used, or is refused when another
// root took them meanwhile.
func TestLegacyRoot(t *testing.T) {
	reg := newRegistry(t)
	old := newRoot(t)
	if got, err := reg.Claim(old, Names{Table: "t2"}, true); err != nil || got != fill(Names{Table: "t2"}, Defaults(0)) {
		t.Fatalf("legacy claim got %+v, %v", got, err)
	}
	other := newRoot(t)
	if _, err := reg.Claim(other, Names{}, true); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("a second legacy root on the same names: %v", err)
	}
}

// TestRoutesPassedOver: a default pool that overlaps a host route is passed
// over; a default route is no obstacle.
func TestRoutesPassedOver(t *testing.T) {
	reg := newRegistry(t)
	reg.Routes = func() ([]netip.Prefix, error) {
		return []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0"), netip.MustParsePrefix("10.213.4.0/24")}, nil
	}
	got, err := reg.Claim(newRoot(t), Names{}, false)
	if err != nil {
		t.Fatal(err)
	}
	if got != Defaults(1) {
		t.Fatalf("got %+v, want the second set (the first's pool overlaps a route)", got)
	}
}
