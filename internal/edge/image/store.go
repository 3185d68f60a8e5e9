package image

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"dsec.dev/dsec/internal/errdefs"
)

// Kind says where a layer sits in an environment's stack.
type Kind string

const (
	KindBase      Kind = "base"      // OS and runtimes; exactly one per environment, at the bottom
	KindWorkspace Kind = "workspace" // a task's repository and dependencies
	KindToolkit   Kind = "toolkit"   // harness and tools
	KindSnapshot  Kind = "snapshot"  // a sandbox's writable layer, packed by a snapshot: on top of what it ran on
)

func (k Kind) valid() bool {
	return k == KindBase || k == KindWorkspace || k == KindToolkit || k == KindSnapshot
}

// rank orders kinds bottom first.
func (k Kind) rank() int {
	switch k {
	case KindBase:
		return 0
	case KindWorkspace:
		return 1
	case KindToolkit:
		return 2
	default:
		return 3 // snapshots, in the order the environment names them
	}
}

// Layer describes one stored layer image.
type Layer struct {
	Digest  string // "sha256:<hex>" of the EROFS image file
	Kind    Kind
	Refs    []string // name:tag refs pointing at it, sorted
	Images  []string // image refs whose layers include it, sorted
	Size    int64    // bytes of the image file
	Created time.Time
	Source  string // what it was imported from
	// Warnings say what the import that returned the layer left out and
	// why (special files under /dev); nothing was refused for them. Not
	// stored: only Import's result carries them.
	Warnings []string
}

// ImportOptions bound what Import accepts.
type ImportOptions struct {
	AllowSetuid bool  // accept setuid/setgid files and file capabilities
	MaxBytes    int64 // total file content; 0 = 64 GiB
	MaxEntries  int64 // files, directories, links; 0 = 2M
	// Below, for ImportLayers only, names the stored layers (digests,
	// bottom first) the built layer will be stacked on. Whiteouts and
	// opaque marks that hide nothing in them are left out of it (overlayfs
	// would list such a whiteout); a base layer with none below keeps none.
	Below []string
	// LimitName says how the caller sets MaxBytes and MaxEntries (a flag),
	// for the messages that refuse an import over them; "" names the options.
	LimitName string
}

const (
	defaultMaxBytes   = 64 << 30
	defaultMaxEntries = 2_000_000
)

// Environment is what the store knows about one environment name: the layers
// it last resolved to and how many sandboxes used it.
type Environment struct {
	Name      string
	Digests   []string
	Sandboxes int64
	LastUsed  time.Time
}

// Store is a node's layer store rooted at one directory. It is safe for
// concurrent use, and several processes may open the same root: index changes
// are serialised by a flock and published by rename.
type Store struct {
	root string
	log  *slog.Logger

	mu       sync.Mutex // guards the cache and serialises index updates in this process
	cache    *index
	cacheKey indexKey

	mountMu sync.Mutex // serialises mounts and unmounts in this process
}

type index struct {
	Layers       map[string]*layerRecord `json:"layers"`           // by hex digest
	Refs         map[string]string       `json:"refs"`             // name:tag -> hex digest
	Environments map[string]*envRecord   `json:"environments"`     // by environment name
	Images       map[string]*imageRecord `json:"images,omitempty"` // name:tag -> image; never also in Refs
	Builds       map[string]string       `json:"builds,omitempty"` // ImportLayers build key -> hex digest
}

type imageRecord struct {
	Digests []string    `json:"digests"` // hex, bottom first
	Config  ImageConfig `json:"config"`
	Created time.Time   `json:"created"`
}

type layerRecord struct {
	Kind    Kind      `json:"kind"`
	Size    int64     `json:"size"`
	Created time.Time `json:"created"`
	Source  string    `json:"source,omitempty"`
}

type envRecord struct {
	Digests   []string  `json:"digests"`
	Sandboxes int64     `json:"sandboxes"`
	LastUsed  time.Time `json:"last_used"`
}

