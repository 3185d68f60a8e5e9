package placement

import (
	"fmt"
	"slices"
	"strings"

	"dsec.dev/dsec/internal/errdefs"
)

// Shortage names what ran out when Place finds no room.
type Shortage int

const (
	NoHealthyNode Shortage = iota + 1 // no node is healthy (or none is known)
	NoBackend                         // healthy nodes exist, none offers the backend
	AllTried                          // every healthy node offering it is excluded
	AllFull                           // every candidate is full
	TooLittleRoom                     // candidates have room, less than the batch
	TooBig                            // the batch is more than the candidates hold when empty
)

// Label is the shortage's name as a metric label: no_healthy_node,
// no_backend, all_tried, all_full, too_little_room or too_big.
func (s Shortage) Label() string {
	switch s {
	case NoHealthyNode:
		return "no_healthy_node"
	case NoBackend:
		return "no_backend"
	case AllTried:
		return "all_tried"
	case AllFull:
		return "all_full"
	case TooLittleRoom:
		return "too_little_room"
	case TooBig:
		return "too_big"
	}
	return "unknown"
}

// ExhaustedError is Place's answer when a request does not fit. Counts of
// sandboxes (Used, Capacity) are over the candidates, the healthy nodes
// offering Backend and not excluded, and include in-flight and recent
// placements. Its kind (Unwrap) says whether waiting can help: a caller
// retries ResourceExhausted (the SDKs' Overloaded), not the others.
type ExhaustedError struct {
	Shortage Shortage
	Backend  string   // the backend asked for, DefaultBackend for ""
	Count    int      // sandboxes asked for
	Nodes    int      // nodes in the view
	Healthy  int      // healthy nodes in the view
	Offering int      // healthy nodes offering Backend
	Excluded int      // of those, excluded by the caller
	Used     int      // sandboxes on the candidates
	Capacity int      // the candidates' capacity
	Offered  []string // backends healthy nodes offer, when Shortage is NoBackend
}

// Free is how many more sandboxes the candidates have room for.
func (e *ExhaustedError) Free() int { return e.Capacity - e.Used }

// Unwrap is the error's kind: errdefs.ErrUnavailable when no node is
// healthy (one may come back); errdefs.ErrFailedPrecondition when no
// healthy node offers the backend or the batch is more than the nodes hold
// even when empty (no wait makes it fit: the request or the fleet must
// change); else errdefs.ErrResourceExhausted (the nodes are full now, and
// a later try may fit).
func (e *ExhaustedError) Unwrap() error {
	switch e.Shortage {
	case NoHealthyNode:
		return errdefs.ErrUnavailable
	case NoBackend, TooBig:
		return errdefs.ErrFailedPrecondition
	}
	return errdefs.ErrResourceExhausted
}

// Full reports whether the shortage is of room on the nodes (full, or too
// little room for the batch), which a node's --max-sandboxes sets.
func (e *ExhaustedError) Full() bool {
	return e.Shortage == AllFull || e.Shortage == TooLittleRoom || e.Shortage == TooBig
}

func (e *ExhaustedError) Error() string {
	switch e.Shortage {
	case NoHealthyNode:
		if e.Nodes == 0 {
			return "no healthy node (no nodes are registered)"
		}
		return fmt.Sprintf("no healthy node (%s, none healthy)", plural(e.Nodes, "node"))
	case NoBackend:
		offered := "none"
		if len(e.Offered) > 0 {
			offered = strings.Join(e.Offered, ", ")
		}
		verb := "offer"
		if e.Healthy == 1 {
			verb = "offers"
		}
		return fmt.Sprintf("no healthy node offers %s sandboxes (%s %s %s)", e.Backend, plural(e.Healthy, "healthy node"), verb, offered)
	case AllTried:
		return fmt.Sprintf("every healthy node offering %s was already tried (%s)", e.Backend, plural(e.Excluded, "node"))
	case AllFull:
		if e.Excluded > 0 {
			return fmt.Sprintf("every healthy node offering %s is full or was already tried (%d full, %d of %d sandboxes; %d tried)",
				e.Backend, e.Offering-e.Excluded, e.Used, e.Capacity, e.Excluded)
		}
		return fmt.Sprintf("every healthy node offering %s is full (%s, %d of %d sandboxes)", e.Backend, plural(e.Offering, "node"), e.Used, e.Capacity)
	case TooBig:
		return fmt.Sprintf("a batch of %d %s sandboxes is more than the %s offering %s hold together even when empty (%d); make smaller batches",
			e.Count, e.Backend, plural(e.Offering, "healthy node"), e.Backend, e.Capacity)
	}
	tried := ""
	if e.Excluded > 0 {
		tried = fmt.Sprintf("; %d more already tried", e.Excluded)
	}
	return fmt.Sprintf("room for %d of %d %s sandboxes (%s offering %s, %d of %d sandboxes used%s)",
		e.Free(), e.Count, e.Backend, plural(e.Offering-e.Excluded, "healthy node"), e.Backend, e.Used, e.Capacity, tried)
}

func (e *ExhaustedError) shortage() Shortage {
	switch {
	case e.Healthy == 0:
		return NoHealthyNode
	case e.Offering == 0:
		return NoBackend
	case e.Offering == e.Excluded:
		return AllTried
	case e.Excluded == 0 && e.Count > e.Capacity:
		return TooBig
	case e.Used >= e.Capacity:
		return AllFull
	}
	return TooLittleRoom
}

// offered lists the backends the healthy nodes offer, sorted.
func offered(nodes []Node) []string {
	var out []string
	for _, n := range nodes {
		if n.Healthy {
			out = append(out, n.Backends...)
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}
