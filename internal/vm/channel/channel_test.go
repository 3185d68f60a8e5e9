package channel

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// fakePort stands for QEMU and the port between host and guest: a Unix
// socket the host's Dialer connects to, whose accepted connections become
// the guest's port, one per open; while no host is connected, an open gets
// a port that reads end of file, as a virtio-serial port does.
type fakePort struct {
	path  string
	hosts chan net.Conn
	opens int
	mu    sync.Mutex
}

func newFakePort(t *testing.T) *fakePort {
	t.Helper()
	p := &fakePort{path: filepath.Join(t.TempDir(), "agent.sock"), hosts: make(chan net.Conn, 4)}
	ln, err := net.Listen("unix", p.path)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.hosts <- c
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return p
}

func (p *fakePort) open() (io.ReadWriteCloser, error) {
	p.mu.Lock()
	p.opens++
	p.mu.Unlock()
	select {
	case c := <-p.hosts:
		return c, nil
	default:
		return eofPort{}, nil
	}
}

type eofPort struct{}

func (eofPort) Read([]byte) (int, error)    { return 0, io.EOF }
func (eofPort) Write(b []byte) (int, error) { return len(b), nil }
func (eofPort) Close() error                { return nil }

// echo serves ln: every connection gets back what it sends.
func echo(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			io.Copy(c, c)
			c.Close()
		}()
	}
}

// roundTrip sends msg on a new connection and reads it back.
func roundTrip(ctx context.Context, d *Dialer, msg string) error {
	c, err := d.Dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	if _, err := io.WriteString(c, msg); err != nil {
		return err
	}
	b := make([]byte, len(msg))
	if _, err := io.ReadFull(c, b); err != nil {
		return err
	}
	if string(b) != msg {
		return fmt.Errorf("read back %q, sent %q", b, msg)
	}
	return nil
}

func TestChannel(t *testing.T) {
	port := newFakePort(t)
	ln := listen(port.open, portAddr("/dev/vport0p1"), nil)
	defer ln.Close()
	go echo(ln)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d := NewDialer(port.path, nil)
	// Connections at once share the session, each its own stream.
	var wg sync.WaitGroup
	for i := range 16 {
		wg.Go(func() {
			if err := roundTrip(ctx, d, fmt.Sprintf("message %d", i)); err != nil {
				t.Errorf("connection %d: %v", i, err)
			}
		})
	}
	wg.Wait()

	// The edge restarts: its session ends, a new edge's dialer connects
	// again, and the guest serves the new session.
	d.Close()
	if _, err := d.Dial(ctx); !errors.Is(err, ErrClosed) {
		t.Errorf("Dial after Close: %v", err)
	}
	d2 := NewDialer(port.path, nil)
	defer d2.Close()
	if err := roundTrip(ctx, d2, "after the restart"); err != nil {
		t.Fatalf("after a new host session: %v", err)
	}

	// The guest's session ends (its port was reset): the host's dialer
	// finds its session closed and starts another.
	ln.mu.Lock()
	ln.session.Close()
	ln.mu.Unlock()
	deadline := time.Now().Add(5 * time.Second)
	for {
		err := roundTrip(ctx, d2, "after the guest's session ended")
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no new session after the guest's ended: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestListenerClose: Close ends Accept and the session.
func TestListenerClose(t *testing.T) {
	port := newFakePort(t)
	ln := listen(port.open, portAddr("/dev/vport0p1"), nil)
	accepted := make(chan error, 1)
	go func() {
		_, err := ln.Accept()
		accepted <- err
	}()
	ln.Close()
	select {
	case err := <-accepted:
		if !errors.Is(err, net.ErrClosed) {
			t.Errorf("Accept after Close: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Accept still blocks after Close")
	}
}
