package execwire

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"

	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// maxIdle is how many idle connections a Client keeps to its agent.
const maxIdle = 4

// Client makes exec calls to one agent over the framed path. Connections
// are made as needed and kept for the next call.
type Client struct {
	dialer func(ctx context.Context) (net.Conn, error) // to the agent

	mu     sync.Mutex
	idle   []*conn
	closed bool
}

// NewClient returns a client of the agent listening on socketPath. It
// connects lazily.
func NewClient(socketPath string) *Client {
	return NewDialClient(func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", socketPath)
	})
}

// NewDialClient returns a client of the agent that dial connects to. It
// connects lazily.
func NewDialClient(dial func(ctx context.Context) (net.Conn, error)) *Client {
	return &Client{dialer: dial}
}

type conn struct {
	net.Conn
	r   *bufio.Reader
	buf []byte // frame buffer, reused across calls
}

// Exec starts a call. Read its events with the returned stream's Receive;
// ending ctx cancels the call and, for a foreground command, kills it. On a
// new connection Exec returns once the agent's first bytes are in (the
// agent sends an event as soon as the command started), which is how it
// tells an agent older than the framed path: ErrNotFramed.
func (c *Client) Exec(ctx context.Context, req *dsecv1.ExecRequest) (*Stream, error) {
	frame, err := appendFrame(nil, 0, req)
	if err != nil {
		return nil, fmt.Errorf("exec request: %w", err)
	}
	cn, reused, err := c.get(ctx)
	if err != nil {
		return nil, err
	}
	err = cn.send(frame, !reused)
	if err != nil && reused {
		// The agent dropped an idle connection: nothing of this call
		// reached it, so try once on a new one.
		if cn, err = c.dial(ctx); err != nil {
			return nil, err
		}
		reused = false
		err = cn.send(frame, true)
	}
	if err != nil {
		return nil, fmt.Errorf("send exec request: %w", err)
	}
	s := &Stream{client: c, cn: cn, ctx: ctx}
	s.stop = context.AfterFunc(ctx, func() { cn.Close() })
	if !reused {
		// An agent from before the framed path answers the preface with an
		// HTTP error; it ran nothing.
		if head, err := cn.r.Peek(len(httpReply)); err == nil && string(head) == httpReply {
			s.finish(false, ErrNotFramed)
			return nil, ErrNotFramed
		}
	}
	return s, nil
}

// httpReply is how an HTTP server's answer starts.
const httpReply = "HTTP/"

// ErrNotFramed means the agent does not speak the framed path: it is older
// than it, and Connect's Exec must be used instead.
var ErrNotFramed = errors.New("agent does not speak the framed exec path")

// send writes a request frame, after the preface on a new connection. A
// connection that fails to take it is closed.
func (cn *conn) send(frame []byte, isNew bool) error {
	if isNew {
		frame = append([]byte(Preface), frame...)
	}
	if _, err := cn.Write(frame); err != nil {
		cn.Close()
		return err
	}
	return nil
}

// get returns an idle connection, or a new one.
func (c *Client) get(ctx context.Context) (cn *conn, reused bool, err error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, false, fmt.Errorf("agent exec channel: %w", net.ErrClosed)
	}
	if n := len(c.idle); n > 0 {
		cn = c.idle[n-1]
		c.idle = c.idle[:n-1]
		c.mu.Unlock()
		return cn, true, nil
	}
	c.mu.Unlock()
	cn, err = c.dial(ctx)
	return cn, false, err
}

func (c *Client) dial(ctx context.Context) (*conn, error) {
	nc, err := c.dialer(ctx)
	if err != nil {
		return nil, fmt.Errorf("connect to agent: %w", err)
	}
	return &conn{Conn: nc, r: bufio.NewReader(nc)}, nil
}

// put keeps a connection whose last call ended cleanly for the next call.
func (c *Client) put(cn *conn) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || len(c.idle) >= maxIdle {
		cn.Close()
		return
	}
	c.idle = append(c.idle, cn)
}

// Close closes the idle connections; calls in progress finish, and no new
// call can start.
func (c *Client) Close() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	for _, cn := range c.idle {
		cn.Close()
	}
	c.idle = nil
}

// Stream is the agent's side of one exec call, read like a Connect
// server stream: Receive until it returns false, then Err.
type Stream struct {
	client *Client
	cn     *conn
	ctx    context.Context
	stop   func() bool
	msg    *dsecv1.ExecEvent
	err    error
	done   bool
}

// Receive reads the next event, and reports whether there was one.
func (s *Stream) Receive() bool {
	if s.done {
		return false
	}
	flags, payload, grown, err := readFrame(s.cn.r, s.cn.buf)
	s.cn.buf = grown
	if err != nil {
		if ctxErr := s.ctx.Err(); ctxErr != nil {
			err = ctxErr
		} else if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		s.finish(false, fmt.Errorf("agent exec channel: %w", err))
		return false
	}
	if flags&FlagEnd != 0 {
		s.finish(true, parseEnd(payload))
		return false
	}
	ev := new(dsecv1.ExecEvent)
	if err := proto.Unmarshal(payload, ev); err != nil {
		s.finish(false, fmt.Errorf("agent exec channel: event: %w", err))
		return false
	}
	s.msg = ev
	return true
}

// Msg is the event the last Receive read.
func (s *Stream) Msg() *dsecv1.ExecEvent { return s.msg }

// Err is the call's error once Receive returned false: nil when the call
// succeeded, a *connect.Error when the agent refused or failed it, any
// other error when the channel broke.
func (s *Stream) Err() error { return s.err }

// Close ends the call; before its end, that cancels it.
func (s *Stream) Close() error {
	if !s.done {
		s.finish(false, fmt.Errorf("agent exec channel: %w", net.ErrClosed))
	}
	return nil
}

// finish ends the stream. A connection whose call ended cleanly and whose
// context never fired goes back to the client for the next call.
func (s *Stream) finish(reuse bool, err error) {
	s.done, s.err, s.msg = true, err, nil
	if s.stop() && reuse {
		s.client.put(s.cn)
		return
	}
	s.cn.Close()
}
