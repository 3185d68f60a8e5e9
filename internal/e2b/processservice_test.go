package e2b

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	processpb "dsec.dev/dsec/api/gen/e2b/process"
	"dsec.dev/dsec/api/gen/e2b/process/processpbconnect"
)

// sdkHeaders adds what E2B's SDK sends on every envd call.
type sdkHeaders struct{ h *Handler }

func (s sdkHeaders) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("E2b-Sandbox-Id", SandboxID(fakeSandbox))
	r.Header.Set("E2b-Sandbox-Port", EnvdPort)
	r.Header.Set("X-Access-Token", s.h.cfg.Signer.AccessToken(fakeSandbox))
	return http.DefaultTransport.RoundTrip(r)
}

func fakeClient(t *testing.T) (processpbconnect.ProcessClient, *fakeDsec, *Handler) {
	url, fake, h := startFake(t)
	return processpbconnect.NewProcessClient(&http.Client{Transport: sdkHeaders{h}}, url, connect.WithProtoJSON()), fake, h
}

// collected is what a stream said.
type collected struct {
	pid   uint32
	out   string
	end   *processpb.ProcessEvent_EndEvent
	err   error
	kinds []string
}

type eventStream[T interface {
	GetEvent() *processpb.ProcessEvent
}] interface {
	Receive() bool
	Msg() T
	Err() error
}

// read reads one event (not a keepalive) into c; false at the stream's end.
func read[T interface {
	GetEvent() *processpb.ProcessEvent
}](s eventStream[T], c *collected) bool {
	for s.Receive() {
		switch ev := s.Msg().GetEvent().GetEvent().(type) {
		case *processpb.ProcessEvent_Start:
			c.pid = ev.Start.GetPid()
			c.kinds = append(c.kinds, "start")
		case *processpb.ProcessEvent_Data:
			c.out += string(ev.Data.GetStdout()) + string(ev.Data.GetStderr()) + string(ev.Data.GetPty())
			c.kinds = append(c.kinds, "data")
		case *processpb.ProcessEvent_End:
			c.end = ev.End
			c.kinds = append(c.kinds, "end")
		default:
			continue
		}
		return true
	}
	c.err = s.Err()
	return false
}

func readUntil[T interface {
	GetEvent() *processpb.ProcessEvent
}](t *testing.T, s eventStream[T], c *collected, want string) {
	t.Helper()
	for !strings.Contains(c.out, want) {
		if !read(s, c) {
			t.Fatalf("the stream ended before %q: %+v", want, c)
		}
	}
}

func sel(pid uint32) *processpb.ProcessSelector {
	return &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: pid}}
}

func TestServiceStartEcho(t *testing.T) {
	c, fake, h := fakeClient(t)
	s, err := c.Start(context.Background(), connect.NewRequest(&processpb.StartRequest{
		Process: &processpb.ProcessConfig{Cmd: "echo", Args: []string{"hi"}}, Stdin: proto.Bool(false)}))
	if err != nil {
		t.Fatal(err)
	}
	var got collected
	for read(s, &got) {
	}
	if got.err != nil || got.out != "hi\n" || got.end.GetStatus() != "exit status 0" || strings.Join(got.kinds, ",") != "start,data,end" {
		t.Fatalf("echo: %+v", got)
	}
	if e := fake.execs[0]; !e.GetBackground() || e.GetKeepStdinOpen() || e.GetUser() != "user" {
		t.Fatalf("the exec asked of dsec: %v", e)
	}
	if h.procs.get(fakeSandbox, got.pid) != nil {
		t.Fatal("an ended command stays in the table")
	}
	_, err = c.Start(context.Background(), connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{}}))
	if err == nil {
		s, _ := c.Start(context.Background(), connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{}}))
		var e collected
		read(s, &e)
		err = e.err
	}
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("no cmd: %v", err)
	}
}

