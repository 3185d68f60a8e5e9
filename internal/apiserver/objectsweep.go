package apiserver

import (
	"context"
	"time"
)

const (
	// A record a call claimed anew and never filled (it died before it
	// recorded its blobs) is swept once its claim lapsed objectSweepAfter
	// ago: far past any deadline a call still works to, so nothing a slow
	// call still does is touched. Each apiserver looks every
	// objectSweepEvery (Reconcile).
	objectSweepAfter = time.Hour
	objectSweepEvery = 10 * time.Minute
)

// sweepObjects removes the records of layers, images and snapshots that
// calls claimed anew and died before they filled (no blobs, a claim that
// lapsed objectSweepAfter before now), which kept their names taken until
// removed by hand. A record whose name a node holds is left alone: what
// the node holds (a snapshot taken by a call that died before recording
// it, a layer made under its name) would pass to the root with the record
// gone; its project sees it and removes it (dsec layer rm, dsec snapshot
// rm). So it runs only when every node of the fleet answers, as the quota
// sweep does. The store checks each record again as it removes it, so a
// call that took the name meanwhile keeps it, and two apiservers sweeping
// at once remove each record once. A staging ref the dead call left is
// removed from the nodes too.
func (s *Server) sweepObjects(ctx context.Context, now time.Time) {
	if s.cfg.Objects == nil {
		return
	}
	before := now.Add(-objectSweepAfter)
	lapsed, err := s.cfg.Objects.LapsedObjects(ctx, before)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Warn("list the records of calls that died", "err", err)
		}
		return
	}
	if len(lapsed) == 0 {
		return
	}
	nodes := s.fleet.Nodes()
	if len(nodes) == 0 {
		return // no fleet seen yet: a node may hold the names
	}
	for _, n := range nodes {
		if !n.Healthy {
			return // its names cannot be read
		}
	}
	layers, err := (&layerService{s: s}).allLayers(ctx)
	if err != nil {
		s.log.Warn("list layers to sweep the records of calls that died", "err", err)
		return
	}
	held := map[string]bool{}
	for _, l := range layers {
		for _, name := range layerNames(l) {
			held[name] = true
		}
	}
	for _, o := range lapsed {
		if ref := stagingRef(o.Writer); held[ref] {
			s.dropStaging(ctx, ref)
		}
		if held[o.Name] {
			continue
		}
		swept, err := s.cfg.Objects.SweepObject(ctx, o.Name, before)
		s.objects.drop(o.Name)
		switch {
		case err != nil:
			s.log.Warn("sweep the record of a call that died", "name", o.Name, "err", err)
		case swept:
			s.log.Info("removed the record a call that died claimed and never filled", "name", o.Name, "kind", o.Kind,
				"project", o.Project, "writer", o.Writer, "lapsed", o.WriterUntil)
		}
	}
}
