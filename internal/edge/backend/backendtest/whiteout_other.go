//go:build !linux

package backendtest

// whiteout: overlayfs whiteouts are Linux's; no runtime that captures
// runs elsewhere.
func whiteout(path string) (bool, string) { return false, "not on Linux" }
