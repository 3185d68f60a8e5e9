package root

import (
	"bufio"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/eventlog"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
	dsec "dsec.dev/dsec/sdk/go"
)

// eventLine is an event as dsec --json events prints it.
type eventLine struct {
	ID        int64  `json:"id"`
	Key       string `json:"key"`
	Project   string `json:"project"`
	SandboxID string `json:"sandboxId"`
	Kind      string `json:"kind"`
	Reason    string `json:"reason"`
}

// TestEvents runs real sandboxes' lives and reads their events through the
// CLI and the Go SDK: in order (created, paused, resumed, deleted; created,
// expired with reason ttl), a follower (dsec events --follow) seeing them
// as they come, another project's events unseen; then the API's process
// is killed and started again (the apiserver alone in a cluster, the
// all-in-one dsecd whole) with a sandbox running: what was stored is
// stored once, and what happens after (its delete) arrives; last the
// node's dsecd is killed with an event not yet pulled, which arrives once
// it starts again.
func TestEvents(t *testing.T) {
	d := startDaemon(t)
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	st, err := store.Open(ctx, d.DB())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	node := iam.NodeAdmin()
	tokens := map[string]string{}
	for _, p := range []string{"ev-a", "ev-b"} {
		if _, err := st.CreateProject(ctx, node, p); err != nil {
			t.Fatal(err)
		}
		if _, err := st.CreatePrincipal(ctx, node, store.PrincipalSpec{Name: p + "-runner", Kind: store.KindService, Project: p}); err != nil {
			t.Fatal(err)
		}
		if err := st.Grant(ctx, node, p+"-runner", p, iam.Runner); err != nil {
			t.Fatal(err)
		}
		if tokens[p], _, err = st.MintToken(ctx, node, store.TokenSpec{Principal: p + "-runner", Project: p, Role: iam.Runner}); err != nil {
			t.Fatal(err)
		}
	}
	st.Close()
	client := func(tok string) *dsec.Client {
		c := sdkClient(t, d.Addr, tok)
		return c
	}
	a, b := client(tokens["ev-a"]), client(tokens["ev-b"])
	cli := func(tok string, args ...string) *exec.Cmd {
		cmd := exec.CommandContext(ctx, filepath.Join(d.Bin, "dsec"), append([]string{"--addr", d.Addr, "--json", "events"}, args...)...)
		cmd.Env = append(os.Environ(), "DSEC_TOKEN="+tok, "DSEC_TOKEN_FILE=")
		return cmd
	}
	// listAs is every event tok sees, as `dsec events --json` prints them.
	listAs := func(tok string) []eventLine {
		t.Helper()
		out, err := cli(tok).Output()
		if err != nil {
			t.Fatalf("dsec events: %v", err)
		}
		var resp struct {
			Events []eventLine `json:"events"`
		}
		if err := json.Unmarshal(out, &resp); err != nil {
			t.Fatalf("dsec events printed %q: %v", out, err)
		}
		return resp.Events
	}
	list := func() []eventLine { return listAs(tokens["ev-a"]) }
	kinds := func(evs []eventLine, id string) []string {
		var out []string
		for _, e := range evs {
			if e.SandboxID == id {
				out = append(out, e.Kind+":"+e.Reason)
			}
		}
		return out
	}
	waitKinds := func(id string, want []string) []eventLine {
		t.Helper()
		var evs []eventLine
		for deadline := time.Now().Add(30 * time.Second); ; {
			evs = list()
			if len(kinds(evs, id)) >= len(want) || time.Now().After(deadline) {
				break
			}
			time.Sleep(200 * time.Millisecond)
		}
		if got := kinds(evs, id); !slices.Equal(got, want) {
			t.Fatalf("dsec events of %s: %q, want %q", id, got, want)
		}
		return evs
	}

	// A follower in ev-a, from the start, through the CLI.
	follow := cli(tokens["ev-a"], "--follow")
	stdout, err := follow.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := follow.Start(); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var followed []eventLine
	readDone := make(chan struct{})
	go func() {
		defer close(readDone)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			var e eventLine
			if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
				t.Errorf("dsec events --follow printed %q: %v", sc.Text(), err)
				continue
			}
			mu.Lock()
			followed = append(followed, e)
			mu.Unlock()
		}
	}()
	stopFollow := func() {
		follow.Process.Kill()
		<-readDone
		follow.Wait()
	}
	defer stopFollow()

	sb, err := a.Create(ctx, env, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sb.Pause(ctx, false); err != nil {
		t.Fatal(err)
	}
	if _, err := sb.Resume(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sb.Delete(ctx); err != nil {
		t.Fatal(err)
	}
	short, err := a.Create(ctx, env, &dsec.CreateOptions{TTL: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	other, err := b.Create(ctx, env, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { other.Delete(context.WithoutCancel(ctx)) })

	life := []string{"created:", "paused:", "resumed:", "deleted:"}
	expiry := []string{"created:", "expired:ttl"}
	waitKinds(sb.ID, life)
	evs := waitKinds(short.ID, expiry)
	for _, e := range evs {
		if e.Project != "ev-a" || e.ID == 0 || e.Key == "" {
			t.Fatalf("ev-a's token sees %+v", e)
		}
	}
	// The Go SDK's page, for ev-b: its own sandbox only.
	bevs, _, err := b.Events(ctx, dsec.EventQuery{})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range bevs {
		if e.SandboxID != other.ID {
			t.Fatalf("ev-b's token sees %+v", e)
		}
	}
	if len(bevs) == 0 || bevs[0].Kind != dsec.EventCreated {
		t.Fatalf("ev-b's events: %+v, want its sandbox's created", bevs)
	}

	// The follower saw both lives as they came, nothing of ev-b's.
	for deadline := time.Now().Add(20 * time.Second); ; {
		mu.Lock()
		got := slices.Clone(followed)
		mu.Unlock()
		if slices.ContainsFunc(got, func(e eventLine) bool { return e.SandboxID == other.ID }) {
			t.Fatalf("ev-a's follower saw ev-b's sandbox: %+v", got)
		}
		if slices.Equal(kinds(got, sb.ID), life) && slices.Equal(kinds(got, short.ID), expiry) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("dsec events --follow saw %q and %q, want %q and %q", kinds(got, sb.ID), kinds(got, short.ID), life, expiry)
		}
		time.Sleep(100 * time.Millisecond)
	}
	stopFollow()

	// A restart with a sandbox running: nothing stored twice, and its
	// delete after the restart arrives.
	live, err := a.Create(ctx, env, nil)
	if err != nil {
		t.Fatal(err)
	}
	waitKinds(live.ID, []string{"created:"})
	before := list()
	d.RestartAPI()
	if err := live.Delete(ctx); err != nil {
		t.Fatal(err)
	}
	after := waitKinds(live.ID, []string{"created:", "deleted:"})
	if len(after) < len(before) || !slices.Equal(after[:len(before)], before) {
		t.Fatalf("events after the restart do not start with those before it:\nbefore %+v\nafter  %+v", before, after)
	}
	seen := map[string]bool{}
	for _, e := range after {
		if seen[e.Key] {
			t.Fatalf("event %s stored twice", e.Key)
		}
		seen[e.Key] = true
	}
	for _, id := range []string{sb.ID, short.ID} {
		if got := kinds(after, id); len(got) != len(kinds(before, id)) {
			t.Fatalf("the events of %s after the restart: %q", id, got)
		}
	}

	// The node's dsecd killed (SIGKILL) with an event in its log that no
	// apiserver pulled: started again on its root, the log goes on in its
	// epoch and the event arrives, once. In a cluster the apiserver is
	// stopped (SIGSTOP) while the edge records it and is killed, so it is
	// surely not pulled before; the all-in-one's apiserver is the node's
	// process, which pulls it within 250 ms: there it shows the epoch and
	// the numbers going on.
	doomed, err := a.Create(ctx, env, &dsec.CreateOptions{TTL: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	waitKinds(doomed.ID, []string{"created:"})
	resume := d.PauseAPI()
	defer resume()
	onDisk := func() bool {
		_, evs, err := eventlog.ReadDir(filepath.Join(d.Root, "events"))
		if err != nil {
			t.Fatalf("read the node's event log: %v", err)
		}
		return slices.ContainsFunc(evs, func(e *dsecv1.Event) bool {
			return e.GetSandboxId() == doomed.ID && e.GetKind() == eventlog.Expired
		})
	}
	for deadline := time.Now().Add(30 * time.Second); !onDisk(); time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the node's log on its disk has no expired event of %s", doomed.ID)
		}
	}
	d.KillNode()
	resume()
	d.StartNode()
	waitKinds(doomed.ID, []string{"created:", "expired:ttl"})
	// Every event the node recorded through both kills is stored once, in
	// one epoch, numbered from 1 without a gap.
	all := listAs(d.Token())
	var epoch string
	for i, e := range all {
		parts := strings.Split(e.Key, "/")
		if len(parts) != 3 || parts[0] != "t1" || (epoch != "" && parts[1] != epoch) || parts[2] != strconv.Itoa(i+1) {
			t.Fatalf("event %d of the node is %s, want t1/%s/%d: %+v", i+1, e.Key, epoch, i+1, all)
		}
		epoch = parts[1]
	}
}
