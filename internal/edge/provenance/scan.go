package provenance

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// MaxListed bounds each evidence list of a scan (files written, replaced,
// tests changed, packages); the totals still count everything.
const MaxListed = 1000

// Changes of a file in the writable layer.
const (
	Created  = "created"
	Modified = "modified"
	Removed  = "removed"
)

// Result is what a scan of a writable layer found.
type Result struct {
	Files        []*dsecv1.ProvenanceFile // capped at MaxListed
	FilesTotal   int64
	Outside      int64 // of FilesTotal, outside the workspace paths (0 when none are set)
	Replaced     []*dsecv1.ProvenanceFile
	TestsChanged []*dsecv1.ProvenanceFile
	Packages     []*dsecv1.ProvenancePackage
}

// ScanOptions are what a scan compares a writable layer with.
type ScanOptions struct {
	// Lower are the sandbox's layer dirs on the host, top first ("" entries
	// skipped).
	Lower []string
	Paths *dsecv1.ProvenancePaths
	// ListFiles fills Result.Files; without it only the counts, evidence
	// and packages are computed.
	ListFiles bool
	// Baseline is the layer as the sandbox started (TakeBaseline): its
	// entries, unchanged, are the platform's and left out. Without one the
	// platform's usual entries (PlatformPaths) are left out whatever they
	// hold.
	Baseline Baseline
}

// Scan walks upper, a writable layer in overlayfs's upper form (whiteouts
// as 0/0 character devices, opaque dirs by xattr), against the sandbox's
// layers: an entry absent below is created, one present modified, a
// whiteout removed. Directories that exist below and are only in upper
// because something under them changed are not listed. Symlinks are never
// followed.
func Scan(upper string, o ScanOptions) (*Result, error) {
	lower, paths, listFiles := o.Lower, o.Paths, o.ListFiles
	res := &Result{}
	var dpkgChanged bool
	err := filepath.WalkDir(upper, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) && p != upper {
				return nil // gone meanwhile: the sandbox runs on
			}
			return err
		}
		if p == upper {
			return nil
		}
		rel := "/" + filepath.ToSlash(strings.TrimPrefix(p, upper+string(filepath.Separator)))
		info, err := d.Info()
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		if o.Baseline != nil && o.Baseline.unchanged(rel, info) {
			return nil
		}
		if o.Baseline == nil && platformPath(rel) {
			return nil
		}
		below := existsBelow(lower, rel)
		change, kind := Modified, kindOf(info.Mode())
		switch {
		case isWhiteout(info):
			change, kind = Removed, "file"
			if below != "" {
				kind = below
			}
		case below == "":
			change = Created
		case d.IsDir():
			// A dir copied up for what changed below it; an opaque one
			// replaced the whole dir, which its entries show.
			return nil
		}
		f := &dsecv1.ProvenanceFile{Path: rel, Change: change, Kind: kind, InWorkspace: under(rel, paths.GetWorkspace())}
		if info.Mode().IsRegular() {
			f.Size = info.Size()
		}
		res.FilesTotal++
		if len(paths.GetWorkspace()) > 0 && !f.InWorkspace {
			res.Outside++
		}
		if listFiles && len(res.Files) < MaxListed {
			res.Files = append(res.Files, f)
		}
		if replacesTool(rel, change, lower) && len(res.Replaced) < MaxListed {
			res.Replaced = append(res.Replaced, f)
		}
		if touchesTests(rel, paths.GetTests()) && len(res.TestsChanged) < MaxListed {
			res.TestsChanged = append(res.TestsChanged, f)
		}
		if rel == "/var/lib/dpkg/status" {
			dpkgChanged = true
		}
		if pkg := pipPackage(rel, change, kind); pkg != nil {
			res.Packages = append(res.Packages, pkg)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("scan writable layer %s: %w", upper, err)
	}
	res.Packages = mergeUpgrades(res.Packages)
	if dpkgChanged {
		pkgs, err := dpkgChanges(filepath.Join(upper, "var/lib/dpkg/status"), lower)
		if err != nil {
			return nil, err
		}
		res.Packages = append(res.Packages, pkgs...)
	}
	if len(res.Packages) > MaxListed {
		res.Packages = res.Packages[:MaxListed]
	}
	return res, nil
}

