// Package channel is a microVM's agent channel: many connections over the
// one byte stream of a virtio-serial port, multiplexed with yamux. The
// guest's agent listens on the port's device (Listen) and the edge dials
// the Unix socket QEMU serves the port on (Dialer), one yamux stream per
// connection, so the agent's Connect and framed protocols run unchanged.
//
// The port opens once per side and carries one session at a time, and a
// guest read returns end of file while the host is disconnected. Each
// session starts with the guest's hello (a fixed line) once the host is
// there; the host starts yamux only after it, so no byte of a new session
// meets an old one. The guest's listener starts a new session whenever the
// old one ends, the host gone (an edge restart); the host's dialer starts
// a new one when its connection breaks. A host that reconnects so fast
// that the guest never read the end of the old session gets no hello:
// it disconnects for a moment, so the guest does read it, and tries again.
package channel

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"github.com/hashicorp/yamux"
)

// PortName is the name of the agent's virtio-serial port
// (/sys/class/virtio-ports/*/name in the guest).
const PortName = "dsec.0"

// config is yamux's configuration for either side.
func config(log *slog.Logger, keepAlive bool) *yamux.Config {
	c := yamux.DefaultConfig()
	// The guest only answers: the host's keepalive finds a dead session,
	// and an idle guest then wakes no more than that.
	c.EnableKeepAlive = keepAlive
	c.LogOutput = nil
	c.Logger = slog.NewLogLogger(log.Handler(), slog.LevelWarn)
	return c
}

// hello is what the guest writes first in every session.
const hello = "dsec-channel-hello-1\n"

// Retry intervals of the guest's listener while the host is away.
const (
	minRetry = 10 * time.Millisecond
	maxRetry = 500 * time.Millisecond
)

// Listen serves the host's connections on the virtio-serial port device at
// path (/dev/vportNpM in the guest): each connection the host dials is one
// that Accept returns. It opens the port again for each new session of the
// host's.
func Listen(path string, log *slog.Logger) net.Listener {
	return listen(func() (io.ReadWriteCloser, error) {
		return os.OpenFile(path, os.O_RDWR, 0)
	}, portAddr(path), log)
}

// listen is Listen over open, which opens the port.
func listen(open func() (io.ReadWriteCloser, error), addr net.Addr, log *slog.Logger) *listener {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	l := &listener{open: open, addr: addr, log: log, conns: make(chan net.Conn), done: make(chan struct{}), stopped: make(chan struct{})}
	go l.run()
	return l
}

type listener struct {
	open    func() (io.ReadWriteCloser, error)
	addr    net.Addr
	log     *slog.Logger
	conns   chan net.Conn
	done    chan struct{} // closed by Close
	stopped chan struct{} // closed when run returns
	once    sync.Once

	mu      sync.Mutex
	port    io.Closer      // the port now open, closed by Close
	session *yamux.Session // the current one, closed by Close
	since   time.Time      // when the current session began
}

func (l *listener) run() {
	defer close(l.stopped)
	retry := minRetry
	warned := false
	for {
		port, err := l.open()
		if err != nil {
			if !warned {
				l.log.Warn("open agent port", "addr", l.addr, "err", err)
				warned = true
			}
		} else if l.serve(port) > 0 {
			retry = minRetry
		}
		select {
		case <-l.done:
			return
		case <-time.After(retry):
		}
		retry = min(retry*2, maxRetry)
	}
}

// serve runs one session on port until it ends and returns how many
// connections it accepted.
func (l *listener) serve(port io.ReadWriteCloser) int {
	defer port.Close()
	l.mu.Lock()
	select {
	case <-l.done:
		l.mu.Unlock()
		return 0
	default:
	}
	l.port = port // Close closes it, ending a write that waits for the host
	l.mu.Unlock()
	// A virtio-serial port's write waits for the host to be connected.
	if _, err := io.WriteString(port, hello); err != nil {
		return 0
	}
	s, err := yamux.Server(port, config(l.log, false))
	if err != nil {
		l.log.Warn("start agent channel session", "err", err)
		return 0
	}
	defer s.Close()
	l.mu.Lock()
	select {
	case <-l.done:
		l.mu.Unlock()
		return 0
	default:
	}
	l.session, l.since = s, time.Now()
	l.mu.Unlock()
	n := 0
	for {
		c, err := s.Accept()
		if err != nil {
			if n > 0 {
				l.log.Info("agent channel session ended", "connections", n, "err", err)
			}
			return n
		}
		n++
		select {
		case l.conns <- &conn{Conn: c, session: s}:
		case <-l.done:
			c.Close()
			return n
		}
	}
}