func TestServiceBackgroundConnect(t *testing.T) {
	c, _, _ := fakeClient(t)
	ctx, cancel := context.WithCancel(context.Background())
	s, err := c.Start(ctx, connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "cat"}, Tag: proto.String("job")}))
	if err != nil {
		t.Fatal(err)
	}
	var first collected
	if !read(s, &first) {
		t.Fatalf("no start: %+v", first)
	}
	pid := first.pid
	input := func(text string) {
		t.Helper()
		if _, err := c.SendInput(context.Background(), connect.NewRequest(&processpb.SendInputRequest{Process: sel(pid),
			Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Stdin{Stdin: []byte(text)}}})); err != nil {
			t.Fatal(err)
		}
	}
	input("old ")
	readUntil(t, s, &first, "old ")
	cancel()

	list, err := c.List(context.Background(), connect.NewRequest(&processpb.ListRequest{}))
	if err != nil || len(list.Msg.GetProcesses()) != 1 || list.Msg.GetProcesses()[0].GetTag() != "job" || list.Msg.GetProcesses()[0].GetConfig().GetCmd() != "cat" {
		t.Fatalf("list: %v %v", list, err)
	}
	cs, err := c.Connect(context.Background(), connect.NewRequest(&processpb.ConnectRequest{
		Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Tag{Tag: "job"}}}))
	if err != nil {
		t.Fatal(err)
	}
	var got collected
	if !read(cs, &got) || got.pid != pid {
		t.Fatalf("connect: %+v", got)
	}
	input("new")
	if _, err := c.CloseStdin(context.Background(), connect.NewRequest(&processpb.CloseStdinRequest{Process: sel(pid)})); err != nil {
		t.Fatal(err)
	}
	for read(cs, &got) {
	}
	if got.out != "new" || got.end.GetExitCode() != 0 || got.err != nil {
		t.Fatalf("connected from now on: %+v", got)
	}
	late, err := c.Connect(context.Background(), connect.NewRequest(&processpb.ConnectRequest{Process: sel(pid)}))
	if err != nil {
		t.Fatal(err)
	}
	var l collected
	for read(late, &l) {
	}
	if strings.Join(l.kinds, ",") != "start,end" || l.err != nil {
		t.Fatalf("connect after the exit: %+v", l)
	}
}

func TestServiceKill(t *testing.T) {
	c, _, _ := fakeClient(t)
	s, err := c.Start(context.Background(), connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "sleep"}}))
	if err != nil {
		t.Fatal(err)
	}
	var got collected
	read(s, &got)
	kill := func() error {
		_, err := c.SendSignal(context.Background(), connect.NewRequest(&processpb.SendSignalRequest{Process: sel(got.pid), Signal: processpb.Signal_SIGNAL_SIGKILL}))
		return err
	}
	if err := kill(); err != nil {
		t.Fatal(err)
	}
	for read(s, &got) {
	}
	if got.end.GetStatus() != "signal: killed" || got.end.GetExitCode() != -1 || got.end.GetExited() {
		t.Fatalf("killed: %+v", got)
	}
	if err := kill(); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("kill again: %v", err)
	}
	_, err = c.SendSignal(context.Background(), connect.NewRequest(&processpb.SendSignalRequest{Process: sel(got.pid)}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("no signal: %v", err)
	}
}

