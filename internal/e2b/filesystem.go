package e2b

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	fspb "dsec.dev/dsec/api/gen/e2b/filesystem"
	"dsec.dev/dsec/internal/errdefs"
)

// fsService is envd's filesystem.Filesystem over dsec's file calls. Every
// call runs inside the sandbox as the request's user (targetOf(ctx)),
// through the sandbox's agent, so the kernel's permission checks are that
// user's and every path, ".." and symlinks included, resolves inside the
// sandbox's root. The zero value, with h set, is ready.
type fsService struct {
	h     *Handler
	names nameCache // uid and gid names, per sandbox
}

// Limits that keep one call from costing without bound. envd has none;
// these are far above what the SDKs ask for.
const (
	// maxListEntries caps the entries of one ListDir (all depths).
	maxListEntries = 100_000
	// maxLinkHops caps the symlinks followed to find a link's target, as
	// the kernel's 40.
	maxLinkHops = 40
)

// abs is p made absolute as envd does: "~" and relative paths against the
// user's home, then cleaned.
func abs(t target, p string) string {
	switch {
	case p == "~":
		p = ""
	case strings.HasPrefix(p, "~/"):
		p = p[2:]
	}
	return path.Clean(resolve(t, p))
}

// connectErr is a dsec error as envd would answer it: the code kept, the
// message dsec's.
func connectErr(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return connect.NewError(ce.Code(), errors.New(ce.Message()))
	}
	return errdefs.ToConnect(err)
}

func (s *fsService) stat(ctx context.Context, t target, p string) (*dsecv1.FileInfo, error) {
	resp, err := s.h.api.Stat(ctx, connect.NewRequest(&dsecv1.StatRequest{SandboxId: t.ID, Path: p, User: userOf(t)}))
	if err != nil {
		return nil, err
	}
	return resp.Msg.GetInfo(), nil
}

func (s *fsService) list(ctx context.Context, t target, p string) ([]*dsecv1.FileInfo, error) {
	resp, err := s.h.api.ListDir(ctx, connect.NewRequest(&dsecv1.ListDirRequest{SandboxId: t.ID, Path: p, User: userOf(t)}))
	if err != nil {
		return nil, err
	}
	return resp.Msg.GetEntries(), nil
}

// follow finds what the symlink fi (at p) points to, through chains of
// links: the final path and its description, or nil when the link is
// broken or loops.
func (s *fsService) follow(ctx context.Context, t target, p string, fi *dsecv1.FileInfo) (string, *dsecv1.FileInfo) {
	for range maxLinkHops {
		dest := fi.GetLinkTarget()
		if !strings.HasPrefix(dest, "/") {
			dest = path.Join(path.Dir(p), dest)
		}
		p = path.Clean(dest)
		next, err := s.stat(ctx, t, p)
		if err != nil {
			return p, nil
		}
		if next.GetType() != "symlink" {
			return p, next
		}
		fi = next
	}
	return p, nil
}

// entry is fi (found at p) as envd describes it, its symlink followed.
func (s *fsService) entry(ctx context.Context, t target, p string, fi *dsecv1.FileInfo) *fspb.EntryInfo {
	var dest *dsecv1.FileInfo
	destPath := ""
	if fi.GetType() == "symlink" {
		destPath, dest = s.follow(ctx, t, p, fi)
	}
	return entryInfo(p, fi, destPath, dest, s.names.get(ctx, s.h, t.ID))
}

// entryInfo maps dsec's description of the entry at p onto envd's
// EntryInfo. For a symlink, envd gives the type and permission bits of
// what it points to (dest, at destPath; nil when broken: type unspecified,
// mode 0) and that target's resolved path, while permissions stays the
// link's own ("Lrwxrwxrwx", Go's FileMode notation, which envd sends).
// mode is the nine permission bits only, as envd's; owner and group are
// names where the sandbox's /etc/passwd and /etc/group have them.
func entryInfo(p string, fi *dsecv1.FileInfo, destPath string, dest *dsecv1.FileInfo, names *idNames) *fspb.EntryInfo {
	e := &fspb.EntryInfo{
		Name:        path.Base(p),
		Type:        fileType(fi.GetType()),
		Path:        p,
		Size:        fi.GetSize(),
		Mode:        fi.GetMode() & 0o777,
		Permissions: fileMode(fi).String(),
		Owner:       names.user(fi.GetUid()),
		Group:       names.group(fi.GetGid()),
	}
	if ms := fi.GetMtimeUnixMs(); ms != 0 {
		e.ModifiedTime = timestamppb.New(time.UnixMilli(ms))
	}
	if fi.GetType() == "symlink" {
		target := destPath
		if target == "" {
			target = p
		}
		e.SymlinkTarget = &target
		e.Type, e.Mode = fspb.FileType_FILE_TYPE_UNSPECIFIED, 0
		if dest != nil {
			e.Type, e.Mode = fileType(dest.GetType()), dest.GetMode()&0o777
		}
	}
	return e
}

