//go:build !linux

package child

// Main is only implemented on Linux.
func Main() int { return 127 }