func kindOf(m fs.FileMode) string {
	switch {
	case m.IsDir():
		return "dir"
	case m.IsRegular():
		return "file"
	case m&fs.ModeSymlink != 0:
		return "symlink"
	}
	return "other"
}

// existsBelow returns the kind of what rel is in the highest lower layer
// holding it, "" if none does (or a layer above whites it out).
func existsBelow(lower []string, rel string) string {
	for _, l := range lower {
		if l == "" {
			continue
		}
		info, err := os.Lstat(filepath.Join(l, filepath.FromSlash(rel)))
		if err != nil {
			continue
		}
		if isWhiteout(info) {
			return ""
		}
		return kindOf(info.Mode())
	}
	return ""
}

// under reports whether rel is one of roots or below one.
func under(rel string, roots []string) bool {
	for _, r := range roots {
		r = path.Clean("/" + r)
		if r == "/" || rel == r || strings.HasPrefix(rel, r+"/") {
			return true
		}
	}
	return false
}

// binDirs hold the commands a PATH lookup finds.
var binDirs = []string{"/bin", "/sbin", "/usr/bin", "/usr/sbin", "/usr/local/bin", "/usr/local/sbin"}

// toolNames are the interpreters, shells and test runners a grader runs:
// one made anywhere on PATH shadows the real one.
var toolNames = regexp.MustCompile(`^(python[0-9.]*|pytest|py\.test|pip[0-9.]*|bash|sh|dash|env|node|nodejs|ruby|perl|go|java|cargo|rustc|make|timeout|coverage)$`)

// pyPrefix is a Python installation's library dir.
var pyPrefix = regexp.MustCompile(`^/usr(/local)?/lib/python3[0-9.]*/`)

// pyEtc is Debian's dir of a Python's site configuration: its
// /usr/lib/python3.X/sitecustomize.py is a link into it, so a write
// through the link lands here.
var pyEtc = regexp.MustCompile(`^/etc/python3[0-9.]*/`)

// replacesTool reports whether a change at rel replaces or shadows a
// platform binary, an interpreter, a test runner or what runs inside them.
func replacesTool(rel, change string, lower []string) bool {
	dir, base := path.Split(rel)
	dir = path.Clean(dir)
	switch {
	case rel == "/etc/ld.so.preload":
		return true
	case strings.HasPrefix(base, "ld-linux") && strings.Contains(dir, "lib"):
		return true
	case pyEtc.MatchString(rel) && (base == "sitecustomize.py" || base == "usercustomize.py"):
		return true // runs in every interpreter
	case slices.Contains(binDirs, dir):
		if change != Created || toolNames.MatchString(base) {
			return true
		}
		// A new command of a name another PATH dir has shadows it.
		for _, b := range binDirs {
			if b != dir && existsBelow(lower, b+"/"+base) != "" {
				return true
			}
		}
		return false
	}
	if m := pyPrefix.FindString(rel); m != "" {
		rest := strings.TrimPrefix(rel, m)
		site := strings.HasPrefix(rest, "site-packages/") || strings.HasPrefix(rest, "dist-packages/")
		switch {
		case base == "sitecustomize.py" || base == "usercustomize.py":
			return true // runs in every interpreter
		case !site:
			return change != Created || strings.HasSuffix(base, ".py") // the standard library
		case change != Created:
			// A test runner's own code changed in place.
			parts := strings.SplitN(strings.SplitN(rest, "/", 2)[1], "/", 2)
			return parts[0] == "_pytest" || parts[0] == "pytest" || parts[0] == "pluggy" || parts[0] == "pytest.py"
		}
	}
	return false
}

// touchesTests reports whether a change at rel changes what a test run
// does: below a test path, or a pytest configuration or conftest.py
// anywhere but an installed package. Byte code caches and pytest's cache
// are what a test run writes, not changes to the tests.
func touchesTests(rel string, tests []string) bool {
	if strings.Contains(rel+"/", "/__pycache__/") || strings.Contains(rel+"/", "/.pytest_cache/") {
		return false // what running the tests writes
	}
	if under(rel, tests) {
		return true
	}
	base := path.Base(rel)
	if base != "conftest.py" && base != "pytest.ini" {
		return false
	}
	return !strings.Contains(rel, "/site-packages/") && !strings.Contains(rel, "/dist-packages/")
}