// indexKey identifies one version of index.json: every write renames a new
// file into place, so the inode changes.
type indexKey struct {
	ino   uint64
	size  int64
	mtime time.Time
}

// Open opens (creating if needed) the store rooted at root. Leftovers of
// imports interrupted by a crash (their process is gone) are removed from
// root/tmp.
func Open(root string, log *slog.Logger) (*Store, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("open layer store %s: %w", root, err)
	}
	for _, d := range []string{abs, filepath.Join(abs, "blobs"), filepath.Join(abs, "mnt"), filepath.Join(abs, "tmp")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("open layer store %s: %w", root, err)
		}
	}
	s := &Store{root: abs, log: log}
	s.cleanTmp()
	if _, err := s.load(); err != nil {
		return nil, fmt.Errorf("open layer store %s: %w", root, err)
	}
	return s, nil
}

func (s *Store) blobPath(hex string) string  { return filepath.Join(s.root, "blobs", hex) }
func (s *Store) mountPath(hex string) string { return filepath.Join(s.root, "mnt", hex) }
func (s *Store) tmpDir() string              { return filepath.Join(s.root, "tmp") }
func (s *Store) indexPath() string           { return filepath.Join(s.root, "index.json") }

func newIndex() *index {
	return &index{Layers: map[string]*layerRecord{}, Refs: map[string]string{}, Environments: map[string]*envRecord{},
		Images: map[string]*imageRecord{}, Builds: map[string]string{}}
}

// readIndex reads index.json from disk; a missing file is an empty index.
func (s *Store) readIndex() (*index, indexKey, error) {
	f, err := os.Open(s.indexPath())
	if errors.Is(err, fs.ErrNotExist) {
		return newIndex(), indexKey{}, nil
	}
	if err != nil {
		return nil, indexKey{}, fmt.Errorf("read layer index: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, indexKey{}, fmt.Errorf("read layer index: %w", err)
	}
	key := indexKey{ino: inode(st), size: st.Size(), mtime: st.ModTime()}
	ix := newIndex()
	if err := json.NewDecoder(f).Decode(ix); err != nil {
		return nil, indexKey{}, fmt.Errorf("read layer index %s: %w", s.indexPath(), err)
	}
	if ix.Layers == nil {
		ix.Layers = map[string]*layerRecord{}
	}
	if ix.Refs == nil {
		ix.Refs = map[string]string{}
	}
	if ix.Environments == nil {
		ix.Environments = map[string]*envRecord{}
	}
	if ix.Images == nil { // index files written before images existed
		ix.Images = map[string]*imageRecord{}
	}
	if ix.Builds == nil {
		ix.Builds = map[string]string{}
	}
	return ix, key, nil
}

// load returns the current index for reading. Callers must not modify it.
// Reads need no lock: index.json is only ever replaced by rename.
func (s *Store) load() (*index, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cache != nil {
		if st, err := os.Stat(s.indexPath()); err == nil {
			if key := (indexKey{ino: inode(st), size: st.Size(), mtime: st.ModTime()}); key == s.cacheKey {
				return s.cache, nil
			}
		}
	}
	ix, key, err := s.readIndex()
	if err != nil {
		return nil, err
	}
	s.cache, s.cacheKey = ix, key
	return ix, nil
}

// update applies fn to a fresh copy of the index under the process mutex and
// the store's file lock, then publishes it atomically. With durable set, the
// new index is fsync'd before and after the rename.
func (s *Store) update(durable bool, fn func(ix *index) error) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	unlock, err := lockFile(filepath.Join(s.root, "lock"))
	if err != nil {
		return fmt.Errorf("lock layer index: %w", err)
	}
	defer unlock()
	ix, _, err := s.readIndex()
	if err != nil {
		return err
	}
	if err := fn(ix); err != nil {
		return err
	}
	data, err := json.MarshalIndent(ix, "", "  ")
	if err != nil {
		return fmt.Errorf("encode layer index: %w", err)
	}
	if err := writeFileAtomic(s.indexPath(), data, durable); err != nil {
		return fmt.Errorf("write layer index: %w", err)
	}
	s.cache = nil // re-read (and re-key) on the next load
	return nil
}