func TestServicePTY(t *testing.T) {
	c, _, h := fakeClient(t)
	start := &processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-i", "-l"}},
		Pty: &processpb.PTY{Size: &processpb.PTY_Size{Cols: 80, Rows: 24}}}
	s, err := c.Start(context.Background(), connect.NewRequest(start))
	if err != nil {
		t.Fatal(err)
	}
	var a collected
	if !read(s, &a) || a.pid == 0 {
		t.Fatalf("pty start: %+v", a)
	}
	cs, err := c.Connect(context.Background(), connect.NewRequest(&processpb.ConnectRequest{Process: sel(a.pid)}))
	if err != nil {
		t.Fatal(err)
	}
	var b collected
	read(cs, &b)
	type call struct {
		name string
		err  error
	}
	input := func(text string) error {
		_, err := c.SendInput(context.Background(), connect.NewRequest(&processpb.SendInputRequest{Process: sel(a.pid),
			Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Pty{Pty: []byte(text)}}}))
		return err
	}
	if err := input("ls\n"); err != nil {
		t.Fatal(err)
	}
	readUntil(t, s, &a, "ls\n")
	readUntil(t, cs, &b, "ls\n") // both streams get it
	if _, err := c.Update(context.Background(), connect.NewRequest(&processpb.UpdateRequest{Process: sel(a.pid),
		Pty: &processpb.PTY{Size: &processpb.PTY_Size{Cols: 100, Rows: 30}}})); err != nil {
		t.Fatal(err)
	}
	readUntil(t, s, &a, "size 30 100")
	for _, bad := range []call{
		{"stdin to a terminal", func() error {
			_, err := c.SendInput(context.Background(), connect.NewRequest(&processpb.SendInputRequest{Process: sel(a.pid),
				Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Stdin{Stdin: []byte("x")}}}))
			return err
		}()},
		{"close a terminal's stdin", func() error {
			_, err := c.CloseStdin(context.Background(), connect.NewRequest(&processpb.CloseStdinRequest{Process: sel(a.pid)}))
			return err
		}()},
	} {
		if connect.CodeOf(bad.err) != connect.CodeFailedPrecondition {
			t.Errorf("%s: %v, want failed_precondition", bad.name, bad.err)
		}
	}
	if err := input("exit\n"); err != nil {
		t.Fatal(err)
	}
	for read(s, &a) {
	}
	for read(cs, &b) {
	}
	if a.end.GetStatus() != "exit status 0" || b.end.GetStatus() != "exit status 0" || a.err != nil || b.err != nil {
		t.Fatalf("ends: %+v %+v", a, b)
	}
	if err := input("x"); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("input after the exit: %v", err)
	}
	if h.procs.get(fakeSandbox, a.pid) == nil {
		t.Fatal("an ended terminal left the table at once (Connect answers it for a while)")
	}

	start.Process.Cwd = proto.String("/nonexistent")
	s, err = c.Start(context.Background(), connect.NewRequest(start))
	if err == nil {
		var e collected
		read(s, &e)
		err = e.err
	}
	if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "no such file") {
		t.Fatalf("terminal in a missing cwd: %v", err)
	}
}

// TestServiceConcurrent runs commands and terminals side by side: each
// terminal must find its own process, each command its own output.
func TestServiceConcurrent(t *testing.T) {
	c, _, _ := fakeClient(t)
	var wg sync.WaitGroup
	errs := make(chan error, 40)
	for i := range 20 {
		wg.Add(2)
		go func() {
			defer wg.Done()
			word := fmt.Sprintf("w%d", i)
			s, err := c.Start(context.Background(), connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "echo", Args: []string{word}}}))
			if err != nil {
				errs <- err
				return
			}
			var got collected
			for read(s, &got) {
			}
			if got.out != word+"\n" || got.end == nil {
				errs <- fmt.Errorf("echo %s: %+v", word, got)
			}
		}()
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			s, err := c.Start(ctx, connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "/bin/bash"},
				Pty: &processpb.PTY{Size: &processpb.PTY_Size{Cols: 80, Rows: 24}}}))
			if err != nil {
				errs <- err
				return
			}
			var got collected
			if !read(s, &got) {
				errs <- fmt.Errorf("pty %d: %+v", i, got)
				return
			}
			word := fmt.Sprintf("t%d;", i)
			if _, err := c.SendInput(ctx, connect.NewRequest(&processpb.SendInputRequest{Process: sel(got.pid),
				Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Pty{Pty: []byte(word)}}})); err != nil {
				errs <- err
				return
			}
			for !strings.Contains(got.out, word) {
				if !read(s, &got) {
					errs <- fmt.Errorf("pty %d never echoed %q: %+v", i, word, got)
					return
				}
			}
			if _, err := c.SendInput(ctx, connect.NewRequest(&processpb.SendInputRequest{Process: sel(got.pid),
				Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Pty{Pty: []byte("exit\n")}}})); err != nil {
				errs <- err
				return
			}
			for read(s, &got) {
			}
			if got.out != word || got.end.GetStatus() != "exit status 0" {
				errs <- fmt.Errorf("pty %d got another's output or no end: %+v", i, got)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}
