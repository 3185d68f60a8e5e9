// Package claims holds the host-wide names a node's sandboxes use (its
// nftables table, host veth prefix, NFLOG group, address pool and cgroup
// parent) and keeps two dsecd roots on one host from sharing any of them.
//
// A root remembers the names it was first started with, in
// <root>/host-names.json, so every later start and `dsecd teardown` of that
// root use those, whatever defaults or flags they are given; a flag that
// asks for another name is refused. Every root's names are also registered
// in a host-wide directory (DefaultDir, a file per name holding the root
// that uses it), so a new root never takes a name another root holds: left
// to the defaults it takes the first default set that is wholly free (the
// first is dsec, dsv, 2130, 10.213.0.0/16, dsec), and a name asked for
// explicitly that another root holds refuses the start, naming that root.
// A registration whose root no longer remembers the name (it was torn down,
// or removed) is stale and taken over. Release, at teardown, forgets both.
package claims

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
)

// DefaultDir is the host-wide registry. It is on a tmpfs, as the kernel
// objects the names stand for are: both are gone after a reboot, while each
// root still remembers its own names.
const DefaultDir = "/run/dsec/claims"

// File is where a root remembers its names.
const File = "host-names.json"

// Names are the host-wide names of one node. A zero field is one left to
// the defaults.
type Names struct {
	Table        string       `json:"nftTable"`
	VethPrefix   string       `json:"vethPrefix"`
	LogGroup     uint16       `json:"nflogGroup"`
	Pool         netip.Prefix `json:"networkPool"`
	CgroupParent string       `json:"cgroupParent"`
}

// maxSets is how many default sets there are: the pools of the sets after
// the first are 10.214.0.0/16 … 10.255.0.0/16.
const maxSets = 43

// Defaults is the i-th default set of names (0 ≤ i < 43): the first is
// what dsecd has always used, the others differ in every name.
func Defaults(i int) Names {
	if i == 0 {
		return Names{Table: "dsec", VethPrefix: "dsv", LogGroup: 2130, Pool: netip.MustParsePrefix("10.213.0.0/16"), CgroupParent: "dsec"}
	}
	return Names{
		Table:        fmt.Sprintf("dsec%d", i),
		VethPrefix:   fmt.Sprintf("d%02d", i),
		LogGroup:     uint16(2130 + i),
		Pool:         netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(213 + i), 0, 0}), 16),
		CgroupParent: fmt.Sprintf("dsec%d", i),
	}
}

// Registry is the host-wide record of which root holds which name.
type Registry struct {
	// Dir is the registry's directory; "" is DefaultDir.
	Dir string
	// Routes lists the host's IPv4 routes; a default set whose pool
	// overlaps one (other than a default route) is passed over. Nil skips
	// the check.
	Routes func() ([]netip.Prefix, error)
}

// kind is one sort of name.
type kind struct {
	key  string // the registry file's prefix, and the flag that sets it
	get  func(Names) string
	zero func(Names) bool
}

var kinds = []kind{
	{"nft-table", func(n Names) string { return n.Table }, func(n Names) bool { return n.Table == "" }},
	{"veth-prefix", func(n Names) string { return n.VethPrefix }, func(n Names) bool { return n.VethPrefix == "" }},
	{"nflog-group", func(n Names) string { return strconv.Itoa(int(n.LogGroup)) }, func(n Names) bool { return n.LogGroup == 0 }},
	{"network-pool", func(n Names) string { return n.Pool.String() }, func(n Names) bool { return !n.Pool.IsValid() }},
	{"cgroup-parent", func(n Names) string { return n.CgroupParent }, func(n Names) bool { return n.CgroupParent == "" }},
}

// fill returns asked with its zero fields taken from def.
func fill(asked, def Names) Names {
	if asked.Table == "" {
		asked.Table = def.Table
	}
	if asked.VethPrefix == "" {
		asked.VethPrefix = def.VethPrefix
	}
	if asked.LogGroup == 0 {
		asked.LogGroup = def.LogGroup
	}
	if !asked.Pool.IsValid() {
		asked.Pool = def.Pool
	}
	if asked.CgroupParent == "" {
		asked.CgroupParent = def.CgroupParent
	}
	asked.Pool = asked.Pool.Masked()
	return asked
}

