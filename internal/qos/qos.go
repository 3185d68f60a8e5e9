// Package qos holds a sandbox's CPU quality-of-service class and what the
// node does for each: a best-effort sandbox's cpu cgroup is marked idle
// (cpu.idle=1, SCHED_IDLE for the whole group, on cgroup v2 and on v1's cpu
// controller alike), so it runs only on CPU time a latency-sensitive sandbox
// leaves; a latency-sensitive sandbox may get a core-scheduling cookie where
// the CPU has SMT (see CoreScheduling). The backends call SetIdle on the cgroup
// that holds a sandbox's processes: a container's, gVisor's sentry's, a microVM's
// QEMU (its vCPU threads).
package qos

import (
	"fmt"

	"dsec.dev/dsec/internal/errdefs"
)

// Class is a sandbox's CPU quality-of-service class.
type Class string

const (
	// Latency sandboxes run at normal weight: a step of theirs must not slow
	// down because best-effort work shares the node.
	Latency Class = "latency"
	// BestEffort sandboxes run under SCHED_IDLE: they take only CPU time no
	// latency-sensitive sandbox wants.
	BestEffort Class = "best_effort"
)

// Parse reads a class as the API and CLI spell it; "" is def.
func Parse(s string, def Class) (Class, error) {
	switch Class(s) {
	case "":
		return def, nil
	case Latency, BestEffort:
		return Class(s), nil
	}
	return "", fmt.Errorf("qos %q: want %s or %s: %w", s, Latency, BestEffort, errdefs.ErrInvalidArgument)
}

// Idle reports whether the class runs its cgroup idle.
func (c Class) Idle() bool { return c == BestEffort }

// CoreSched is the node's report on core scheduling (PR_SCHED_CORE).
type CoreSched struct {
	// Available is true where the CPU has SMT active and the kernel gives
	// cookies; latency sandboxes then get one.
	Available bool
	// Reason says why it is not available ("" when it is).
	Reason string
}
