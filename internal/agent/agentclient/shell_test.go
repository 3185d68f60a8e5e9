package agentclient

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// TestReattachingShellUnreachable: a shell whose agent cannot be reached
// fails (no terminal was named: nothing to re-attach to), rather than its
// Send waiting for a re-attach that never comes.
func TestReattachingShellUnreachable(t *testing.T) {
	c := New(func(ctx context.Context) (net.Conn, error) { return nil, errors.New("no agent here") })
	defer c.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := ReattachingShell(ctx, c.Shell, nil)
	done := make(chan error, 1)
	go func() {
		err := s.Send(&dsecv1.ShellInput{Input: &dsecv1.ShellInput_Start{Start: &dsecv1.ShellStart{}}})
		if err == nil {
			_, err = s.Receive()
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err == nil {
			t.Error("a shell whose agent cannot be reached: no error")
		}
	case <-time.After(time.Minute):
		t.Fatal("a shell whose agent cannot be reached still waits a minute on")
	}
}
