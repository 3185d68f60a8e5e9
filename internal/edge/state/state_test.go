package state

import (
	"errors"
	"testing"

	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

func TestSaveLoadRemove(t *testing.T) {
	s, err := New(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	sb := &dsecv1.Sandbox{Id: "sb-n1-abc", Node: "n1", State: dsecv1.State_STATE_RUNNING,
		Spec: &dsecv1.SandboxSpec{Environment: "busybox:test", Labels: map[string]string{"job": "x"}}}
	if err := s.Save(sb); err != nil {
		t.Fatal(err)
	}
	sb.State = dsecv1.State_STATE_STOPPING
	if err := s.Save(sb); err != nil {
		t.Fatal(err)
	}
	got, err := s.Load(sb.Id)
	if err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(got, sb) {
		t.Fatalf("loaded %v, want %v", got, sb)
	}
	ids, err := s.IDs()
	if err != nil || len(ids) != 1 || ids[0] != sb.Id {
		t.Fatalf("IDs() = %v, %v; want [%s]", ids, err, sb.Id)
	}
	if err := s.Remove(sb.Id); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Load(sb.Id); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("after Remove: %v, want ErrNotFound", err)
	}
}

func TestToken(t *testing.T) {
	s, err := New(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if tok, err := s.Token("sb-n1-none"); err != nil || tok != "" {
		t.Fatalf("token of a sandbox without one: %q, %v", tok, err)
	}
	if err := s.SaveToken("sb-n1-abc", "0123456789abcdef#3@n1"); err != nil {
		t.Fatal(err)
	}
	if tok, err := s.Token("sb-n1-abc"); err != nil || tok != "0123456789abcdef#3@n1" {
		t.Fatalf("token: %q, %v", tok, err)
	}
	if err := s.Remove("sb-n1-abc"); err != nil {
		t.Fatal(err)
	}
	if tok, err := s.Token("sb-n1-abc"); err != nil || tok != "" {
		t.Fatalf("token after Remove: %q, %v", tok, err)
	}
}
