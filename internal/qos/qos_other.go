//go:build !linux

package qos

import "dsec.dev/dsec/internal/errdefs"

func SetIdle(dir string, idle bool) error { return errdefs.ErrNotSupported }
func Idle(dir string) (bool, error)       { return false, errdefs.ErrNotSupported }
func CoreScheduling() CoreSched           { return CoreSched{Reason: "not Linux"} }
func ShareCookie(pid int) error           { return errdefs.ErrNotSupported }
