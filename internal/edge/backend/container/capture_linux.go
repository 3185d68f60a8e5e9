package container

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/snapshot"
	"dsec.dev/dsec/internal/errdefs"
)

// Capture captures sandbox id's writable layer, the overlay's upper dir,
// into .captures/<id>.<name> under the backend's writable layers
// (<UpperRoot>/.captures; <UpperRoot>/.gvisor/.captures under runsc): on
// the upper file system (a btrfs snapshot or a reflink walk needs that; package snapshot picks the fastest
// method the file systems allow), outside every sandbox's quota project.
// Init empties that dir.
func (r *Container) Capture(ctx context.Context, id, name string) (*snapshot.Tree, error) {
	if !backend.ValidID(id) || !backend.ValidID(name) {
		return nil, fmt.Errorf("capture sandbox %q as %q: %w", id, name, errdefs.ErrInvalidArgument)
	}
	upper := filepath.Join(r.upperDir(id), "upper")
	if _, err := os.Lstat(upper); errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("capture sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	return snapshot.Capture(ctx, upper, filepath.Join(r.captureDir(), id+"."+name))
}

// captureDir is where Capture puts its captures.
func (r *Container) captureDir() string { return filepath.Join(r.upperBase, ".captures") }

// clearCaptures removes what a snapshot cut short by a restart left in the
// capture dir.
func (r *Container) clearCaptures() error {
	dir := r.captureDir()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("make %s: %w", dir, err)
	}
	des, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("read %s: %w", dir, err)
	}
	var errs []error
	for _, de := range des {
		p := filepath.Join(dir, de.Name())
		r.log.Info("removing a capture left by an interrupted snapshot", "path", p)
		if err := snapshot.RemoveCapture(p); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
