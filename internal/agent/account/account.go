// Package account resolves the user a sandbox command or file operation runs
// as, from the sandbox's own /etc/passwd and /etc/group (never the host's, and
// never through libc or NSS, so the agent stays static).
package account

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"dsec.dev/dsec/internal/errdefs"
)

// Account is a resolved user: the credentials a process gets and the
// environment defaults (HOME, USER) that come from /etc/passwd.
type Account struct {
	Name   string // empty when the uid has no passwd entry
	UID    uint32
	GID    uint32
	Groups []uint32 // supplementary groups from /etc/group
	Home   string   // empty when unknown
	Shell  string
}

// Root is uid 0 when /etc/passwd has no entry for it.
var Root = Account{Name: "root", Home: "/root"}

// Lookup resolves spec, which is "name", "uid", "name:group" or "uid:gid"
// (group by name or number), against etcDir (normally /etc). An empty spec is
// root.
func Lookup(etcDir, spec string) (Account, error) {
	if spec == "" {
		spec = "0"
	}
	userPart, groupPart, hasGroup := strings.Cut(spec, ":")
	passwd := readEntries(filepath.Join(etcDir, "passwd"))
	groups := readEntries(filepath.Join(etcDir, "group"))

	var a Account
	found := false
	uid, numErr := strconv.ParseUint(userPart, 10, 32)
	for _, e := range passwd {
		if len(e) < 7 {
			continue
		}
		if (numErr == nil && e[2] == userPart) || (numErr != nil && e[0] == userPart) {
			u, err1 := strconv.ParseUint(e[2], 10, 32)
			g, err2 := strconv.ParseUint(e[3], 10, 32)
			if err1 != nil || err2 != nil {
				continue
			}
			a = Account{Name: e[0], UID: uint32(u), GID: uint32(g), Home: e[5], Shell: e[6]}
			found = true
			break
		}
	}
	if !found {
		if numErr != nil {
			return Account{}, fmt.Errorf("look up user %q: no such user in the sandbox's /etc/passwd: %w", userPart, errdefs.ErrInvalidArgument)
		}
		a = Account{UID: uint32(uid), GID: uint32(uid)}
		if uid == 0 {
			a = Root
		}
	}
	if hasGroup {
		gid, err := strconv.ParseUint(groupPart, 10, 32)
		if err != nil {
			ok := false
			for _, e := range groups {
				if len(e) >= 3 && e[0] == groupPart {
					if g, err := strconv.ParseUint(e[2], 10, 32); err == nil {
						gid, ok = g, true
						break
					}
				}
			}
			if !ok {
				return Account{}, fmt.Errorf("look up group %q: no such group in the sandbox's /etc/group: %w", groupPart, errdefs.ErrInvalidArgument)
			}
		}
		a.GID = uint32(gid)
	}
	if a.Name != "" {
		for _, e := range groups {
			if len(e) < 4 {
				continue
			}
			g, err := strconv.ParseUint(e[2], 10, 32)
			if err != nil || uint32(g) == a.GID {
				continue
			}
			for _, m := range strings.Split(e[3], ",") {
				if m == a.Name {
					a.Groups = append(a.Groups, uint32(g))
					break
				}
			}
		}
	}
	return a, nil
}

// readEntries reads a colon-separated database; a missing file is empty.
func readEntries(path string) [][]string {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out [][]string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		out = append(out, strings.Split(line, ":"))
	}
	return out
}
