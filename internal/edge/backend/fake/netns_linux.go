package fake

import (
	"fmt"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
)

// checkNetns checks that path is a network namespace (a file of nsfs), as
// a runtime joining it would find.
func checkNetns(path string) error {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return fmt.Errorf("join netns %s: %w", path, err)
	}
	if st.Type != unix.NSFS_MAGIC {
		return fmt.Errorf("join netns %s: not a namespace file: %w", path, errdefs.ErrInvalidArgument)
	}
	return nil
}