// Claim returns the names root uses and registers them as root's. A root
// that remembers names gets those (a non-zero field of asked that differs
// is refused); legacy says the root holds sandboxes of a dsecd older than
// this registry, which used asked filled with the first default set; any
// other root takes asked filled with the first default set whose names no
// other root holds. A name another root holds is refused with
// FailedPrecondition naming that root.
func (r Registry) Claim(root string, asked Names, legacy bool) (Names, error) {
	unlock, err := r.lock()
	if err != nil {
		return Names{}, err
	}
	defer unlock()
	held, err := r.held(root)
	if err != nil {
		return Names{}, err
	}
	names, remembered, err := Recall(root)
	if err != nil {
		return Names{}, err
	}
	switch {
	case remembered:
		for _, k := range kinds {
			if !k.zero(asked) && k.get(asked) != k.get(names) {
				return Names{}, fmt.Errorf("root %s was started with --%s %s, not %s: start it with the same, or run dsecd teardown --root %s first: %w",
					root, k.key, k.get(names), k.get(asked), root, errdefs.ErrFailedPrecondition)
			}
		}
	case legacy:
		names = fill(asked, Defaults(0))
	default:
		names, err = r.pick(asked, held)
		if err != nil {
			return Names{}, err
		}
	}
	if err := conflict(names, held); err != nil {
		return Names{}, err
	}
	if !remembered {
		if err := writeJSON(filepath.Join(root, File), names); err != nil {
			return Names{}, fmt.Errorf("remember the host names of root %s: %w", root, err)
		}
	}
	for _, k := range kinds {
		if err := os.WriteFile(filepath.Join(r.dir(), entryName(k.key, k.get(names))), []byte(root+"\n"), 0o644); err != nil {
			return Names{}, fmt.Errorf("register %s %s for root %s: %w", k.key, k.get(names), root, err)
		}
	}
	return names, nil
}

// pick fills asked from the first default set none of whose names another
// root holds (nor, for its pool, a host route), and refuses at once a name
// asked for explicitly that another root holds.
func (r Registry) pick(asked Names, held []entry) (Names, error) {
	explicit := fill(asked, Names{})
	for _, k := range kinds {
		if k.zero(asked) {
			continue
		}
		if e, ok := holder(k.key, k.get(explicit), explicit.Pool, held); ok {
			return Names{}, e.refusal(k.key, k.get(explicit))
		}
	}
	var routes []netip.Prefix
	if r.Routes != nil && !asked.Pool.IsValid() {
		var err error
		if routes, err = r.Routes(); err != nil {
			return Names{}, fmt.Errorf("list the host's routes to pick a sandbox address pool: %w", err)
		}
	}
	for i := range maxSets {
		cand := fill(asked, Defaults(i))
		if conflict(cand, held) != nil {
			continue
		}
		if slices.ContainsFunc(routes, func(p netip.Prefix) bool { return p.Bits() > 0 && p.Overlaps(cand.Pool) }) {
			continue
		}
		return cand, nil
	}
	return Names{}, fmt.Errorf("every one of the %d default sets of host names (nftables table, veth prefix, NFLOG group, address pool, cgroup parent) is held by another dsecd root or overlaps a host route: pass --nft-table, --veth-prefix, --nflog-group, --network-pool and --cgroup-parent: %w",
		maxSets, errdefs.ErrResourceExhausted)
}

// conflict refuses names of which another root holds one.
func conflict(names Names, held []entry) error {
	for _, k := range kinds {
		if e, ok := holder(k.key, k.get(names), names.Pool, held); ok {
			return e.refusal(k.key, k.get(names))
		}
	}
	return nil
}

// holder finds the entry of another root that holds value of key: the
// same name, or for pools an overlapping one.
func holder(key, value string, pool netip.Prefix, held []entry) (entry, bool) {
	for _, e := range held {
		if e.key != key {
			continue
		}
		if e.value == value {
			return e, true
		}
		if key == "network-pool" {
			if p, err := netip.ParsePrefix(e.value); err == nil && p.Overlaps(pool) {
				return e, true
			}
		}
	}
	return entry{}, false
}

