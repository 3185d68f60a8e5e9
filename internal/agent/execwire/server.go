package execwire

import (
	"bufio"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// prefaceTimeout bounds how long a new connection may take to send its
// first bytes before Split gives up on it.
const prefaceTimeout = 30 * time.Second

// ExecFunc runs one exec call: it sends the call's events and returns its
// error. ctx ends when the client goes away.
type ExecFunc func(ctx context.Context, req *dsecv1.ExecRequest, send func(*dsecv1.ExecEvent) error) error

// Split divides ln's connections: each one that opens with Preface is
// handed to serve in a goroutine of its own; one that opens with
// WatchPreface is answered and held open in one (see Watch); every other
// one comes out of the returned listener, its first bytes intact, for an
// HTTP server. Closing the returned listener closes ln.
func Split(ln net.Listener, serve func(net.Conn), log *slog.Logger) net.Listener {
	s := &splitListener{ln: ln, serve: serve, conns: make(chan net.Conn), done: make(chan struct{}), log: log}
	go s.acceptLoop()
	return s
}

type splitListener struct {
	ln    net.Listener
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
	err   error // why the listener closed; set before done is closed
	log   *slog.Logger
	serve func(net.Conn)
}

func (s *splitListener) acceptLoop() {
	for {
		c, err := s.ln.Accept()
		if err != nil {
			s.closeWith(err)
			return
		}
		go s.sort(c)
	}
}

// sort reads a new connection's first bytes and sends it on its way.
func (s *splitListener) sort(c net.Conn) {
	first := make([]byte, len(Preface))
	c.SetReadDeadline(time.Now().Add(prefaceTimeout))
	if _, err := io.ReadFull(c, first); err != nil {
		s.log.Debug("agent connection closed before its first bytes", "err", err)
		c.Close()
		return
	}
	c.SetReadDeadline(time.Time{})
	switch string(first) {
	case Preface:
		s.serve(c)
		return
	case WatchPreface:
		holdWatch(c)
		return
	}
	select {
	case s.conns <- &prefixedConn{Conn: c, prefix: first}:
	case <-s.done:
		c.Close()
	}
}

func (s *splitListener) Accept() (net.Conn, error) {
	select {
	case c := <-s.conns:
		return c, nil
	case <-s.done:
		return nil, s.err
	}
}

func (s *splitListener) Close() error { return s.closeWith(net.ErrClosed) }

// closeWith closes the listener once; Accept returns why from then on.
func (s *splitListener) closeWith(why error) error {
	var err error
	s.once.Do(func() {
		s.err = why
		err = s.ln.Close()
		close(s.done)
	})
	return err
}

func (s *splitListener) Addr() net.Addr { return s.ln.Addr() }

// prefixedConn gives back the bytes Split read before the rest.
type prefixedConn struct {
	net.Conn
	prefix []byte
}

// NetConn is the connection Split accepted.
func (c *prefixedConn) NetConn() net.Conn { return c.Conn }

func (c *prefixedConn) Read(p []byte) (int, error) {
	if len(c.prefix) > 0 {
		n := copy(p, c.prefix)
		c.prefix = c.prefix[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}

// ServeConn serves exec calls on c, whose Preface was already read, until
// the client closes it, breaks the protocol, or ctx ends.
//
// One goroutine reads the connection for its whole life: a request starts
// the call in a goroutine of its own, and the end of the connection (or a
// byte the client should not have sent mid-call) cancels it. That way
// nothing has to interrupt a pending read between calls.
func ServeConn(ctx context.Context, c net.Conn, exec ExecFunc, log *slog.Logger) {
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	r := bufio.NewReader(c)
	var (
		buf    []byte
		mu     sync.Mutex
		cancel context.CancelFunc // of the call in progress; nil between calls
	)
	defer func() {
		mu.Lock()
		if cancel != nil {
			cancel()
		}
		mu.Unlock()
	}()
	for {
		flags, payload, grown, err := readFrame(r, buf)
		buf = grown
		if err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				log.Warn("exec channel: read", "err", err)
			}
			return
		}
		mu.Lock()
		busy := cancel != nil
		mu.Unlock()
		if busy || flags != 0 {
			log.Warn("exec channel: client broke the protocol; closing", "busy", busy, "flags", flags)
			return
		}
		req := new(dsecv1.ExecRequest)
		if err := proto.Unmarshal(payload, req); err != nil {
			log.Warn("exec channel: bad request", "err", err)
			return
		}
		callCtx, callCancel := context.WithCancel(ctx)
		mu.Lock()
		cancel = callCancel
		mu.Unlock()
		go func() {
			w := &eventWriter{c: c}
			err := exec(callCtx, req, w.send)
			mu.Lock()
			cancel = nil
			mu.Unlock()
			callCancel()
			// The held exit and the end frame leave in one write, so the
			// client wakes once for both.
			w.held = appendEnd(w.held, err)
			if _, err := c.Write(w.held); err != nil {
				c.Close()
			}
		}()
	}
}

// eventWriter frames a call's events onto the connection. The exit event
// is held back to leave with the end frame.
type eventWriter struct {
	c    net.Conn
	buf  []byte
	held []byte
}

func (w *eventWriter) send(ev *dsecv1.ExecEvent) error {
	if ev.GetExited() != nil {
		b, err := appendFrame(w.held[:0], 0, ev)
		if err != nil {
			return err
		}
		w.held = b
		return nil
	}
	b, err := appendFrame(w.buf[:0], 0, ev)
	if err != nil {
		return err
	}
	w.buf = b
	_, err = w.c.Write(b)
	return err
}