func (l *listener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

// Close stops accepting and ends the current session with its
// connections.
func (l *listener) Close() error {
	l.once.Do(func() {
		l.mu.Lock()
		close(l.done)
		if l.session != nil {
			l.session.Close()
		}
		if l.port != nil {
			l.port.Close()
		}
		l.mu.Unlock()
	})
	<-l.stopped
	return nil
}

func (l *listener) Addr() net.Addr { return l.addr }

// HostSince reports whether the host is connected, in a session that
// began at since (the guest's clock).
func (l *listener) HostSince() (since time.Time, ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.session == nil || l.session.IsClosed() {
		return time.Time{}, false
	}
	return l.since, true
}

// conn is a connection the listener accepted, one stream of a session.
type conn struct {
	net.Conn
	session *yamux.Session
}

// ChannelLost reports whether the connection's session has ended: the
// host went away (its VM was paused to disk and resumed, or the edge
// restarted), rather than the host closing this one connection.
func (c *conn) ChannelLost() bool { return c.session.IsClosed() }

// Lost reports whether c, a connection a guest's Listen accepted (or one
// that wraps it and returns it from NetConn), ended with its whole
// session: the host went away, rather than closing this connection. It is
// false for any other connection.
func Lost(c net.Conn) bool {
	for c != nil {
		if l, ok := c.(interface{ ChannelLost() bool }); ok {
			return l.ChannelLost()
		}
		w, ok := c.(interface{ NetConn() net.Conn })
		if !ok {
			return false
		}
		c = w.NetConn()
	}
	return false
}

// portAddr is a port's device path as a net.Addr.
type portAddr string

func (a portAddr) Network() string { return "virtio-serial" }
func (a portAddr) String() string  { return string(a) }

// Dialer is the host's side: it dials the Unix socket that QEMU serves the
// guest's port on (qemu.Process.ChannelPath), once, and opens a stream on
// that session per Dial; it connects again once the session has ended. Its
// Dial fits agentclient.New.
type Dialer struct {
	path string
	log  *slog.Logger
	// helloWait is how long a new connection waits for the guest's hello
	// before it is dropped for helloGap and made again.
	helloWait, helloGap time.Duration

	// connecting holds a value while a Dial makes a session; the others
	// wait for it, or for their context.
	connecting chan struct{}

	done chan struct{} // closed by Close

	mu        sync.Mutex // guards session, closed, suspended and booting; never held while connecting
	session   *yamux.Session
	closed    bool
	suspended func() // the hold of Suspend, until Hold takes it over
	booting   bool   // Booting: no session made yet, and none can be older
}

// NewDialer returns the dialer of the agent channel served at socketPath.
// It connects on the first Dial.
func NewDialer(socketPath string, log *slog.Logger) *Dialer {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Dialer{path: socketPath, log: log, helloWait: time.Second, helloGap: 200 * time.Millisecond,
		connecting: make(chan struct{}, 1), done: make(chan struct{})}
}

// Booting says the guest behind d is booting: its port has carried no
// session yet, so the guest greets the first connection as soon as its
// agent serves, and that connection waits for the hello as long as its
// Dial's context allows rather than being dropped after helloWait and made
// again after helloGap. A boot's hello that came during such a gap waited
// for the next connection: under TCG a guest's agent serves ~2.3 s after
// QEMU starts, at the second gap (2.2–2.4 s). Once a session has
// been made, d is like any other.
func (d *Dialer) Booting() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.session == nil {
		d.booting = true
	}
}

// ErrClosed is returned by Dial after Close.
var ErrClosed = errors.New("agent channel closed")

// Dial opens a new connection to the guest's agent: a stream of the
// current session, or of a new one once the guest's agent greets it (the
// guest may still be booting), until ctx ends.
func (d *Dialer) Dial(ctx context.Context) (net.Conn, error) {
	for attempt := 0; ; attempt++ {
		s, err := d.currentSession(ctx)
		if err != nil {
			return nil, err
		}
		c, err := s.Open()
		if err == nil {
			return c, nil
		}
		// The session ended under us: a new one, once.
		d.drop(s)
		if attempt > 0 || ctx.Err() != nil {
			return nil, fmt.Errorf("open agent channel stream: %w", err)
		}
	}
}

func (d *Dialer) currentSession(ctx context.Context) (*yamux.Session, error) {
	if s, err := d.live(); s != nil || err != nil {
		return s, err
	}
	select {
	case d.connecting <- struct{}{}:
		defer func() { <-d.connecting }()
	case <-ctx.Done():
		return nil, fmt.Errorf("wait for the agent channel: %w", ctx.Err())
	case <-d.done:
		return nil, ErrClosed
	}
	// Another Dial may have made one meanwhile.
	if s, err := d.live(); s != nil || err != nil {
		return s, err
	}
	conn, err := d.connect(ctx)
	if err != nil {
		return nil, err
	}
	s, err := yamux.Client(conn, config(d.log, true))
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("start agent channel session: %w", err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		s.Close()
		return nil, ErrClosed
	}
	d.session, d.booting = s, false
	return s, nil
}