// Release forgets root's names: its registrations and its own record. Call
// it once every kernel object under them is gone (dsecd teardown).
func (r Registry) Release(root string) error {
	unlock, err := r.lock()
	if err != nil {
		return err
	}
	defer unlock()
	names, ok, err := Recall(root)
	if err != nil || !ok {
		return err
	}
	for _, k := range kinds {
		p := filepath.Join(r.dir(), entryName(k.key, k.get(names)))
		if owner, err := os.ReadFile(p); err == nil && strings.TrimSpace(string(owner)) == root {
			if err := os.Remove(p); err != nil {
				return fmt.Errorf("release %s %s of root %s: %w", k.key, k.get(names), root, err)
			}
		}
	}
	if err := os.Remove(filepath.Join(root, File)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("forget the host names of root %s: %w", root, err)
	}
	return nil
}

// Recall reads the names root remembers; ok is false when it remembers
// none.
func Recall(root string) (names Names, ok bool, err error) {
	b, err := os.ReadFile(filepath.Join(root, File))
	if errors.Is(err, fs.ErrNotExist) {
		return Names{}, false, nil
	}
	if err != nil {
		return Names{}, false, fmt.Errorf("read the host names of root %s: %w", root, err)
	}
	if err := json.Unmarshal(b, &names); err != nil {
		return Names{}, false, fmt.Errorf("read the host names of root %s: %s: %w", root, err, errdefs.ErrInvalidArgument)
	}
	for _, k := range kinds {
		if k.zero(names) {
			return Names{}, false, fmt.Errorf("read the host names of root %s: no %s: %w", root, k.key, errdefs.ErrInvalidArgument)
		}
	}
	return names, true, nil
}

// entry is one registration: a name and the root holding it.
type entry struct{ key, value, root string }

func (e entry) refusal(key, value string) error {
	what := value
	if e.value != value {
		what = value + " (it overlaps " + e.value + ")"
	}
	return fmt.Errorf("%s %s is used by the dsecd of root %s: pass another --%s, or run dsecd teardown --root %s: %w",
		strings.ReplaceAll(key, "-", " "), what, e.root, key, e.root, errdefs.ErrFailedPrecondition)
}

// entryName is the registry file of a name: the key, then the value
// escaped (a prefix's slash, say).
func entryName(key, value string) string {
	return key + "=" + url.QueryEscape(value)
}

// held lists the live registrations of roots other than self, removing
// stale ones: those whose root no longer remembers the name.
func (r Registry) held(self string) ([]entry, error) {
	des, err := os.ReadDir(r.dir())
	if err != nil {
		return nil, fmt.Errorf("read the host names registry: %w", err)
	}
	var out []entry
	for _, de := range des {
		key, value, ok := strings.Cut(de.Name(), "=")
		if !ok {
			continue
		}
		value, err = url.QueryUnescape(value)
		if err != nil {
			continue
		}
		p := filepath.Join(r.dir(), de.Name())
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		owner := strings.TrimSpace(string(b))
		if owner == self {
			continue
		}
		if !remembers(owner, key, value) {
			os.Remove(p)
			continue
		}
		out = append(out, entry{key: key, value: value, root: owner})
	}
	return out, nil
}

// remembers says whether root's own record still holds value of key.
func remembers(root, key, value string) bool {
	names, ok, err := Recall(root)
	if err != nil {
		// A record that cannot be read may still stand for live sandboxes.
		return true
	}
	if !ok {
		return false
	}
	for _, k := range kinds {
		if k.key == key {
			return k.get(names) == value
		}
	}
	return false
}

func (r Registry) dir() string {
	if r.Dir == "" {
		return DefaultDir
	}
	return r.Dir
}

// lock takes the registry's lock, so that two roots starting at once
// claim one after the other.
func (r Registry) lock() (unlock func(), err error) {
	if err := os.MkdirAll(r.dir(), 0o755); err != nil {
		return nil, fmt.Errorf("make the host names registry: %w", err)
	}
	f, err := os.OpenFile(filepath.Join(r.dir(), ".lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open the host names registry's lock: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("lock the host names registry: %w", err)
	}
	return func() { f.Close() }, nil
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, append(b, '\n'), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
