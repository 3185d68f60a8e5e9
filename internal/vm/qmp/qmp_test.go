package qmp

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeQEMU serves QMP on a Unix socket the way QEMU does: a greeting,
// capabilities negotiation, then one answer per command; stop and cont
// send their event (STOP, RESUME) before their answer, and quit closes the
// connection without one.
type fakeQEMU struct {
	path string
	ln   net.Listener

	mu       sync.Mutex
	running  bool
	commands []string
	silent   map[string]bool // commands never answered
	// migrations are query-migrate's answers, one per call, the last
	// repeated.
	migrations []string
}

func startFake(t *testing.T) *fakeQEMU {
	t.Helper()
	f := &fakeQEMU{path: filepath.Join(t.TempDir(), "qmp.sock"), running: true, silent: map[string]bool{}}
	ln, err := net.Listen("unix", f.path)
	if err != nil {
		t.Fatal(err)
	}
	f.ln = ln
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go f.serve(c)
		}
	}()
	t.Cleanup(func() { ln.Close(); <-done })
	return f
}

func (f *fakeQEMU) serve(c net.Conn) {
	defer c.Close()
	w := bufio.NewWriter(c)
	send := func(v any) {
		b, _ := json.Marshal(v)
		w.Write(append(b, '\n'))
		w.Flush()
	}
	send(map[string]any{"QMP": map[string]any{"version": map[string]any{}, "capabilities": []string{"oob"}}})
	sc := bufio.NewScanner(c)
	negotiated := false
	for sc.Scan() {
		var req struct {
			Execute   string          `json:"execute"`
			Arguments json.RawMessage `json:"arguments"`
			ID        json.RawMessage `json:"id"`
		}
		if err := json.Unmarshal(sc.Bytes(), &req); err != nil {
			return
		}
		f.mu.Lock()
		f.commands = append(f.commands, req.Execute)
		silent := f.silent[req.Execute]
		f.mu.Unlock()
		answer := func(ret any) { send(map[string]any{"return": ret, "id": req.ID}) }
		refuse := func(class, desc string) {
			send(map[string]any{"error": map[string]string{"class": class, "desc": desc}, "id": req.ID})
		}
		switch {
		case silent:
		case req.Execute == "qmp_capabilities":
			negotiated = true
			answer(map[string]any{})
		case !negotiated:
			refuse("CommandNotFound", "Expecting capabilities negotiation with 'qmp_capabilities'")
		case req.Execute == "query-status":
			f.mu.Lock()
			st := map[string]any{"running": f.running, "status": map[bool]string{true: "running", false: "paused"}[f.running]}
			f.mu.Unlock()
			answer(st)
		case req.Execute == "stop", req.Execute == "cont":
			f.mu.Lock()
			f.running = req.Execute == "cont"
			f.mu.Unlock()
			ev := map[string]any{"event": map[bool]string{true: "RESUME", false: "STOP"}[req.Execute == "cont"],
				"timestamp": map[string]int64{"seconds": 1, "microseconds": 2}}
			send(ev)
			answer(map[string]any{})
		case req.Execute == "query-migrate":
			f.mu.Lock()
			status := f.migrations[0]
			if len(f.migrations) > 1 {
				f.migrations = f.migrations[1:]
			}
			f.mu.Unlock()
			info := map[string]any{"status": status}
			if status == "failed" {
				info["error-desc"] = "Unable to write to file: No space left on device"
			}
			answer(info)
		case req.Execute == "quit":
			// QEMU closes the monitor as it exits, sometimes before the
			// answer leaves.
			return
		default:
			refuse("CommandNotFound", fmt.Sprintf("The command %s has not been found", req.Execute))
		}
	}
}

func TestClient(t *testing.T) {
	f := startFake(t)
	ctx := context.Background()
	c, err := Dial(ctx, f.path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	st, err := c.QueryStatus(ctx)
	if err != nil || st != (Status{Status: "running", Running: true}) {
		t.Fatalf("query-status = %+v, %v", st, err)
	}
	if err := c.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if ev := <-c.Events(); ev.Event != "STOP" || ev.Timestamp.Seconds != 1 {
		t.Errorf("event after stop = %+v", ev)
	}
	if st, err := c.QueryStatus(ctx); err != nil || st.Running || st.Status != "paused" {
		t.Errorf("query-status after stop = %+v, %v", st, err)
	}
	if err := c.Cont(ctx); err != nil {
		t.Fatal(err)
	}
	if ev := <-c.Events(); ev.Event != "RESUME" {
		t.Errorf("event after cont = %+v", ev)
	}

	err = c.Execute(ctx, "no-such-command", nil, nil)
	var qerr *Error
	if !errors.As(err, &qerr) || qerr.Class != "CommandNotFound" {
		t.Errorf("unknown command: %v, want a CommandNotFound *Error", err)
	}

	// Calls from many goroutines each get their own answer.
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			if st, err := c.QueryStatus(ctx); err != nil || !st.Running {
				t.Errorf("concurrent query-status = %+v, %v", st, err)
			}
		})
	}
	wg.Wait()

	if err := c.Quit(ctx); err != nil {
		t.Errorf("quit: %v", err)
	}
	<-c.Done()
	if err := c.Execute(ctx, "query-status", nil, nil); err == nil {
		t.Error("a command after the connection ended succeeded")
	}
	if _, open := <-c.Events(); open {
		t.Error("the events channel is open after the connection ended")
	}
}

// TestCommandEndsWithContext: a QEMU that never answers does not hold the
// caller past its context, and the client stays usable.
func TestCommandEndsWithContext(t *testing.T) {
	f := startFake(t)
	f.silent["query-block"] = true
	c, err := Dial(context.Background(), f.path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := c.Execute(ctx, "query-block", nil, nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("unanswered command: %v, want context.DeadlineExceeded", err)
	}
	if _, err := c.QueryStatus(context.Background()); err != nil {
		t.Errorf("query-status after an unanswered command: %v", err)
	}
}

func TestDialRefusesNonQMP(t *testing.T) {
	path := filepath.Join(t.TempDir(), "not-qmp.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		c.Write([]byte("{\"hello\": 1}\n"))
		c.Close()
	}()
	if c, err := Dial(context.Background(), path); err == nil {
		c.Close()
		t.Error("Dial accepted a server that sent no QMP greeting")
	}
}

// WaitMigration polls until the migration ends, and says why one failed.
func TestWaitMigration(t *testing.T) {
	for _, tc := range []struct {
		statuses []string
		fails    string
	}{
		{[]string{"setup", "active", "active", "completed"}, ""},
		{[]string{"active", "failed"}, "No space left on device"},
		{[]string{"cancelled"}, "cancelled"},
	} {
		f := startFake(t)
		f.migrations = tc.statuses
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		c, err := Dial(ctx, f.path)
		if err != nil {
			t.Fatal(err)
		}
		info, err := c.WaitMigration(ctx)
		switch {
		case tc.fails == "" && (err != nil || info.Status != "completed"):
			t.Errorf("WaitMigration over %q = %+v, %v; want completed", tc.statuses, info, err)
		case tc.fails != "" && (err == nil || !strings.Contains(err.Error(), tc.fails)):
			t.Errorf("WaitMigration over %q = %v, want an error saying %q", tc.statuses, err, tc.fails)
		}
		c.Close()
		cancel()
	}
}
