package placement

import (
	"context"
	"errors"

	"dsec.dev/dsec/internal/errdefs"
)

// Attempts is how many times one create may fail on a node before the
// apiserver gives up. Refusals (Refused) do not count.
const Attempts = 3

// Outcome is what the apiserver does after an edge answers a create.
type Outcome int

const (
	// Stop: the create succeeded, or failed in a way no other node would
	// change (the request is wrong, or the caller gave up). Return err.
	Stop Outcome = iota
	// Refused: the edge's admission said no (errdefs.ErrResourceExhausted):
	// it is full or short of memory right now. Place again without it; this
	// is the system working, not a failure, so it does not count.
	Refused
	// Failed: the node failed (unavailable, internal error, timed out, or it
	// lacks what it advertised). Place again without it; counts against
	// Attempts.
	Failed
)

// stops are the kinds that say the request itself is at fault: every node
// would answer the same.
var stops = []error{
	errdefs.ErrInvalidArgument,
	errdefs.ErrNotFound,
	errdefs.ErrAlreadyExists,
	errdefs.ErrFailedPrecondition,
	context.Canceled,
	context.DeadlineExceeded,
}

// Classify says what to do after an edge answered a create with err (after
// errdefs.FromConnect, so the kinds survive the wire).
func Classify(err error) Outcome {
	if err == nil {
		return Stop
	}
	if errors.Is(err, errdefs.ErrResourceExhausted) {
		return Refused
	}
	for _, kind := range stops {
		if errors.Is(err, kind) {
			return Stop
		}
	}
	return Failed
}

// Retry carries one create's tries across nodes. The zero value is ready:
//
//	var r placement.Retry
//	for {
//		nodes, err := p.Place(view, req, r.Exclude)
//		if err != nil {
//			return err // what ran out, typed
//		}
//		err = create(nodes[0])
//		p.Done(nodes[0], 1, err == nil)
//		if !r.Again(nodes[0], err) {
//			return err
//		}
//	}
//
// Every node tried is excluded from the rest of the request, refused or
// failed, so the loop ends: refusals at most once per node, failures after
// Attempts.
type Retry struct {
	Exclude  map[string]bool // nodes this request has tried; pass to Place
	Refusals int
	Failures int
}

// Again records node's answer err and reports whether to place again.
func (r *Retry) Again(node string, err error) bool {
	switch Classify(err) {
	case Stop:
		return false
	case Refused:
		r.Refusals++
	case Failed:
		r.Failures++
	}
	if r.Exclude == nil {
		r.Exclude = map[string]bool{}
	}
	r.Exclude[node] = true
	return r.Failures < Attempts
}
