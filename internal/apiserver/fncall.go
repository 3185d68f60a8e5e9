package apiserver

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/outcome"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/watcher"
)

// FnCallPoolLabel marks the fncall backend's pooled containers (the
// edge's fncall.PoolLabel): List leaves them out unless asked for them by
// this label.
const FnCallPoolLabel = "dsec.fncall/pool"

// callHops bounds how many nodes one call is tried on when nodes are full
// or gone.
const callHops = 3

// callChoices is how many fncall nodes a call samples (power of k
// choices) before taking the least loaded.
const callChoices = 2

// maxCallMessage bounds one FnCallService request: a batch of calls with
// their files.
const maxCallMessage = 512 << 20

// maxBatchCalls bounds the calls of one RunCodeBatch.
const maxBatchCalls = 4096

// batchConcurrency bounds the calls of one batch sent at once.
const batchConcurrency = 256

// fnService serves FnCallService: calls placed on the fleet's fncall
// nodes, by their reported load plus this apiserver's calls in flight to
// each.
type fnService struct {
	s        *Server
	inflight sync.Map // node name → *atomic.Int64
}

func (f *fnService) flight(node string) *atomic.Int64 {
	v, _ := f.inflight.LoadOrStore(node, new(atomic.Int64))
	return v.(*atomic.Int64)
}

// fnNodes are the healthy nodes that run fncall calls.
func (f *fnService) fnNodes(skip map[string]bool) []watcher.Node {
	var out []watcher.Node
	for _, n := range f.s.routable() {
		if skip[n.Name] {
			continue
		}
		st := n.Status
		if st == nil {
			// A fixed fleet (the all-in-one node) is not polled.
			out = append(out, n)
			continue
		}
		for _, b := range st.GetBackends() {
			if b == dsecv1.Backend_BACKEND_FNCALL {
				out = append(out, n)
				break
			}
		}
	}
	return out
}

func (f *fnService) load(n watcher.Node) int64 {
	l := f.flight(n.Name).Load()
	if st := n.Status; st != nil {
		// What the node reported is partly this apiserver's in flight too;
		// counting both only errs on the side of spreading.
		l += int64(st.GetFncallQueue()) + int64(st.GetFncallBusy())/2
	}
	return l
}

// pick samples callChoices nodes and returns the least loaded.
func (f *fnService) pick(skip map[string]bool) (watcher.Node, bool) {
	nodes := f.fnNodes(skip)
	if len(nodes) == 0 {
		return watcher.Node{}, false
	}
	best := nodes[rand.IntN(len(nodes))]
	for range callChoices - 1 {
		n := nodes[rand.IntN(len(nodes))]
		if f.load(n) < f.load(best) {
			best = n
		}
	}
	return best, true
}

// RunCode runs one call on a fncall node: a node whose queue is full or
// that is gone is left for another, up to callHops nodes.
func (s *Server) RunCode(ctx context.Context, req *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
	return s.fn.runCode(ctx, req)
}

func (f *fnService) runCode(ctx context.Context, req *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
	if env := req.GetEnvironment(); env != "" {
		// Another project's layers are not the caller's to run in.
		if err := f.s.usable(ctx, env); err != nil {
			return nil, err
		}
	}
	h, err := f.s.chargeCall(ctx)
	if err != nil {
		return nil, err
	}
	defer f.s.settleHolds(ctx, h, false)
	var out *dsecv1.RunCodeResponse
	err = f.tryNodes("run code", func(node string, e watcher.Edge) (bool, error) {
		c := f.flight(node)
		c.Add(1)
		resp, err := e.RunCode(ctx, connect.NewRequest(req))
		c.Add(-1)
		if err == nil {
			out = resp.Msg
			f.s.usage.countCall(callerProject(ctx))
			return false, nil
		}
		again := ctx.Err() == nil && (errors.Is(err, errdefs.ErrResourceExhausted) || errors.Is(err, errdefs.ErrUnavailable))
		return again, err
	})
	return out, err
}

