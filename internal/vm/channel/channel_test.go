package channel

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fakePort stands for QEMU and the port between host and guest: a Unix
// socket the host's Dialer connects to, relayed to the guest's end of the
// port, which open returns. Like a virtio-serial port, the guest's writes
// wait for a host, and the guest reads end of file once the host has been
// gone a while; a host that comes back sooner (within missWindow) meets
// the guest's old session, as when the guest missed the end of file.
type fakePort struct {
	path     string
	hosts    chan net.Conn
	ports    chan net.Conn
	accepted atomic.Int32 // the host's connections
}

const missWindow = 20 * time.Millisecond

func newFakePort(t *testing.T) *fakePort {
	t.Helper()
	p := &fakePort{path: filepath.Join(t.TempDir(), "agent.sock"), hosts: make(chan net.Conn), ports: make(chan net.Conn)}
	ln, err := net.Listen("unix", p.path)
	if err != nil {
		t.Fatal(err)
	}
	stop, accepted := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(accepted)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.accepted.Add(1)
			select {
			case p.hosts <- c:
			case <-stop:
				c.Close()
			}
		}
	}()
	go p.run(stop)
	t.Cleanup(func() { close(stop); ln.Close(); <-accepted })
	return p
}

// run makes ports and relays hosts to them.
func (p *fakePort) run(done <-chan struct{}) {
	for {
		guest, qemu := net.Pipe()
		select {
		case p.ports <- guest:
		case <-done:
			return
		}
		var host net.Conn
		select {
		case host = <-p.hosts:
		case <-done:
			return
		}
		for host != nil {
			if guestClosed := relay(host, qemu); guestClosed {
				break
			}
			host = nil
			select {
			case host = <-p.hosts: // back before the guest read the end
			case <-time.After(missWindow):
			case <-done:
				return
			}
		}
		qemu.Close()
	}
}

// relay copies between host and the port until one of them closes, and
// says whether it was the guest.
func relay(host, qemu net.Conn) (guestClosed bool) {
	toHost := make(chan error, 1)
	go func() {
		_, err := io.Copy(host, qemu)
		if err == nil {
			host.Close() // the guest closed the port
		}
		toHost <- err
	}()
	io.Copy(qemu, host)
	host.Close()
	qemu.SetReadDeadline(time.Now())
	err := <-toHost
	qemu.SetReadDeadline(time.Time{})
	return err == nil
}

func (p *fakePort) open() (io.ReadWriteCloser, error) { return <-p.ports, nil }

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

	// The edge restarts at once: its session ends, and a new edge's
	// dialer connects before the guest read the end of the old one. It
	// gets no hello, leaves for a moment, and the guest serves a new
	// session.
	d.Close()
	if _, err := d.Dial(ctx); !errors.Is(err, ErrClosed) {
		t.Errorf("Dial after Close: %v", err)
	}
	d2 := NewDialer(port.path, nil)
	d2.helloWait, d2.helloGap = 300*time.Millisecond, 5*missWindow
	defer d2.Close()
	if err := roundTrip(ctx, d2, "after the restart"); err != nil {
		t.Fatalf("after a new host session: %v", err)
	}

	// The guest's session ends (its port closed): the host's dialer finds
	// its session closed and starts another.
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

// TestDialHonoursContextWhileAnotherConnects: a Dial waiting for a session
// that another Dial is making (the guest not up yet) ends with its own
// context.
func TestDialHonoursContextWhileAnotherConnects(t *testing.T) {
	port := newFakePort(t) // no guest listens
	d := NewDialer(port.path, nil)
	defer d.Close()
	first := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := d.Dial(ctx)
		first <- err
	}()
	time.Sleep(50 * time.Millisecond) // the first Dial is connecting
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := d.Dial(ctx)
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("the waiting Dial: %v, want its deadline", err)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("a Dial waited past its context for another's connect")
	}
	if err := <-first; !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("the connecting Dial with no guest: %v, want its deadline", err)
	}
}

// A held dialer makes no session: a Dial waits for the release (here its
// context ends first), and dials once released.
func TestHold(t *testing.T) {
	d := NewDialer(filepath.Join(t.TempDir(), "no-such.sock"), nil)
	defer d.Close()
	release, err := d.Hold(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	_, err = d.Dial(ctx)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Dial of a held dialer: %v, want it to wait until its context ends", err)
	}
	release()
	release() // a second release is harmless
	_, err = d.Dial(context.Background())
	if err == nil || errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Dial once released: %v, want the socket's dial error", err)
	}
}

