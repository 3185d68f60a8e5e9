package apiserver

import (
	"context"
	"errors"
	"slices"
	"sync/atomic"
	"time"

	"golang.org/x/sync/singleflight"

	"dsec.dev/dsec/internal/placement"
)

// refresher is a fleet that can poll its nodes outside its rounds: the
// watcher. A fixed fleet (the all-in-one) has no reports to refresh.
type refresher interface {
	Refresh(ctx context.Context, names []string)
}

// minRefresh spaces the refreshes placement asks for before refusing a
// create as full. In a full cluster every create is refused: without it
// each would poll every node.
const minRefresh = 250 * time.Millisecond

// fullRefresh shares one refresh among the creates refused at once.
type fullRefresh struct {
	group singleflight.Group
	last  atomic.Int64 // when the last refresh ended, Unix ns
}

// shortOfRoom reports whether placement refused for want of room that a
// node may have made since its last report: every node full, or too little
// room left for the batch (not a batch larger than the nodes hold).
func shortOfRoom(err error) bool {
	var ex *placement.ExhaustedError
	return errors.As(err, &ex) && (ex.Shortage == placement.AllFull || ex.Shortage == placement.TooLittleRoom)
}

// refreshFull polls the healthy nodes offering backend now, so that room
// made since their last reports (a delete, a warm pool shrinking, a
// sandbox's TTL) is seen before a create is refused, not a round later.
// The view is rebuilt from the new reports. It reports whether it polled:
// false when the fleet cannot, or a refresh ended less than minRefresh
// ago (the view already holds its reports).
func (s *Server) refreshFull(ctx context.Context, backend string) bool {
	r, ok := s.fleet.(refresher)
	if !ok || time.Since(time.Unix(0, s.refresh.last.Load())) < minRefresh {
		return false
	}
	// Every create refused meanwhile waits for this one refresh; it
	// outlives the first caller's cancellation (each poll has its own
	// timeout).
	s.refresh.group.Do(backend, func() (any, error) {
		var names []string
		for _, n := range s.placementView() {
			if n.Healthy && slices.Contains(n.Backends, backend) {
				names = append(names, n.Name)
			}
		}
		r.Refresh(context.WithoutCancel(ctx), names)
		s.view.Store(nil)
		s.refresh.last.Store(time.Now().UnixNano())
		s.log.Debug("refreshed full nodes before refusing a create", "backend", backend, "nodes", len(names))
		return nil, nil
	})
	return true
}
