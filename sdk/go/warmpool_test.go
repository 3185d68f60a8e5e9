package dsec

import (
	"context"
	"errors"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

func (f *fakeService) SetWarmPool(ctx context.Context, r *connect.Request[dsecv1.SetWarmPoolRequest]) (*connect.Response[dsecv1.WarmPool], error) {
	resp, err := f.setWarmPool(ctx, r.Msg)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp), nil
}

func (f *fakeService) ListWarmPools(ctx context.Context, r *connect.Request[dsecv1.ListWarmPoolsRequest]) (*connect.Response[dsecv1.ListWarmPoolsResponse], error) {
	resp, err := f.listWarmPools(ctx)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp), nil
}

func TestSetWarmPool(t *testing.T) {
	var got *dsecv1.SetWarmPoolRequest
	f := &fakeService{setWarmPool: func(ctx context.Context, r *dsecv1.SetWarmPoolRequest) (*dsecv1.WarmPool, error) {
		got = r
		if len(r.GetSpec().GetNetworkRules()) > 0 {
			return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("sandboxes with network rules cannot be pooled"))
		}
		return &dsecv1.WarmPool{Key: "k1", Spec: r.GetSpec(), Size: r.GetSize(), Starting: r.GetSize(), Node: "n1"}, nil
	}}
	_, c := startFake(t, f)
	p, err := c.SetWarmPool(t.Context(), "busybox:test", 2, &CreateOptions{MemoryMB: 256, CPUs: 0.5, TTL: time.Minute,
		Env: map[string]string{"A": "b"}, Workdir: "/tmp"})
	if err != nil {
		t.Fatal(err)
	}
	spec := got.GetSpec()
	if got.GetSize() != 2 || spec.GetEnvironment() != "busybox:test" || spec.GetMemoryMb() != 256 || spec.GetCpus() != 0.5 ||
		spec.GetTtlSeconds() != 60 || spec.GetEnv()["A"] != "b" || spec.GetWorkdir() != "/tmp" {
		t.Fatalf("request = %v", got)
	}
	want := WarmPool{Key: "k1", Node: "n1", Environment: "busybox:test", Size: 2, Starting: 2}
	p.Spec = nil
	if *p != want {
		t.Fatalf("pool = %+v, want %+v", *p, want)
	}
	if _, err := c.SetWarmPool(t.Context(), "busybox:test", 0, nil); err != nil || got.GetSize() != 0 {
		t.Fatalf("size 0: %v (request %v)", err, got)
	}
	_, err = c.SetWarmPool(t.Context(), "busybox:test", 1, &CreateOptions{NetworkRules: map[string]bool{"pypi": true}})
	if !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("pool with network rules: %v, want ErrInvalidArgument", err)
	}
	if _, err := c.SetWarmPool(t.Context(), "busybox:test", -1, nil); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("negative size: %v, want ErrInvalidArgument", err)
	}
}

func TestWarmPools(t *testing.T) {
	f := &fakeService{listWarmPools: func(ctx context.Context) (*dsecv1.ListWarmPoolsResponse, error) {
		return &dsecv1.ListWarmPoolsResponse{Pools: []*dsecv1.WarmPool{
			{Key: "k1", Spec: &dsecv1.SandboxSpec{Environment: "busybox:test"}, Size: 3, Ready: 2, Starting: 1, Taken: 7, Missed: 1, Node: "n1"},
			{Key: "k2", Spec: &dsecv1.SandboxSpec{Environment: "alpine:3"}, Size: 1, LastError: "no such environment", Node: "n1"},
		}}, nil
	}}
	_, c := startFake(t, f)
	pools, err := c.WarmPools(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if len(pools) != 2 {
		t.Fatalf("got %d pools", len(pools))
	}
	p := pools[0]
	if p.Key != "k1" || p.Environment != "busybox:test" || p.Size != 3 || p.Ready != 2 || p.Starting != 1 ||
		p.Taken != 7 || p.Missed != 1 || p.Node != "n1" || p.Spec.GetEnvironment() != "busybox:test" {
		t.Fatalf("pool 0 = %+v", p)
	}
	if pools[1].LastError != "no such environment" || pools[1].Ready != 0 {
		t.Fatalf("pool 1 = %+v", pools[1])
	}
}

func TestFromWarmPool(t *testing.T) {
	f := &fakeService{create: func(ctx context.Context, r *dsecv1.CreateRequest) (*dsecv1.CreateResponse, error) {
		return &dsecv1.CreateResponse{Sandboxes: []*dsecv1.Sandbox{{Id: "sb-w-1", State: dsecv1.State_STATE_RUNNING, FromWarmPool: true}}}, nil
	}}
	_, c := startFake(t, f)
	sb, err := c.Create(t.Context(), "busybox:test", nil)
	if err != nil {
		t.Fatal(err)
	}
	if !sb.FromWarmPool() {
		t.Fatal("FromWarmPool = false, want true")
	}
	if c.Sandbox("sb-x").FromWarmPool() {
		t.Fatal("a bare handle says it came from a warm pool")
	}
}