// TestSuspend: a suspended dialer (its VM paused to disk) has no session:
// a Dial waits, its own session's connections have ended with it, and the
// guest's side calls them Lost, as it does not a connection the host
// closed itself. Hold takes the suspension over and its release lets the
// waiting Dial reach the guest again; Close ends a Dial that waits.
func TestSuspend(t *testing.T) {
	port := newFakePort(t)
	ln := listen(port.open, portAddr("/dev/vport0p1"), nil)
	defer ln.Close()
	accepted := make(chan net.Conn, 2)
	go func() {
		// The first two connections are the test's, the others echo.
		for i := 0; ; i++ {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if i < 2 {
				accepted <- c
				continue
			}
			go func() {
				io.Copy(c, c)
				c.Close()
			}()
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d := NewDialer(port.path, nil)
	defer d.Close()

	closed, err := d.Dial(ctx)
	if err != nil {
		t.Fatal(err)
	}
	closed.Write([]byte("x"))
	guestClosed := <-accepted
	closed.Close()
	kept, err := d.Dial(ctx)
	if err != nil {
		t.Fatal(err)
	}
	kept.Write([]byte("x"))
	guestKept := <-accepted
	guestClosed.SetReadDeadline(time.Now().Add(5 * time.Second))
	io.Copy(io.Discard, guestClosed)
	if Lost(guestClosed) {
		t.Error("a connection the host closed is Lost, want it not")
	}
	if _, ok := ln.HostSince(); !ok {
		t.Error("HostSince: no host, with one connected")
	}

	if err := d.Suspend(ctx); err != nil {
		t.Fatal(err)
	}
	d.mu.Lock()
	kept0 := d.session != nil && !d.session.IsClosed()
	d.mu.Unlock()
	if !kept0 {
		t.Error("Suspend ended the session, want it kept until EndSession")
	}
	d.EndSession()
	if _, err := kept.Read(make([]byte, 1)); err == nil {
		t.Error("a connection read on across EndSession, want it ended")
	}
	guestKept.SetReadDeadline(time.Now().Add(5 * time.Second))
	io.Copy(io.Discard, guestKept)
	if !Lost(guestKept) {
		t.Error("a connection whose session ended is not Lost")
	}
	short, cancelShort := context.WithTimeout(ctx, 50*time.Millisecond)
	_, err = d.Dial(short)
	cancelShort()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Dial of a suspended dialer: %v, want it to wait until its context ends", err)
	}

	waited := make(chan error, 1)
	go func() { waited <- roundTrip(ctx, d, "after the resume") }()
	release, err := d.Hold(ctx) // the resume's: the suspension's hold
	if err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-waited:
		t.Fatalf("a Dial got through before the release: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	release()
	if err := <-waited; err != nil {
		t.Errorf("the Dial that waited, once released: %v", err)
	}

	if err := d.Suspend(ctx); err != nil {
		t.Fatal(err)
	}
	go func() { // the session is still up (no EndSession): Dial waits all the same
		_, err := d.Dial(ctx)
		waited <- err
	}()
	time.Sleep(20 * time.Millisecond)
	d.Close()
	if err := <-waited; !errors.Is(err, ErrClosed) {
		t.Errorf("a Dial waiting on a suspended dialer that was closed: %v, want ErrClosed", err)
	}
}

// TestBooting checks that a booting guest's first connection waits for
// its hello: the guest's agent serves only after several of the dialer's
// hello waits, and the dialer connects once. Without Booting it connects
// again after each wait.
func TestBooting(t *testing.T) {
	for _, booting := range []bool{true, false} {
		t.Run(fmt.Sprint("booting=", booting), func(t *testing.T) {
			port := newFakePort(t)
			d := NewDialer(port.path, nil)
			defer d.Close()
			// The gap outlasts the port's miss window, as the real one
			// (200 ms) does: a hello the guest wrote as the host dropped is
			// lost, and only a gap the guest sees as the host's going makes
			// it start a session with a new one.
			d.helloWait, d.helloGap = 20*time.Millisecond, 2*missWindow
			if booting {
				d.Booting()
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			served := make(chan net.Listener, 1)
			go func() {
				// The guest's agent serves once the host has connected
				// and waited past a few hello waits.
				for port.accepted.Load() == 0 {
					time.Sleep(time.Millisecond)
				}
				time.Sleep(10 * d.helloWait)
				ln := listen(port.open, portAddr("/dev/vport0p1"), nil)
				go echo(ln)
				served <- ln
			}()
			err := roundTrip(ctx, d, "hello")
			defer (<-served).Close()
			if err != nil {
				t.Fatal(err)
			}
			n := port.accepted.Load()
			if booting && n != 1 {
				t.Errorf("a booting guest's dialer connected %d times, want once", n)
			}
			if !booting && n < 2 {
				t.Errorf("a dialer not booting connected %d times: its hello wait did not end the first", n)
			}
		})
	}
}