func fileType(t string) fspb.FileType {
	switch t {
	case "file":
		return fspb.FileType_FILE_TYPE_FILE
	case "dir":
		return fspb.FileType_FILE_TYPE_DIRECTORY
	case "symlink":
		return fspb.FileType_FILE_TYPE_SYMLINK
	}
	return fspb.FileType_FILE_TYPE_UNSPECIFIED
}

// fileMode is fi's type and permission bits as a Go FileMode, whose
// String is envd's permissions field.
func fileMode(fi *dsecv1.FileInfo) os.FileMode {
	m := os.FileMode(fi.GetMode() & 0o777)
	if fi.GetMode()&0o4000 != 0 {
		m |= os.ModeSetuid
	}
	if fi.GetMode()&0o2000 != 0 {
		m |= os.ModeSetgid
	}
	if fi.GetMode()&0o1000 != 0 {
		m |= os.ModeSticky
	}
	switch fi.GetType() {
	case "file":
	case "dir":
		m |= os.ModeDir
	case "symlink":
		m |= os.ModeSymlink
	default:
		m |= os.ModeIrregular
	}
	return m
}

func (s *fsService) Stat(ctx context.Context, req *connect.Request[fspb.StatRequest]) (*connect.Response[fspb.StatResponse], error) {
	t := targetOf(ctx)
	p := abs(t, req.Msg.GetPath())
	fi, err := s.stat(ctx, t, p)
	if err != nil {
		return nil, connectErr(err)
	}
	return connect.NewResponse(&fspb.StatResponse{Entry: s.entry(ctx, t, p, fi)}), nil
}

// ListDir lists a directory (a symlink to one is followed) to the depth
// asked: 1 (and 0) is its entries, 2 adds theirs, and so on. Entries come
// depth first in name order, as envd's walk gives them, with paths under
// the path asked for; symlinks below it are not followed.
func (s *fsService) ListDir(ctx context.Context, req *connect.Request[fspb.ListDirRequest]) (*connect.Response[fspb.ListDirResponse], error) {
	t := targetOf(ctx)
	depth := int(req.Msg.GetDepth())
	if depth == 0 {
		depth = 1
	}
	p := abs(t, req.Msg.GetPath())
	fi, err := s.stat(ctx, t, p)
	if err != nil {
		return nil, connectErr(err)
	}
	dir := p
	if fi.GetType() == "symlink" {
		dir, fi = s.follow(ctx, t, p, fi)
		if fi == nil {
			return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("path not found: %s is a broken symlink", p))
		}
	}
	if fi.GetType() != "dir" {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path is not a directory: %s", p))
	}
	var out []*fspb.EntryInfo
	var walk func(real, shown string, level int) error
	walk = func(real, shown string, level int) error {
		ents, err := s.list(ctx, t, real)
		if err != nil {
			if level > 1 && connect.CodeOf(err) == connect.CodeNotFound {
				return nil // removed meanwhile
			}
			return err
		}
		for _, e := range ents {
			if len(out) >= maxListEntries {
				return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("listing %s to depth %d gives more than %d entries; ask for less depth", p, depth, maxListEntries))
			}
			name := path.Join(shown, e.GetName())
			out = append(out, s.entry(ctx, t, name, e))
			if e.GetType() == "dir" && level < depth {
				if err := walk(path.Join(real, e.GetName()), name, level+1); err != nil {
					return err
				}
			}
		}
		return nil
	}
	if err := walk(dir, p, 1); err != nil {
		return nil, connectErr(err)
	}
	return connect.NewResponse(&fspb.ListDirResponse{Entries: out}), nil
}

// MakeDir makes a directory and its parents: an existing directory is
// already_exists (the SDK's makeDir answers false), an existing file
// invalid_argument.
func (s *fsService) MakeDir(ctx context.Context, req *connect.Request[fspb.MakeDirRequest]) (*connect.Response[fspb.MakeDirResponse], error) {
	t := targetOf(ctx)
	p := abs(t, req.Msg.GetPath())
	fi, err := s.stat(ctx, t, p)
	switch {
	case err == nil && fi.GetType() == "dir":
		return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("directory already exists: %s", p))
	case err == nil:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path already exists but it is not a directory: %s", p))
	case connect.CodeOf(err) != connect.CodeNotFound:
		return nil, connectErr(err)
	}
	if _, err := s.h.api.MakeDir(ctx, connect.NewRequest(&dsecv1.MakeDirRequest{SandboxId: t.ID, Path: p, Parents: true, Mode: 0o755, User: userOf(t)})); err != nil {
		return nil, connectErr(err)
	}
	fi, err = s.stat(ctx, t, p)
	if err != nil {
		return nil, connectErr(err)
	}
	return connect.NewResponse(&fspb.MakeDirResponse{Entry: s.entry(ctx, t, p, fi)}), nil
}

