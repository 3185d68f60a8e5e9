package clustertls

import (
	"crypto/tls"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"dsec.dev/dsec/internal/errdefs"
)

// Validities InitCluster issues with.
const (
	clusterCAValidity   = 10 * 365 * 24 * time.Hour
	clusterLeafValidity = 365 * 24 * time.Hour
)

// EdgeSpec names an edge and the DNS names and IP addresses apiservers reach it
// at, which go into its certificate's SANs.
type EdgeSpec struct {
	Name  string
	Hosts []string
}

// ComponentFiles is where InitCluster puts the files of the component name of
// role: dir/ROLE-NAME.crt, dir/ROLE-NAME.key and the bundle dir/ca.crt.
func ComponentFiles(dir string, role Role, name string) Files {
	base := filepath.Join(dir, string(role)+"-"+name)
	return Files{Cert: base + ".crt", Key: base + ".key", CABundle: filepath.Join(dir, caCertFile)}
}

// InitCluster makes the certificates of a cluster in dir, as
// `dsecd init-cluster` does: a CA (dir/ca.crt, dir/ca.key, valid ten years)
// unless dir already holds one, and for every apiserver and edge named a leaf
// from that CA (dir/apiserver-NAME.{crt,key}, dir/edge-NAME.{crt,key}, valid
// one year). Apiserver certificates carry no hosts; an edge's carries its
// Hosts.
//
// It is idempotent: a component whose files exist is left alone, so running
// it again with a node added issues only the new node's certificate. An
// existing certificate that does not match what is asked (another CA, other
// hosts) is an error, never silently replaced; to reissue one, move its two
// files aside and run InitCluster again. Names and hosts are checked before
// anything is written.
func InitCluster(dir string, apiservers []string, edges []EdgeSpec) error {
	type component struct {
		role  Role
		name  string
		hosts []string
	}
	var comps []component
	for _, n := range apiservers {
		comps = append(comps, component{role: RoleAPIServer, name: n})
	}
	for _, e := range edges {
		comps = append(comps, component{role: RoleEdge, name: e.Name, hosts: e.Hosts})
	}
	seen := map[Identity]bool{}
	for _, c := range comps {
		if err := checkName(c.name); err != nil {
			return fmt.Errorf("init cluster: %s: %w", c.role, err)
		}
		id := Identity{Role: c.role, Name: c.name}
		if seen[id] {
			return fmt.Errorf("init cluster: %s is named twice: %w", id, errdefs.ErrInvalidArgument)
		}
		seen[id] = true
		if _, _, err := splitHosts(c.hosts); err != nil {
			return fmt.Errorf("init cluster: %s: %w", id, err)
		}
	}

	ca, err := initOrLoadCA(dir)
	if err != nil {
		return fmt.Errorf("init cluster: %w", err)
	}
	for _, c := range comps {
		files := ComponentFiles(dir, c.role, c.name)
		id := Identity{Role: c.role, Name: c.name}
		haveCert, err := exists(files.Cert)
		if err != nil {
			return fmt.Errorf("init cluster: %s: %w", id, err)
		}
		haveKey, err := exists(files.Key)
		if err != nil {
			return fmt.Errorf("init cluster: %s: %w", id, err)
		}
		switch {
		case haveCert && haveKey:
			if err := checkIssued(ca, files, id, c.hosts); err != nil {
				return fmt.Errorf("init cluster: %w", err)
			}
			continue
		case haveCert || haveKey:
			return fmt.Errorf("init cluster: %s: only one of %s and %s exists; remove it to issue a new pair: %w",
				id, files.Cert, files.Key, errdefs.ErrFailedPrecondition)
		}
		certPEM, keyPEM, err := ca.Issue(c.role, c.name, c.hosts, clusterLeafValidity)
		if err != nil {
			return fmt.Errorf("init cluster: %w", err)
		}
		if err := WriteCert(dir, string(c.role)+"-"+c.name, certPEM, keyPEM); err != nil {
			return fmt.Errorf("init cluster: %w", err)
		}
	}
	return nil
}

// initOrLoadCA loads dir's CA, making one first if dir has neither file.
func initOrLoadCA(dir string) (*CA, error) {
	haveCert, err := exists(filepath.Join(dir, caCertFile))
	if err != nil {
		return nil, err
	}
	haveKey, err := exists(filepath.Join(dir, caKeyFile))
	if err != nil {
		return nil, err
	}
	if !haveCert && !haveKey {
		name := "dsec cluster CA " + time.Now().UTC().Format("2006-01-02T15:04:05Z")
		if err := InitCA(dir, name, clusterCAValidity); err != nil {
			return nil, err
		}
	}
	return LoadCA(dir)
}

// checkIssued checks that the existing pair in files is id's, from ca, for
// hosts.
func checkIssued(ca *CA, files Files, id Identity, hosts []string) error {
	pair, err := tls.LoadX509KeyPair(files.Cert, files.Key)
	if err != nil {
		return fmt.Errorf("check existing certificate of %s: %v: %w", id, err, errdefs.ErrFailedPrecondition)
	}
	leaf := pair.Leaf
	got, err := ParseIdentity(leaf)
	if err != nil || got.Role != id.Role || got.Name != id.Name {
		return fmt.Errorf("check existing certificate of %s: %s is not %s's certificate: %w", id, files.Cert, id, errdefs.ErrFailedPrecondition)
	}
	if err := leaf.CheckSignatureFrom(ca.cert); err != nil {
		return fmt.Errorf("check existing certificate of %s: %s was not issued by the CA %q in this directory; move it aside to issue a new one: %w",
			id, files.Cert, ca.cert.Subject.CommonName, errdefs.ErrFailedPrecondition)
	}
	dnsNames, ips, _ := splitHosts(hosts) // checked by the caller
	want := hostStrings(dnsNames, ips)
	have := hostStrings(leaf.DNSNames, leaf.IPAddresses)
	if !slices.Equal(want, have) {
		return fmt.Errorf("check existing certificate of %s: %s is for hosts [%s], not [%s]; move it and its key aside to reissue it: %w",
			id, files.Cert, strings.Join(have, " "), strings.Join(want, " "), errdefs.ErrAlreadyExists)
	}
	return nil
}

func hostStrings(dnsNames []string, ips []net.IP) []string {
	var out []string
	for _, d := range dnsNames {
		out = append(out, strings.ToLower(d))
	}
	for _, ip := range ips {
		out = append(out, ip.String())
	}
	slices.Sort(out)
	return slices.Compact(out)
}

func exists(path string) (bool, error) {
	_, err := os.Lstat(path)
	if err == nil {
		return true, nil
	}
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	return false, err
}