// tryNodes calls try on fncall nodes, each picked by load from a sample,
// up to callHops of them, until a call succeeds or try says not to go on
// (its error then stands); the last error otherwise.
func (f *fnService) tryNodes(what string, try func(node string, e watcher.Edge) (again bool, err error)) error {
	tried := map[string]bool{}
	var last error
	for range callHops {
		n, ok := f.pick(tried)
		if !ok {
			break
		}
		tried[n.Name] = true
		e, err := f.s.fleet.Edge(n.Name)
		if err != nil {
			last = err
			continue
		}
		again, err := try(n.Name, e)
		if err == nil || !again {
			return err
		}
		last = err
	}
	if last == nil {
		return fmt.Errorf("%s: no healthy node runs the fncall backend: %w", what, errdefs.ErrUnavailable)
	}
	return last
}

func (f *fnService) RunCode(ctx context.Context, req *connect.Request[dsecv1.RunCodeRequest]) (*connect.Response[dsecv1.RunCodeResponse], error) {
	resp, err := f.runCode(ctx, req.Msg)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp), nil
}

// RunCodeBatch runs every call at once (batchConcurrency at a time) and
// answers each in order; a call that could not be run answers with status
// SANDBOX_ERROR and the reason.
func (f *fnService) RunCodeBatch(ctx context.Context, req *connect.Request[dsecv1.RunCodeBatchRequest]) (*connect.Response[dsecv1.RunCodeBatchResponse], error) {
	calls := req.Msg.GetCalls()
	if len(calls) > maxBatchCalls {
		return nil, fmt.Errorf("run code batch: %d calls, over the %d one batch may hold: %w", len(calls), maxBatchCalls, errdefs.ErrInvalidArgument)
	}
	out := make([]*dsecv1.RunCodeResponse, len(calls))
	sem := make(chan struct{}, batchConcurrency)
	var wg sync.WaitGroup
	for i, c := range calls {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			resp, err := f.runCode(ctx, c)
			if err != nil {
				resp = &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_SANDBOX_ERROR, Message: err.Error(), Fault: outcome.Of(err)}
			}
			out[i] = resp
		}()
	}
	wg.Wait()
	return connect.NewResponse(&dsecv1.RunCodeBatchResponse{Results: out}), nil
}

func (f *fnService) ListLanguages(ctx context.Context, req *connect.Request[dsecv1.ListLanguagesRequest]) (*connect.Response[dsecv1.ListLanguagesResponse], error) {
	var out *connect.Response[dsecv1.ListLanguagesResponse]
	err := f.tryNodes("list languages", func(_ string, e watcher.Edge) (bool, error) {
		resp, err := e.ListLanguages(ctx, req)
		out = resp
		return true, err
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// chargeCall charges a FnCall call about to run to its caller's project
// (the token's; the root for the node's administrator) as one call in
// flight, held until it ends, when a limit applies to it there. A refusal
// is the store's ResourceExhausted ("quota of project ml: 8 of 8 FnCall
// calls in flight").
// callerProject is the project a call runs in: its token's ("" the root,
// for the node's administrator).
func callerProject(ctx context.Context) string {
	if a, ok := iam.AuthorityFrom(ctx); ok && !a.Node {
		return a.Project
	}
	return ""
}

func (s *Server) chargeCall(ctx context.Context) (held, error) {
	if s.cfg.Quotas == nil {
		return nil, nil
	}
	project := callerProject(ctx)
	limits, err := s.limited(ctx, project)
	if err != nil || !limits[store.FnCallInflight] {
		return nil, err
	}
	one := store.Amounts{store.FnCallInflight: 1}
	id := "call:" + newBatch()
	if err := s.charges.charge(ctx, s.cfg.Quotas, project, one, []store.Hold{{ID: id, Amounts: one, Expires: holdUntil(ctx)}}); err != nil {
		return nil, err
	}
	return held{id}, nil
}