// Hold keeps the dialer from making a new session until release is
// called: a Dial that needs one waits for it (or for its context). A VM
// restored in a new QEMU is held so (the microvm backend's Resume) until
// its guest has seen the host leave: a session made before would meet
// the guest's old one and cost the hello's wait. Hold waits for a session
// being made to be done, or for ctx.
//
// A dialer suspended (Suspend) is held already: Hold takes that hold
// over, and its release ends the suspension.
func (d *Dialer) Hold(ctx context.Context) (release func(), err error) {
	d.mu.Lock()
	if r := d.suspended; r != nil {
		d.suspended = nil
		d.mu.Unlock()
		return r, nil
	}
	d.mu.Unlock()
	select {
	case d.connecting <- struct{}{}:
		return sync.OnceFunc(func() { <-d.connecting }), nil
	case <-ctx.Done():
		return nil, fmt.Errorf("hold the agent channel: %w", ctx.Err())
	case <-d.done:
		return nil, ErrClosed
	}
}

// Suspend holds the dialer (as Hold) for a VM about to be paused to disk:
// a Dial meanwhile waits for the VM's resume (whose Hold takes the
// suspension over and whose release ends it), for Close (the VM deleted:
// ErrClosed) or for its context. That is how a stream broken by the pause
// reaches the resumed guest again (agentclient's re-attach). The current
// session is left as it is: the guest must be saved still connected, so
// that its resume tells it the host left (package vmstate) and it opens a
// new session at once; had the host left first, the guest might be saved
// before it noticed, and the first dial after the resume would wait out
// the hello. EndSession ends it once the VM's QEMU is gone. Suspending a
// suspended dialer does nothing.
func (d *Dialer) Suspend(ctx context.Context) error {
	d.mu.Lock()
	held := d.suspended != nil
	d.mu.Unlock()
	if held {
		return nil
	}
	release, err := d.Hold(ctx)
	if err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.suspended = release
	return nil
}

// EndSession ends the current session, if there is one: the QEMU that
// carried it is gone (a pause to disk), and its streams learn so now
// rather than when the session notices.
func (d *Dialer) EndSession() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.session != nil {
		d.session.Close()
		d.session = nil
	}
}

// live is the current session while it lasts, or ErrClosed after Close.
func (d *Dialer) live() (*yamux.Session, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, ErrClosed
	}
	if d.suspended != nil {
		return nil, nil // the session's VM is being paused: wait for the resume
	}
	if d.session != nil && !d.session.IsClosed() {
		return d.session, nil
	}
	return nil, nil
}

// connect connects to the port's socket and returns the connection once
// the guest's hello came, the bytes after it unread. While none comes (the
// guest boots, or it still holds an old session) it connects again after
// a gap the guest sees as the host's going, until ctx ends.
func (d *Dialer) connect(ctx context.Context) (net.Conn, error) {
	for {
		var nd net.Dialer
		conn, err := nd.DialContext(ctx, "unix", d.path)
		if err != nil {
			return nil, fmt.Errorf("dial agent channel %s: %w", d.path, err)
		}
		d.mu.Lock()
		booting := d.booting
		d.mu.Unlock()
		wait := time.Now().Add(d.helloWait)
		if booting {
			wait = time.Time{} // until ctx ends (the AfterFunc below)
		}
		if dl, ok := ctx.Deadline(); ok && (wait.IsZero() || dl.Before(wait)) {
			wait = dl
		}
		conn.SetReadDeadline(wait)
		stop := context.AfterFunc(ctx, func() { conn.SetReadDeadline(time.Now()) })
		rest, err := readHello(conn)
		stop()
		if err == nil {
			conn.SetReadDeadline(time.Time{})
			return &prefixConn{Conn: conn, prefix: rest}, nil
		}
		conn.Close()
		if ctx.Err() != nil {
			return nil, fmt.Errorf("wait for the guest's agent channel: %w", ctx.Err())
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("wait for the guest's agent channel: %w", ctx.Err())
		case <-time.After(d.helloGap):
		}
	}
}

// readHello reads until the guest's hello and returns what came after it.
// What comes before it is the end of an old session's output.
func readHello(conn net.Conn) ([]byte, error) {
	var buf []byte
	b := make([]byte, 4096)
	for {
		n, err := conn.Read(b)
		buf = append(buf, b[:n]...)
		if i := bytes.Index(buf, []byte(hello)); i >= 0 {
			return buf[i+len(hello):], nil
		}
		if err != nil {
			return nil, err
		}
		// Keep only what may be the start of a hello.
		if len(buf) > len(hello) {
			buf = buf[len(buf)-len(hello):]
		}
	}
}

// prefixConn is a connection whose first reads return prefix.
type prefixConn struct {
	net.Conn
	prefix []byte
}

func (c *prefixConn) Read(b []byte) (int, error) {
	if len(c.prefix) > 0 {
		n := copy(b, c.prefix)
		c.prefix = c.prefix[n:]
		return n, nil
	}
	return c.Conn.Read(b)
}

func (d *Dialer) drop(s *yamux.Session) {
	d.mu.Lock()
	defer d.mu.Unlock()
	s.Close()
	if d.session == s {
		d.session = nil
	}
}

// Close ends the session and every connection on it; Dial fails after it.
func (d *Dialer) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.closed {
		close(d.done) // wakes the Dials that wait
	}
	d.closed = true
	if d.session != nil {
		d.session.Close()
		d.session = nil
	}
	return nil
}
