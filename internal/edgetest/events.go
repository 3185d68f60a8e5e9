package edgetest

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// testEvents: a sandbox's life (created, paused, resumed, deleted) is in
// the node's event log in order, each event keyed NODE/EPOCH/SEQ with its
// project; Status names the log's epoch and last sequence number; a read
// from the last cursor brings nothing of it again, one of another epoch
// reads from the first kept. An edge without a log reports none.
func testEvents(t *testing.T, e *edge) {
	ctx := t.Context()
	status := func() *edgev1.NodeStatus {
		st, err := e.h.Status(ctx, connect.NewRequest(&edgev1.StatusRequest{}))
		if err != nil {
			t.Fatalf("Status: %v", err)
		}
		return st.Msg
	}
	read := func(epoch string, after uint64) *edgev1.EventsResponse {
		resp, err := e.h.Events(ctx, connect.NewRequest(&edgev1.EventsRequest{Epoch: epoch, After: after}))
		if err != nil {
			t.Fatalf("Events after %s/%d: %v", epoch, after, err)
		}
		return resp.Msg
	}
	before := status()
	spec := e.spec()
	spec.Labels["dsec.dev/project"] = "edgetest/events"
	resp, err := e.h.Create(ctx, connect.NewRequest(&edgev1.CreateRequest{Spec: spec, CreateToken: "edgetest-events#0@" + e.node}))
	if err != nil {
		t.Fatalf("Create: %v", err)
	}
	id := resp.Msg.GetId()
	if _, err := e.h.Pause(ctx, connect.NewRequest(&dsecv1.PauseRequest{SandboxId: id})); err != nil {
		t.Fatalf("Pause: %v", err)
	}
	if _, err := e.h.Resume(ctx, connect.NewRequest(&dsecv1.ResumeRequest{SandboxId: id})); err != nil {
		t.Fatalf("Resume: %v", err)
	}
	if err := e.delete(ctx, id); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	after := status()
	got := read(before.GetEventEpoch(), before.GetEventSeq())
	if e.o.NoEvents {
		if after.GetEventEpoch() != "" || after.GetEventSeq() != 0 || len(got.GetEvents()) != 0 {
			t.Fatalf("an edge without an event log: Status epoch %q seq %d, Events %v; want none", after.GetEventEpoch(), after.GetEventSeq(), got.GetEvents())
		}
		return
	}
	if after.GetEventEpoch() == "" || after.GetEventEpoch() != got.GetEpoch() || after.GetEventSeq() < before.GetEventSeq()+4 {
		t.Fatalf("Status before: epoch %q seq %d, after: %q %d, Events' epoch %q; want one epoch and 4 events more",
			before.GetEventEpoch(), before.GetEventSeq(), after.GetEventEpoch(), after.GetEventSeq(), got.GetEpoch())
	}
	var kinds []string
	last := before.GetEventSeq()
	for _, ev := range got.GetEvents() {
		want := fmt.Sprintf("%s/%s/", e.node, got.GetEpoch())
		seq, ok := strings.CutPrefix(ev.GetKey(), want)
		if !ok || seq != fmt.Sprint(last+1) {
			t.Fatalf("event key %q, want %s%d", ev.GetKey(), want, last+1)
		}
		last++
		if ev.GetSandboxId() != id {
			continue
		}
		kinds = append(kinds, ev.GetKind())
		if ev.GetProject() != "edgetest/events" || ev.GetNode() != e.node || ev.GetAtUnixMs() == 0 {
			t.Fatalf("event %v: want project edgetest/events, node %s and a time", ev, e.node)
		}
	}
	if want := []string{"created", "paused", "resumed", "deleted"}; !slices.Equal(kinds, want) {
		t.Fatalf("events of %s: %q, want %q", id, kinds, want)
	}
	if got.GetNext() != last || got.GetLost() != 0 {
		t.Fatalf("Events: next %d lost %d, want next %d, none lost", got.GetNext(), got.GetLost(), last)
	}
	for _, ev := range read(got.GetEpoch(), got.GetNext()).GetEvents() {
		if ev.GetSandboxId() == id {
			t.Fatalf("a read from the last cursor brought %v again", ev)
		}
	}
	all := read("another epoch", got.GetNext())
	if len(all.GetEvents()) == 0 || !strings.HasSuffix(all.GetEvents()[len(all.GetEvents())-1].GetKey(), fmt.Sprintf("/%d", all.GetNext())) {
		t.Fatalf("a read of another epoch brought %d events, next %d; want the log from its first kept", len(all.GetEvents()), all.GetNext())
	}
}
