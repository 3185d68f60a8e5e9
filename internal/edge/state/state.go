// Package state keeps the edge's record of each sandbox on local disk, one
// JSON file per sandbox under <root>/<id>/state.json, written atomically,
// and beside it the create token of the create that made it (create_token),
// when it has one. It is what lets a restarted edge re-adopt the sandboxes
// it left running, and still answer for their tokens.
package state

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"google.golang.org/protobuf/encoding/protojson"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

const (
	fileName  = "state.json"
	tokenName = "create_token"
)

// Store reads and writes sandbox records under one directory. It does no
// locking of its own: the edge owns each sandbox's record.
type Store struct {
	root string
}

// New returns a Store rooted at dir, creating dir.
func New(dir string) (*Store, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("make state dir %s: %w", dir, err)
	}
	return &Store{root: dir}, nil
}

// Dir is the sandbox's private host directory (not visible inside it).
func (s *Store) Dir(id string) string { return filepath.Join(s.root, id) }

// Save writes sb's record, replacing the previous one atomically. It does
// not fsync: a record serves a restarted edge on a running kernel, where the
// page cache already holds it; after a power loss or a kernel crash every
// sandbox is gone anyway, and Recover removes what an unreadable record
// names. An fsync per save cost milliseconds on every create.
func (s *Store) Save(sb *dsecv1.Sandbox) error {
	dir := s.Dir(sb.GetId())
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("make sandbox dir %s: %w", dir, err)
	}
	data, err := protojson.Marshal(sb)
	if err != nil {
		return fmt.Errorf("encode sandbox %s: %w", sb.GetId(), err)
	}
	return writeAtomic(dir, fileName, data, sb.GetId())
}

// writeAtomic replaces dir/name with data through a rename.
func writeAtomic(dir, name string, data []byte, id string) error {
	tmp, err := os.CreateTemp(dir, name+".*")
	if err != nil {
		return fmt.Errorf("save sandbox %s %s: %w", id, name, err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return fmt.Errorf("save sandbox %s %s: %w", id, name, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("save sandbox %s %s: %w", id, name, err)
	}
	if err := os.Rename(tmp.Name(), filepath.Join(dir, name)); err != nil {
		return fmt.Errorf("save sandbox %s %s: %w", id, name, err)
	}
	return nil
}

// SaveToken records the create token of sandbox id's create. The token is
// kept apart from the record, which is the public API's message: it is the
// edge's and the apiservers' business only. Like Save it does not fsync.
func (s *Store) SaveToken(id, token string) error {
	dir := s.Dir(id)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("make sandbox dir %s: %w", dir, err)
	}
	return writeAtomic(dir, tokenName, []byte(token), id)
}

// Token reads the create token of sandbox id; "" when it has none.
func (s *Store) Token(id string) (string, error) {
	data, err := os.ReadFile(filepath.Join(s.Dir(id), tokenName))
	if errors.Is(err, os.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("read sandbox %s create token: %w", id, err)
	}
	return string(data), nil
}

// Load reads one record.
func (s *Store) Load(id string) (*dsecv1.Sandbox, error) {
	data, err := os.ReadFile(filepath.Join(s.Dir(id), fileName))
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("sandbox %s record: %w", id, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("read sandbox %s record: %w", id, err)
	}
	sb := &dsecv1.Sandbox{}
	if err := protojson.Unmarshal(data, sb); err != nil {
		return nil, fmt.Errorf("decode sandbox %s record: %w", id, err)
	}
	return sb, nil
}

// IDs lists every sandbox directory, with or without a readable record, so
// that a half-made sandbox is still found and reaped.
func (s *Store) IDs() ([]string, error) {
	entries, err := os.ReadDir(s.root)
	if err != nil {
		return nil, fmt.Errorf("list sandbox records: %w", err)
	}
	var ids []string
	for _, e := range entries {
		if e.IsDir() && strings.HasPrefix(e.Name(), "sb-") {
			ids = append(ids, e.Name())
		}
	}
	return ids, nil
}

// Remove deletes the sandbox's directory and record.
func (s *Store) Remove(id string) error {
	if err := os.RemoveAll(s.Dir(id)); err != nil {
		return fmt.Errorf("remove sandbox %s dir: %w", id, err)
	}
	return nil
}