// distInfo is a pip install's record dir, NAME-VERSION.dist-info (or
// .egg-info) in a site-packages dir.
var distInfo = regexp.MustCompile(`/(site|dist)-packages/([^/]+?)-([^-/]+)\.(dist-info|egg-info)$`)

func pipPackage(rel, change, kind string) *dsecv1.ProvenancePackage {
	m := distInfo.FindStringSubmatch(rel)
	if m == nil || (change != Removed && kind != "dir") {
		return nil
	}
	c := "installed"
	if change == Removed {
		c = "removed"
	} else if change != Created {
		return nil
	}
	return &dsecv1.ProvenancePackage{Manager: "pip", Name: strings.ToLower(strings.ReplaceAll(m[2], "_", "-")), Version: m[3], Change: c}
}

// mergeUpgrades turns a removal and an install of one package into an
// upgrade to the installed version.
func mergeUpgrades(pkgs []*dsecv1.ProvenancePackage) []*dsecv1.ProvenancePackage {
	removed := map[string]bool{}
	for _, p := range pkgs {
		if p.Change == "removed" {
			removed[p.Manager+"/"+p.Name] = true
		}
	}
	var out []*dsecv1.ProvenancePackage
	installed := map[string]bool{}
	for _, p := range pkgs {
		k := p.Manager + "/" + p.Name
		if p.Change == "installed" && removed[k] {
			p.Change = "upgraded"
			installed[k] = true
		}
		out = append(out, p)
	}
	final := out[:0]
	for _, p := range out {
		if p.Change == "removed" && installed[p.Manager+"/"+p.Name] {
			continue
		}
		final = append(final, p)
	}
	return final
}

// dpkgChanges compares dpkg's status in the writable layer with the one
// below: packages installed, upgraded and removed.
func dpkgChanges(upperStatus string, lower []string) ([]*dsecv1.ProvenancePackage, error) {
	now, err := readDpkgStatus(upperStatus)
	if err != nil {
		return nil, err
	}
	before := map[string]string{}
	for _, l := range lower {
		if l == "" {
			continue
		}
		p := filepath.Join(l, "var/lib/dpkg/status")
		if _, err := os.Lstat(p); err != nil {
			continue
		}
		if before, err = readDpkgStatus(p); err != nil {
			return nil, err
		}
		break
	}
	var out []*dsecv1.ProvenancePackage
	for name, v := range now {
		switch old, ok := before[name]; {
		case !ok:
			out = append(out, &dsecv1.ProvenancePackage{Manager: "dpkg", Name: name, Version: v, Change: "installed"})
		case old != v:
			out = append(out, &dsecv1.ProvenancePackage{Manager: "dpkg", Name: name, Version: v, Change: "upgraded"})
		}
	}
	for name, v := range before {
		if _, ok := now[name]; !ok {
			out = append(out, &dsecv1.ProvenancePackage{Manager: "dpkg", Name: name, Version: v, Change: "removed"})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// readDpkgStatus returns the installed packages of a dpkg status file,
// name (with its architecture when it has one other than all) to version.
func readDpkgStatus(p string) (map[string]string, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, fmt.Errorf("read dpkg status: %w", err)
	}
	defer f.Close()
	out := map[string]string{}
	var name, version, status string
	flush := func() {
		if name != "" && strings.HasSuffix(status, " installed") {
			out[name] = version
		}
		name, version, status = "", "", ""
	}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "":
			flush()
		case strings.HasPrefix(line, "Package: "):
			name = strings.TrimPrefix(line, "Package: ")
		case strings.HasPrefix(line, "Version: "):
			version = strings.TrimPrefix(line, "Version: ")
		case strings.HasPrefix(line, "Status: "):
			status = strings.TrimPrefix(line, "Status: ")
		}
	}
	flush()
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read dpkg status %s: %w", p, err)
	}
	return out, nil
}