// writeFileAtomic writes data to a temporary file beside path and renames it
// into place, so readers see the old or the new content, never a mix.
func writeFileAtomic(path string, data []byte, durable bool) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp) // no-op after a successful rename
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if durable {
		if err := f.Sync(); err != nil {
			f.Close()
			return err
		}
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Chmod(tmp, 0o600); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	if durable {
		return syncDir(filepath.Dir(path))
	}
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

var (
	refNameRE = regexp.MustCompile(`^[a-z0-9]+(?:[._/-]+[a-z0-9]+)*$`)
	refTagRE  = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$`)
	hexRE     = regexp.MustCompile(`^[0-9a-f]{64}$`)
)

// normalizeRef checks a name:tag ref and fills in the tag "latest" when it is
// missing.
func normalizeRef(ref string) (string, error) {
	if strings.HasPrefix(ref, "sha256:") {
		return "", fmt.Errorf("parse ref %q: a digest is not a ref: %w", ref, errdefs.ErrInvalidArgument)
	}
	name, tag := ref, "latest"
	if i := strings.LastIndex(ref, ":"); i >= 0 {
		name, tag = ref[:i], ref[i+1:]
	}
	if len(name) > 200 || !refNameRE.MatchString(name) {
		return "", fmt.Errorf("parse ref %q: name must be lower-case letters, digits and . _ - / separators: %w", ref, errdefs.ErrInvalidArgument)
	}
	if !refTagRE.MatchString(tag) {
		return "", fmt.Errorf("parse ref %q: tag must be letters, digits, . _ - (at most 128): %w", ref, errdefs.ErrInvalidArgument)
	}
	return name + ":" + tag, nil
}

// parseDigest returns the hex of a "sha256:<hex>" digest.
func parseDigest(d string) (string, error) {
	hex, ok := strings.CutPrefix(d, "sha256:")
	if !ok || !hexRE.MatchString(hex) {
		return "", fmt.Errorf("parse digest %q: want sha256:<64 lower-case hex digits>: %w", d, errdefs.ErrInvalidArgument)
	}
	return hex, nil
}

// lookup finds the hex digest a ref or digest names.
func (ix *index) lookup(refOrDigest string) (string, error) {
	if strings.HasPrefix(refOrDigest, "sha256:") {
		hex, err := parseDigest(refOrDigest)
		if err != nil {
			return "", err
		}
		if ix.Layers[hex] == nil {
			return "", fmt.Errorf("find layer %s: %w", refOrDigest, errdefs.ErrNotFound)
		}
		return hex, nil
	}
	ref, err := normalizeRef(refOrDigest)
	if err != nil {
		return "", err
	}
	hex, ok := ix.Refs[ref]
	if !ok || ix.Layers[hex] == nil {
		return "", ix.notFound(ref)
	}
	return hex, nil
}

// notFound says that no layer or image is named ref, and which known names
// are nearest to it: a typo'd environment is the usual cause.
func (ix *index) notFound(ref string) error {
	known := make([]string, 0, len(ix.Refs)+len(ix.Images))
	for r, hex := range ix.Refs {
		if ix.Layers[hex] != nil {
			known = append(known, r)
		}
	}
	for r := range ix.Images {
		known = append(known, r)
	}
	msg := "no layer or image is named " + ref
	if near := nearest(ref, known, 3); len(near) > 0 {
		msg += "; did you mean " + strings.Join(near, " or ") + "?"
	}
	msg += " (dsec layer ls and dsec image ls list what this node has)"
	return fmt.Errorf("%s: %w", msg, errdefs.ErrNotFound)
}

// nearest returns up to n of known closest to name by edit distance, closest
// first, leaving out any too far off to be a typo of it.
func nearest(name string, known []string, n int) []string {
	type cand struct {
		name string
		d    int
	}
	limit := max(2, len(name)/4)
	var cs []cand
	for _, k := range known {
		if d := editDistance(name, k); d <= limit {
			cs = append(cs, cand{k, d})
		}
	}
	sort.Slice(cs, func(i, j int) bool {
		if cs[i].d != cs[j].d {
			return cs[i].d < cs[j].d
		}
		return cs[i].name < cs[j].name
	})
	var out []string
	for i := 0; i < len(cs) && i < n; i++ {
		out = append(out, cs[i].name)
	}
	return out
}

// editDistance is the Damerau–Levenshtein distance (adjacent swaps count
// as one edit) between a and b, by bytes.
func editDistance(a, b string) int {
	prev2 := make([]int, len(b)+1)
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				cur[j] = min(cur[j], prev2[j-2]+1)
			}
		}
		prev2, prev, cur = prev, cur, prev2
	}
	return prev[len(b)]
}

func (ix *index) layer(hex string) Layer {
	rec := ix.Layers[hex]
	l := Layer{Digest: "sha256:" + hex, Kind: rec.Kind, Size: rec.Size, Created: rec.Created, Source: rec.Source, Refs: []string{}}
	for ref, h := range ix.Refs {
		if h == hex {
			l.Refs = append(l.Refs, ref)
		}
	}
	sort.Strings(l.Refs)
	l.Images = []string{}
	for ref, img := range ix.Images {
		if slices.Contains(img.Digests, hex) {
			l.Images = append(l.Images, ref)
		}
	}
	sort.Strings(l.Images)
	return l
}

// setRef points the layer ref at hex; a ref names a layer or an image, so an
// image of that name is dropped.
func (ix *index) setRef(ref, hex string) {
	delete(ix.Images, ref)
	ix.Refs[ref] = hex
}

// usedByImage returns an image ref using the layer hex, or "".
func (ix *index) usedByImage(hex string) string {
	var refs []string
	for ref, img := range ix.Images {
		if slices.Contains(img.Digests, hex) {
			refs = append(refs, ref)
		}
	}
	if len(refs) == 0 {
		return ""
	}
	sort.Strings(refs)
	return refs[0]
}

// List returns every stored layer, oldest first.
func (s *Store) List() ([]Layer, error) {
	ix, err := s.load()
	if err != nil {
		return nil, err
	}
	out := make([]Layer, 0, len(ix.Layers))
	for hex := range ix.Layers {
		out = append(out, ix.layer(hex))
	}
	sort.Slice(out, func(i, j int) bool {
		if !out[i].Created.Equal(out[j].Created) {
			return out[i].Created.Before(out[j].Created)
		}
		return out[i].Digest < out[j].Digest
	})
	return out, nil
}

// Get returns the layer a name:tag ref (tag defaults to latest) or a sha256:
// digest names, or an error wrapping errdefs.ErrNotFound.
func (s *Store) Get(refOrDigest string) (Layer, error) {
	ix, err := s.load()
	if err != nil {
		return Layer{}, err
	}
	hex, err := ix.lookup(refOrDigest)
	if err != nil {
		return Layer{}, err
	}
	return ix.layer(hex), nil
}

// Remove deletes a ref, or a layer. Given a ref it removes the ref, and the
// layer too once no ref points at it; given a digest it removes the layer and
// every ref to it. A removed layer is unmounted (lazily, so sandboxes already
// stacked on it keep their view) and its image file deleted.
func (s *Store) Remove(refOrDigest string) error {
	if !strings.HasPrefix(refOrDigest, "sha256:") {
		if ref, err := normalizeRef(refOrDigest); err == nil {
			if ix, err := s.load(); err == nil && ix.Images[ref] != nil {
				return s.removeImage(ref)
			}
		}
	}
	var gone string
	err := s.update(true, func(ix *index) error {
		hex, err := ix.lookup(refOrDigest)
		if err != nil {
			return err
		}
		if !strings.HasPrefix(refOrDigest, "sha256:") {
			ref, _ := normalizeRef(refOrDigest)
			delete(ix.Refs, ref)
			for _, h := range ix.Refs {
				if h == hex {
					return nil // other refs keep the layer
				}
			}
			if ix.usedByImage(hex) != "" {
				return nil // an image keeps the layer
			}
		}
		if img := ix.usedByImage(hex); img != "" {
			return fmt.Errorf("layer sha256:%s is part of image %s; remove the image: %w", hex, img, errdefs.ErrFailedPrecondition)
		}
		for ref, h := range ix.Refs {
			if h == hex {
				delete(ix.Refs, ref)
			}
		}
		ix.dropLayer(hex)
		gone = hex
		// Under the index lock, so an import of the same content cannot
		// slip in between dropping the record and deleting the file.
		if err := s.unmountLayer(context.Background(), hex); err != nil {
			return err
		}
		if err := os.Remove(s.blobPath(hex)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("remove layer %s: %w", refOrDigest, err)
	}
	if gone == "" {
		return nil
	}
	s.log.Info("removed layer", "ref", refOrDigest, "digest", "sha256:"+gone)
	return nil
}

// ResolveEnvironment turns BASE[+LAYER...] into its layers, bottom first:
// the one base, then workspaces, then toolkits, each kind in the order given.
// BASE may name an image: its layers, bottom first, are then the base (they
// keep their order), and no other part may be a base layer.
// A malformed name, a missing or second base and a repeated layer wrap
// errdefs.ErrInvalidArgument; an unknown ref or digest wraps errdefs.ErrNotFound.
func (s *Store) ResolveEnvironment(env string) ([]Layer, error) {
	if strings.TrimSpace(env) == "" {
		return nil, fmt.Errorf("resolve environment: empty name, want BASE[+LAYER...]: %w", errdefs.ErrInvalidArgument)
	}
	ix, err := s.load()
	if err != nil {
		return nil, err
	}
	var layers, imageLayers []Layer
	seen := map[string]string{}
	var base string
	for _, part := range strings.Split(env, "+") {
		part = strings.TrimSpace(part)
		if part == "" {
			return nil, fmt.Errorf("resolve environment %q: empty layer name, want BASE[+LAYER...]: %w", env, errdefs.ErrInvalidArgument)
		}
		if img := ix.image(part); img != nil {
			if base != "" {
				return nil, fmt.Errorf("resolve environment %q: two bases, %s and image %s; an environment has exactly one: %w", env, base, part, errdefs.ErrInvalidArgument)
			}
			base = part
			for _, hex := range img.Digests {
				if ix.Layers[hex] == nil {
					return nil, fmt.Errorf("resolve environment %q: image %s: layer sha256:%s: %w", env, part, hex, errdefs.ErrNotFound)
				}
				if prev, ok := seen[hex]; ok {
					return nil, fmt.Errorf("resolve environment %q: %s and %s share layer sha256:%s: %w", env, prev, part, hex, errdefs.ErrInvalidArgument)
				}
				seen[hex] = part
				imageLayers = append(imageLayers, ix.layer(hex))
			}
			continue
		}
		hex, err := ix.lookup(part)
		if err != nil {
			if part == strings.TrimSpace(env) {
				return nil, err // the message names it already
			}
			return nil, fmt.Errorf("environment %q: %w", env, err)
		}
		if prev, ok := seen[hex]; ok {
			return nil, fmt.Errorf("resolve environment %q: %s and %s are the same layer: %w", env, prev, part, errdefs.ErrInvalidArgument)
		}
		seen[hex] = part
		l := ix.layer(hex)
		if l.Kind == KindBase {
			if base != "" {
				return nil, fmt.Errorf("resolve environment %q: two base layers, %s and %s; an environment has exactly one: %w", env, base, part, errdefs.ErrInvalidArgument)
			}
			base = part
		}
		layers = append(layers, l)
	}
	if base == "" {
		return nil, fmt.Errorf("resolve environment %q: no base layer; the first part must name a layer of kind base: %w", env, errdefs.ErrInvalidArgument)
	}
	sort.SliceStable(layers, func(i, j int) bool { return layers[i].Kind.rank() < layers[j].Kind.rank() })
	return append(imageLayers, layers...), nil
}

// RecordEnvironment counts one more sandbox created from env, which resolved
// to digests (bottom first). The count is statistics: it is published
// atomically but not fsync'd.
func (s *Store) RecordEnvironment(env string, digests []string) error {
	if env == "" {
		return fmt.Errorf("record environment: empty name: %w", errdefs.ErrInvalidArgument)
	}
	err := s.update(false, func(ix *index) error {
		rec := ix.Environments[env]
		if rec == nil {
			rec = &envRecord{}
			ix.Environments[env] = rec
		}
		rec.Digests = append([]string(nil), digests...)
		rec.Sandboxes++
		rec.LastUsed = time.Now().UTC()
		return nil
	})
	if err != nil {
		return fmt.Errorf("record environment %q: %w", env, err)
	}
	return nil
}

// Environments returns every recorded environment, by name.
func (s *Store) Environments() ([]Environment, error) {
	ix, err := s.load()
	if err != nil {
		return nil, err
	}
	out := make([]Environment, 0, len(ix.Environments))
	for name, rec := range ix.Environments {
		out = append(out, Environment{Name: name, Digests: append([]string(nil), rec.Digests...), Sandboxes: rec.Sandboxes, LastUsed: rec.LastUsed})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// Adopted is a layer another node built, as the blob store they share
// records it, for Adopt.
type Adopted struct {
	Digest string // "sha256:<hex>"
	Kind   Kind
	Size   int64
	Source string
}

// Adopt records layers another node built (their files stay in the blob
// store: this store has no copy until FetchLayerFile) and points ref at
// them: at the one layer, or, with img set, at an image of them in order
// with that configuration. A layer this store has already is kept as it is
// (a kind that differs is an error wrapping errdefs.ErrAlreadyExists, as for
// Import). The index is fsync'd before Adopt returns.
func (s *Store) Adopt(ctx context.Context, ref string, layers []Adopted, img *ImageConfig) error {
	nref, err := normalizeRef(ref)
	if err != nil {
		return fmt.Errorf("adopt: %w", err)
	}
	if len(layers) == 0 || (img == nil && len(layers) != 1) {
		return fmt.Errorf("adopt %s: %d layers: a layer ref names one, an image at least one: %w", nref, len(layers), errdefs.ErrInvalidArgument)
	}
	hexes := make([]string, len(layers))
	for i, l := range layers {
		if hexes[i], err = parseDigest(l.Digest); err != nil {
			return fmt.Errorf("adopt %s: %w", nref, err)
		}
		if !l.Kind.valid() {
			return fmt.Errorf("adopt %s: layer %s has kind %q: %w", nref, l.Digest, l.Kind, errdefs.ErrInvalidArgument)
		}
		if slices.Contains(hexes[:i], hexes[i]) {
			return fmt.Errorf("adopt %s: layer %s listed twice: %w", nref, l.Digest, errdefs.ErrInvalidArgument)
		}
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("adopt %s: %w", nref, err)
	}
	err = s.update(true, func(ix *index) error {
		now := time.Now().UTC()
		for i, l := range layers {
			if rec := ix.Layers[hexes[i]]; rec != nil {
				if rec.Kind != l.Kind {
					return fmt.Errorf("layer %s is already stored as a %s layer: %w", l.Digest, rec.Kind, errdefs.ErrAlreadyExists)
				}
				continue
			}
			ix.Layers[hexes[i]] = &layerRecord{Kind: l.Kind, Size: l.Size, Created: now, Source: l.Source}
		}
		if img == nil {
			ix.setRef(nref, hexes[0])
			return nil
		}
		delete(ix.Refs, nref)
		ix.Images[nref] = &imageRecord{Digests: hexes, Config: cloneConfig(*img), Created: now}
		return nil
	})
	if err != nil {
		return fmt.Errorf("adopt %s: %w", nref, err)
	}
	s.log.Info("adopted", "ref", nref, "layers", len(layers), "image", img != nil)
	return nil
}

// HasLayerFile reports whether the store holds the image file of layer
// digest (an adopted layer has none until FetchLayerFile).
func (s *Store) HasLayerFile(digest string) bool {
	hex, err := parseDigest(digest)
	if err != nil {
		return false
	}
	_, err = os.Stat(s.blobPath(hex))
	return err == nil
}

// StagePath is where a caller builds a layer file that AddLayerFile then
// moves in: a path named name in the store's own temporary directory, on
// the store's file system, so the move is a rename. The name starts with
// the pid, so what a killed process left there is removed when the store
// is next opened; nothing at a StagePath is a layer until AddLayerFile.
func (s *Store) StagePath(name string) string {
	return filepath.Join(s.tmpDir(), strconv.Itoa(os.Getpid())+"-"+name)
}

// AddLayerFile moves the layer file at path, built at a StagePath and
// already fsync'd, into the store as the image file of the recorded layer
// digest, unless the store has it (then path is removed). The caller
// vouches for the content's digest: it hashed the file after sealing it,
// as BuildLayerFile does, so nothing is read again here. A file whose size
// is not the recorded one is refused (errdefs.ErrInvalidArgument) and
// removed. The move is durable before AddLayerFile returns.
func (s *Store) AddLayerFile(ctx context.Context, digest, path string) error {
	hexDigest, err := parseDigest(digest)
	if err != nil {
		return fmt.Errorf("add layer file: %w", err)
	}
	defer os.Remove(path) // no-op once renamed
	if filepath.Dir(path) != s.tmpDir() {
		return fmt.Errorf("add layer file %s: %s is not in the store's staging directory: %w", digest, path, errdefs.ErrInvalidArgument)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("add layer file %s: %w", digest, err)
	}
	if s.HasLayerFile(digest) {
		return nil
	}
	st, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("add layer file %s: %w", digest, err)
	}
	return s.update(true, func(ix *index) error {
		rec := ix.Layers[hexDigest]
		if rec == nil {
			return fmt.Errorf("add layer file %s: no such layer (removed meanwhile?): %w", digest, errdefs.ErrNotFound)
		}
		if rec.Size != st.Size() {
			return fmt.Errorf("add layer file %s: %d bytes, the layer has %d: %w", digest, st.Size(), rec.Size, errdefs.ErrInvalidArgument)
		}
		if err := os.Rename(path, s.blobPath(hexDigest)); err != nil {
			return fmt.Errorf("add layer file %s: %w", digest, err)
		}
		return syncDir(filepath.Dir(s.blobPath(hexDigest)))
	})
}

// FetchLayerFile stores the image file of the recorded layer digest,
// written by write (from the blob store), unless the store has it. The
// content must have the digest; nothing is kept otherwise.
func (s *Store) FetchLayerFile(ctx context.Context, digest string, write func(io.Writer) error) error {
	hexDigest, err := parseDigest(digest)
	if err != nil {
		return fmt.Errorf("fetch layer file: %w", err)
	}
	if s.HasLayerFile(digest) {
		return nil
	}
	f, err := os.CreateTemp(s.tmpDir(), strconv.Itoa(os.Getpid())+"-fetch-*")
	if err != nil {
		return fmt.Errorf("fetch layer file %s: %w", digest, err)
	}
	defer os.Remove(f.Name()) // no-op once renamed
	h := sha256.New()
	err = write(io.MultiWriter(f, h))
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("fetch layer file %s: %w", digest, err)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != hexDigest {
		return fmt.Errorf("fetch layer file %s: content has digest sha256:%s: %w", digest, got, errdefs.ErrInvalidArgument)
	}
	return s.update(true, func(ix *index) error {
		if ix.Layers[hexDigest] == nil {
			return fmt.Errorf("fetch layer file %s: no such layer (removed meanwhile?): %w", digest, errdefs.ErrNotFound)
		}
		if err := os.Rename(f.Name(), s.blobPath(hexDigest)); err != nil {
			return fmt.Errorf("fetch layer file %s: %w", digest, err)
		}
		return syncDir(filepath.Dir(s.blobPath(hexDigest)))
	})
}