// Move renames, making the destination's parents, as envd does.
func (s *fsService) Move(ctx context.Context, req *connect.Request[fspb.MoveRequest]) (*connect.Response[fspb.MoveResponse], error) {
	t := targetOf(ctx)
	if req.Msg.GetSource() == "" || req.Msg.GetDestination() == "" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("move needs a source and a destination"))
	}
	src, dst := abs(t, req.Msg.GetSource()), abs(t, req.Msg.GetDestination())
	resp, err := s.h.api.Move(ctx, connect.NewRequest(&dsecv1.MoveRequest{SandboxId: t.ID, Source: src, Destination: dst, MakeParents: true, User: userOf(t)}))
	if err != nil {
		return nil, connectErr(err)
	}
	return connect.NewResponse(&fspb.MoveResponse{Entry: s.entry(ctx, t, dst, resp.Msg.GetInfo())}), nil
}

// Remove deletes a file or a directory tree. A path that is not there is
// no error, as envd's (os.RemoveAll).
func (s *fsService) Remove(ctx context.Context, req *connect.Request[fspb.RemoveRequest]) (*connect.Response[fspb.RemoveResponse], error) {
	t := targetOf(ctx)
	p := abs(t, req.Msg.GetPath())
	_, err := s.h.api.Remove(ctx, connect.NewRequest(&dsecv1.RemoveRequest{SandboxId: t.ID, Path: p, Recursive: true, User: userOf(t)}))
	if err != nil && connect.CodeOf(err) != connect.CodeNotFound {
		return nil, connectErr(err)
	}
	return connect.NewResponse(&fspb.RemoveResponse{}), nil
}

// nameCache keeps, per sandbox, the user and group names of its
// /etc/passwd and /etc/group, read through the sandbox's agent (as root)
// at most every namesTTL. The zero value is ready.
type nameCache struct {
	mu sync.Mutex
	m  map[string]*idNames
}

const (
	namesTTL = 30 * time.Second
	// namesMax bounds the sandboxes remembered; past it the cache starts
	// over.
	namesMax = 4096
)

// idNames are one sandbox's user and group names by id.
type idNames struct {
	at     time.Time
	users  map[uint32]string
	groups map[uint32]string
}

func (n *idNames) user(id uint32) string {
	if n != nil {
		if s, ok := n.users[id]; ok {
			return s
		}
	}
	return strconv.FormatUint(uint64(id), 10)
}

func (n *idNames) group(id uint32) string {
	if n != nil {
		if s, ok := n.groups[id]; ok {
			return s
		}
	}
	return strconv.FormatUint(uint64(id), 10)
}

// get returns the names of the dsec sandbox id; on a failed read, none
// (ids are then shown as numbers, as envd does for unknown ones).
func (c *nameCache) get(ctx context.Context, h *Handler, id string) *idNames {
	now := time.Now()
	c.mu.Lock()
	n, ok := c.m[id]
	c.mu.Unlock()
	if ok && now.Sub(n.at) < namesTTL {
		return n
	}
	n = &idNames{at: now, users: parseIDFile(readSmall(ctx, h, id, "/etc/passwd")), groups: parseIDFile(readSmall(ctx, h, id, "/etc/group"))}
	c.mu.Lock()
	if c.m == nil || len(c.m) >= namesMax {
		c.m = map[string]*idNames{}
	}
	c.m[id] = n
	c.mu.Unlock()
	return n
}

// readSmall reads a sandbox's file as root, "" when it cannot.
func readSmall(ctx context.Context, h *Handler, id, p string) string {
	resp, err := h.api.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: id, Path: p, Limit: 4 << 20, User: "0"}))
	if err != nil {
		return ""
	}
	return string(resp.Msg.GetData())
}

// parseIDFile maps the ids of a passwd or group file (name:x:id:...) to
// their names; the first name of an id wins.
func parseIDFile(s string) map[uint32]string {
	out := map[uint32]string{}
	for _, line := range strings.Split(s, "\n") {
		f := strings.Split(line, ":")
		if len(f) < 3 || f[0] == "" || strings.HasPrefix(f[0], "#") {
			continue
		}
		id, err := strconv.ParseUint(f[2], 10, 32)
		if err != nil {
			continue
		}
		if _, ok := out[uint32(id)]; !ok {
			out[uint32(id)] = f[0]
		}
	}
	return out
}
