package edgetest

import (
	"context"
	"errors"
	"slices"
	"testing"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// renamedEnv is what testRenameRef calls the suite's environment for a
// while.
const renamedEnv = "edgetest-renamed:1"

// testRenameRef: RenameRef moves a name onto what another names, the other
// going, and back; a name nothing has is NotFound, a malformed or missing
// one InvalidArgument. An edge that keeps no layers answers NotSupported.
func testRenameRef(t *testing.T, e *edge) {
	ctx := t.Context()
	rename := func(from, to string) error {
		_, err := e.h.RenameRef(ctx, connect.NewRequest(&edgev1.RenameRefRequest{From: from, To: to}))
		return err
	}
	if e.o.NoLayers {
		wantKind(t, "RenameRef on an edge without layers", rename(e.o.env(), renamedEnv), errdefs.ErrNotSupported)
		return
	}
	wantKind(t, "RenameRef of a name nothing has", rename("edgetest-none:1", renamedEnv), errdefs.ErrNotFound)
	wantKind(t, "RenameRef without a name", rename("", renamedEnv), errdefs.ErrInvalidArgument)
	wantKind(t, "RenameRef to a malformed name", rename(e.o.env(), "Not A Ref"), errdefs.ErrInvalidArgument)

	if err := rename(e.o.env(), renamedEnv); err != nil {
		t.Fatalf("RenameRef %s to %s: %v", e.o.env(), renamedEnv, err)
	}
	t.Cleanup(func() {
		// The other groups' sandboxes are made of the suite's environment.
		_, err := e.h.RenameRef(context.Background(), connect.NewRequest(&edgev1.RenameRefRequest{From: renamedEnv, To: e.o.env()}))
		if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("rename %s back to %s: %v", renamedEnv, e.o.env(), err)
		}
	})
	names := e.names(ctx)
	if !slices.Contains(names, renamedEnv) || slices.Contains(names, e.o.env()) {
		t.Errorf("after RenameRef %s to %s the edge lists %v", e.o.env(), renamedEnv, names)
	}
	wantKind(t, "RenameRef of the name that went", rename(e.o.env(), renamedEnv), errdefs.ErrNotFound)
	if err := rename(renamedEnv, e.o.env()); err != nil {
		t.Fatalf("RenameRef back: %v", err)
	}
	if names := e.names(ctx); !slices.Contains(names, e.o.env()) || slices.Contains(names, renamedEnv) {
		t.Errorf("after renaming back the edge lists %v", names)
	}
}

// names are the refs and images of the edge's layers.
func (e *edge) names(ctx context.Context) []string {
	e.t.Helper()
	resp, err := e.h.ListLayers(ctx, connect.NewRequest(&dsecv1.ListLayersRequest{}))
	if err != nil {
		e.t.Fatalf("ListLayers: %v", err)
	}
	var out []string
	for _, l := range resp.Msg.GetLayers() {
		out = append(out, l.GetRefs()...)
		out = append(out, l.GetImages()...)
	}
	return out
}
