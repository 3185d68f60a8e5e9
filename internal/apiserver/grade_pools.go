package apiserver

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// Grade pools: clean rooms started ahead. A grade's clean room is a
// sandbox of the graded sandbox's spec on its own layers, with no network
// and labels of its own (grade.roomSpec); started for the grade it costs a
// create (~80 ms of runc on a loaded 2-core node) on the grade's critical
// path. With GradePool N, the first grade of a room shape on a node asks
// that node to keep N sandboxes of the shape ready (an ordinary warm pool,
// SetWarmPool on that edge), and every grade takes its room from there and
// has the edge lay the capture into it (SnapshotRequest.lay_into) instead of
// packing a layer; the pool refills in the background. A room is used
// once and deleted after the grade, as any clean room is.

// DefaultGradePool is dsecd --grade-pool's default: two rooms of each
// shape per node, so two grades at once both find one ready.
const DefaultGradePool = 2

const (
	// gradePoolRenew is how often a grade asks its node again to keep
	// its pool: an edge that restarted forgets its pools.
	gradePoolRenew = time.Minute
	// gradePoolIdle is how long a grade pool may go without a grade
	// before the next grade of any shape removes it.
	gradePoolIdle = 10 * time.Minute
)

// gradePools remembers which grade pools this apiserver set on which
// node, and when a grade last used each.
type gradePools struct {
	mu    sync.Mutex
	pools map[gradePoolKey]*gradePool
}

type gradePoolKey struct{ node, shape string }

type gradePool struct {
	spec      *dsecv1.SandboxSpec
	set, used time.Time
}

// gradeShape is what a room must share with a pool's to be taken from it:
// its spec but the labels other than its project's, and its lifetimes (the
// edge's warm pools match the same way).
func gradeShape(spec *dsecv1.SandboxSpec) (*dsecv1.SandboxSpec, string) {
	shape := proto.Clone(spec).(*dsecv1.SandboxSpec)
	shape.Labels = nil
	if p, ok := spec.GetLabels()[ProjectLabel]; ok {
		shape.Labels = map[string]string{ProjectLabel: p}
	}
	shape.TtlSeconds, shape.IdleTimeoutSeconds, shape.Phases = 0, 0, nil
	b, _ := proto.MarshalOptions{Deterministic: true}.Marshal(shape) // a valid message always marshals
	sum := sha256.Sum256(b)
	return shape, hex.EncodeToString(sum[:8])
}

// use notes a grade of shape on node and returns the pools to set (this
// one when it is new or due for renewal, size n) and to remove (those no
// grade used for gradePoolIdle, size 0).
func (g *gradePools) use(node string, spec *dsecv1.SandboxSpec, now time.Time) (set *dsecv1.SandboxSpec, drop []gradePoolKey, dropSpecs []*dsecv1.SandboxSpec) {
	shape, key := gradeShape(spec)
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.pools == nil {
		g.pools = map[gradePoolKey]*gradePool{}
	}
	k := gradePoolKey{node, key}
	p := g.pools[k]
	if p == nil {
		p = &gradePool{spec: shape}
		g.pools[k] = p
	}
	p.used = now
	if now.Sub(p.set) >= gradePoolRenew {
		p.set = now
		set = shape
	}
	drop, dropSpecs = g.idleLocked(now)
	return set, drop, dropSpecs
}

// idle forgets the pools no grade used for gradePoolIdle and returns them,
// to be removed from their nodes (size 0).
func (g *gradePools) idle(now time.Time) ([]gradePoolKey, []*dsecv1.SandboxSpec) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.idleLocked(now)
}

func (g *gradePools) idleLocked(now time.Time) (drop []gradePoolKey, dropSpecs []*dsecv1.SandboxSpec) {
	for k, p := range g.pools {
		if now.Sub(p.used) >= gradePoolIdle {
			drop, dropSpecs = append(drop, k), append(dropSpecs, p.spec)
			delete(g.pools, k)
		}
	}
	return drop, dropSpecs
}

// RunGradePools removes from their nodes the grade pools no grade used
// for gradePoolIdle, checking every gradePoolRenew until ctx ends, so a
// training run's rooms do not stay started on its nodes once it is over.
// A pool this apiserver set and did not remove before it died stays on its
// node until a grade of its shape there renews it (and it idles out again)
// or an operator removes it (`dsec pool rm`).
func (s *Server) RunGradePools(ctx context.Context) {
	t := time.NewTicker(gradePoolRenew)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			drop, specs := s.grades.idle(now)
			for i, k := range drop {
				s.setGradePool(ctx, k.node, specs[i], 0)
			}
		}
	}
}

// gradeRooms is the apiserver's grade.Rooms: clean rooms from grade
// pools, on the graded sandbox's node, and captures laid into them.
type gradeRooms struct{ s *Server }

// Room starts a clean room of spec on node, from the node's grade pool
// when it holds one ready, having asked the node to keep that pool (in the
// background: the refill is not the grade's). The room is charged to its
// project's quota as any create.
func (r gradeRooms) Room(ctx context.Context, node string, spec *dsecv1.SandboxSpec) (*dsecv1.Sandbox, error) {
	s := r.s
	set, drop, dropSpecs := s.grades.use(node, spec, time.Now())
	if set != nil || len(drop) > 0 {
		go func() {
			ctx := context.WithoutCancel(ctx)
			if set != nil {
				s.setGradePool(ctx, node, set, s.cfg.GradePool)
			}
			for i, k := range drop {
				s.setGradePool(ctx, k.node, dropSpecs[i], 0)
			}
		}()
	}
	batch := newBatch()
	h, err := s.charge(ctx, spec, 1, "batch:"+batch)
	if err != nil {
		return nil, err
	}
	sb, err := s.createOn(ctx, spec, node, createToken(batch, 0), "")
	s.settleHolds(ctx, h, err == nil)
	if err != nil {
		return nil, err
	}
	return sb, nil
}

// setGradePool asks node to keep size rooms of shape ready; a failure is
// logged, as grades go on without a pool.
func (s *Server) setGradePool(ctx context.Context, node string, shape *dsecv1.SandboxSpec, size int) {
	e, err := s.fleet.Edge(node)
	if err == nil {
		_, err = e.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: shape, Size: int32(size)}))
	}
	if err != nil {
		s.log.Warn("set grade pool", "node", node, "env", shape.GetEnvironment(), "size", size, "err", err)
		return
	}
	s.log.Debug("grade pool set", "node", node, "env", shape.GetEnvironment(), "size", size)
}

// Lay has the graded sandbox's node capture its paths and lay them into
// the clean room req.lay_into.
func (r gradeRooms) Lay(ctx context.Context, req *dsecv1.SnapshotRequest) (*dsecv1.SnapshotInfo, error) {
	e, err := r.s.edgeFor(req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	resp, err := e.Snapshot(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, fmt.Errorf("lay the capture into %s: %w", req.GetLayInto(), err)
	}
	return resp.Msg, nil
}
