package cli

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// eventsFake answers ListEvents as the apiserver does: the events after
// the cursor, oldest first, at most the limit (0: 1,000), and the cursor
// after them.
type eventsFake struct {
	fakeSandboxes
	ids []int64
}

func (f *eventsFake) ListEvents(_ context.Context, r *connect.Request[dsecv1.ListEventsRequest]) (*connect.Response[dsecv1.ListEventsResponse], error) {
	f.got(r.Msg)
	limit := int(r.Msg.GetLimit())
	if limit <= 0 || limit > eventsPage {
		limit = eventsPage
	}
	out := &dsecv1.ListEventsResponse{Next: r.Msg.GetAfter()}
	for _, id := range f.ids {
		if id > r.Msg.GetAfter() && len(out.Events) < limit {
			out.Events = append(out.Events, &dsecv1.Event{Id: id, Kind: "created", SandboxId: "sb-n1-a"})
			out.Next = id
		}
	}
	return connect.NewResponse(out), nil
}

// TestEventsPages: dsec events --limit N prints N events and, when more
// follow, the --after of the next page on stderr; given back, it prints
// that page; the last page says nothing of another, nor does a listing
// that is all there is.
func TestEventsPages(t *testing.T) {
	f := &eventsFake{}
	for id := int64(1); id <= 2500; id += 2 { // 1250 events, IDs with gaps
		f.ids = append(f.ids, id)
	}
	addr := startHandler(t, f)
	ids := func(out string) []string {
		var got []string
		for _, line := range strings.Split(strings.TrimSpace(out), "\n")[1:] {
			got = append(got, strings.Fields(line)[0])
		}
		return got
	}
	var seen []string
	after := ""
	for page := 0; ; page++ {
		args := []string{"events", "--limit", "400"}
		if after != "" {
			args = append(args, "--after", after)
		}
		out, stderr, err := runCLIErr(t, addr, args...)
		if err != nil {
			t.Fatal(err)
		}
		got := ids(out)
		seen = append(seen, got...)
		_, next, ok := strings.Cut(strings.TrimSpace(stderr), "--after ")
		if page < 3 {
			if len(got) != 400 || !ok || next != got[len(got)-1] {
				t.Fatalf("page %d: %d events, stderr %q: want 400 and --after %s", page, len(got), stderr, got[len(got)-1])
			}
			after = next
			continue
		}
		if len(got) != 50 || stderr != "" {
			t.Fatalf("the last page: %d events, stderr %q: want 50 and no next page", len(got), stderr)
		}
		break
	}
	var want []string
	for _, id := range f.ids {
		want = append(want, strconv.FormatInt(id, 10))
	}
	if !slices.Equal(seen, want) {
		t.Errorf("the pages held %d events (%s ... %s), want the 1250 once each in order", len(seen), seen[0], seen[len(seen)-1])
	}
	// A limit beyond the server's page of 1,000 is still cut where asked.
	out, stderr, err := runCLIErr(t, addr, "events", "--limit", "1100")
	if err != nil {
		t.Fatal(err)
	}
	if got := ids(out); len(got) != 1100 || got[1099] != "2199" || !strings.Contains(stderr, "--after 2199") {
		t.Errorf("--limit 1100: %d events, stderr %q", len(got), stderr)
	}
	// All there is: no next page.
	out, stderr, err = runCLIErr(t, addr, "events")
	if got := ids(out); err != nil || len(got) != 1250 || stderr != "" {
		t.Errorf("dsec events: %d events, stderr %q, %v", len(got), stderr, err)
	}
	// --json carries the cursor as next.
	out, _, err = runCLIErr(t, addr, "--json", "events", "--limit", "2", "--after", "10")
	if err != nil || !strings.Contains(out, `"next": 13`) {
		t.Errorf("dsec --json events --limit 2 --after 10: %v\n%s", err, out)
	}
}
