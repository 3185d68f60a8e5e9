// Package qmp is a client of QEMU's machine protocol (QMP): one connection
// to a QEMU process's monitor socket, commands with a context, and the
// asynchronous events QEMU sends between answers.
//
// It is our own rather than go-qemu's qmp package because every call here
// must end with its context (a QEMU that stops answering must not hang the
// edge), and the edge needs the events of the same connection (SHUTDOWN,
// STOP, migration) that its commands use. The protocol is small: a
// greeting, qmp_capabilities, then one JSON object per command and per
// answer, answers matched by id.
package qmp

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
)

// Error is an error QEMU answered a command with.
type Error struct {
	Class string `json:"class"`
	Desc  string `json:"desc"`
}

func (e *Error) Error() string { return e.Class + ": " + e.Desc }

// Event is an asynchronous event QEMU sent.
type Event struct {
	Event     string          `json:"event"`
	Data      json.RawMessage `json:"data,omitempty"`
	Timestamp struct {
		Seconds      int64 `json:"seconds"`
		Microseconds int64 `json:"microseconds"`
	} `json:"timestamp"`
}

// ErrClosed is returned by calls on a closed client or after QEMU closed
// the connection.
var ErrClosed = errors.New("qmp connection closed")

// eventBuffer is how many events wait for a reader; later ones are dropped.
const eventBuffer = 64

// Client is one QMP connection. Its methods may be called from several
// goroutines; commands are sent one after another and answered in order.
type Client struct {
	conn    net.Conn
	writeMu sync.Mutex
	events  chan Event

	mu      sync.Mutex
	nextID  uint64
	pending map[string]chan message
	err     error         // why the connection ended; set before done closes
	done    chan struct{} // closed when the read loop ends
}

// message is any object QEMU sends.
type message struct {
	QMP    json.RawMessage `json:"QMP,omitempty"`
	Event  string          `json:"event,omitempty"`
	ID     json.RawMessage `json:"id,omitempty"`
	Return json.RawMessage `json:"return,omitempty"`
	Error  *Error          `json:"error,omitempty"`
}

// Dial connects to the QMP socket at path, reads QEMU's greeting and
// leaves capabilities negotiation mode, so the client is ready for
// commands.
func Dial(ctx context.Context, path string) (*Client, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("dial qmp %s: %w", path, err)
	}
	c, err := New(ctx, conn)
	if err != nil {
		return nil, fmt.Errorf("qmp %s: %w", path, err)
	}
	return c, nil
}

// New runs the QMP handshake on conn and returns the client that owns it.
func New(ctx context.Context, conn net.Conn) (*Client, error) {
	c := &Client{
		conn:    conn,
		events:  make(chan Event, eventBuffer),
		pending: make(map[string]chan message),
		done:    make(chan struct{}),
	}
	greeting := make(chan error, 1)
	go c.readLoop(greeting)
	select {
	case err := <-greeting:
		if err != nil {
			conn.Close()
			<-c.done
			return nil, fmt.Errorf("read greeting: %w", err)
		}
	case <-ctx.Done():
		conn.Close()
		<-c.done
		return nil, fmt.Errorf("read greeting: %w", ctx.Err())
	}
	if err := c.Execute(ctx, "qmp_capabilities", nil, nil); err != nil {
		c.Close()
		return nil, fmt.Errorf("negotiate capabilities: %w", err)
	}
	return c, nil
}

// readLoop reads QEMU's messages until the connection ends: the greeting
// first (reported on greeting), then answers, handed to their callers, and
// events.
func (c *Client) readLoop(greeting chan<- error) {
	sc := bufio.NewScanner(c.conn)
	// Answers such as query-qmp-schema run to hundreds of kilobytes.
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	first := true
	var err error
	for sc.Scan() {
		var m message
		if err = json.Unmarshal(sc.Bytes(), &m); err != nil {
			err = fmt.Errorf("decode qmp message: %w", err)
			break
		}
		if first {
			if m.QMP == nil {
				err = fmt.Errorf("not a qmp greeting: %.200s", sc.Bytes())
				break
			}
			first = false
			greeting <- nil
			continue
		}
		if m.Event != "" {
			c.deliverEvent(sc.Bytes())
			continue
		}
		c.deliverAnswer(m)
	}
	if err == nil {
		err = sc.Err()
	}
	if err == nil {
		err = ErrClosed
	}
	if first {
		greeting <- err
	}
	c.mu.Lock()
	c.err = err
	close(c.done)
	c.mu.Unlock()
	close(c.events)
}

func (c *Client) deliverEvent(raw []byte) {
	var ev Event
	if json.Unmarshal(raw, &ev) != nil {
		return
	}
	select {
	case c.events <- ev:
	default: // nobody reads events: drop them rather than stall answers
	}
}

func (c *Client) deliverAnswer(m message) {
	id := string(m.ID)
	c.mu.Lock()
	ch, ok := c.pending[id]
	delete(c.pending, id)
	c.mu.Unlock()
	if ok {
		ch <- m // buffered
	}
}

// Execute runs command with args (nil for none) and decodes its answer
// into result (nil to throw it away). QEMU's refusal is an *Error.
func (c *Client) Execute(ctx context.Context, command string, args, result any) error {
	return c.execute(ctx, command, args, result, nil)
}

// execute is Execute with oob sent beside the command's bytes (the
// descriptors of SendFD).
func (c *Client) execute(ctx context.Context, command string, args, result any, oob []byte) error {
	c.mu.Lock()
	select {
	case <-c.done:
		err := c.err
		c.mu.Unlock()
		return fmt.Errorf("qmp %s: %w", command, err)
	default:
	}
	c.nextID++
	id := strconv.Quote(strconv.FormatUint(c.nextID, 10))
	ch := make(chan message, 1)
	c.pending[id] = ch
	c.mu.Unlock()

	req := struct {
		Execute   string          `json:"execute"`
		Arguments any             `json:"arguments,omitempty"`
		ID        json.RawMessage `json:"id"`
	}{command, args, json.RawMessage(id)}
	line, err := json.Marshal(req)
	if err != nil {
		c.forget(id)
		return fmt.Errorf("qmp %s: encode arguments: %w", command, err)
	}
	if err := c.write(append(line, '\n'), oob); err != nil {
		c.forget(id)
		return fmt.Errorf("qmp %s: %w", command, err)
	}
	select {
	case m := <-ch:
		if m.Error != nil {
			return fmt.Errorf("qmp %s: %w", command, m.Error)
		}
		if result != nil {
			if err := json.Unmarshal(m.Return, result); err != nil {
				return fmt.Errorf("qmp %s: decode answer: %w", command, err)
			}
		}
		return nil
	case <-c.done:
		c.forget(id)
		return fmt.Errorf("qmp %s: %w", command, c.err)
	case <-ctx.Done():
		c.forget(id)
		return fmt.Errorf("qmp %s: %w", command, ctx.Err())
	}
}

func (c *Client) forget(id string) {
	c.mu.Lock()
	delete(c.pending, id)
	c.mu.Unlock()
}

// write sends one line. It does not watch ctx: QEMU reads its monitor
// while it runs, and a QEMU that stopped reading is found by the answer
// that does not come.
func (c *Client) write(line, oob []byte) error {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	if oob == nil {
		_, err := c.conn.Write(line)
		return err
	}
	uc, ok := c.conn.(*net.UnixConn)
	if !ok {
		return fmt.Errorf("send a file descriptor over %T: not a Unix socket", c.conn)
	}
	_, _, err := uc.WriteMsgUnix(line, oob, nil)
	return err
}

// Events returns the events QEMU sends. The channel is closed when the
// connection ends. Events nobody receives are dropped once eventBuffer of
// them wait.
func (c *Client) Events() <-chan Event { return c.events }

// Done is closed when the connection has ended; Err then says why.
func (c *Client) Done() <-chan struct{} { return c.done }

// Err is why the connection ended, or nil while it is open.
func (c *Client) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// Close ends the connection and waits for its reader.
func (c *Client) Close() error {
	err := c.conn.Close()
	<-c.done
	return err
}

// Status is query-status's answer.
type Status struct {
	Status  string `json:"status"` // "running", "paused", "prelaunch", "shutdown", …
	Running bool   `json:"running"`
}

// QueryStatus asks whether the guest's vCPUs run.
func (c *Client) QueryStatus(ctx context.Context) (Status, error) {
	var s Status
	err := c.Execute(ctx, "query-status", nil, &s)
	return s, err
}

// Stop stops the guest's vCPUs.
func (c *Client) Stop(ctx context.Context) error { return c.Execute(ctx, "stop", nil, nil) }

// Cont runs the guest's vCPUs again.
func (c *Client) Cont(ctx context.Context) error { return c.Execute(ctx, "cont", nil, nil) }

// Quit ends the QEMU process. QEMU may close the connection before its
// answer arrives; that counts as done.
func (c *Client) Quit(ctx context.Context) error {
	err := c.Execute(ctx, "quit", nil, nil)
	if err != nil && ctx.Err() == nil && c.Err() != nil {
		return nil
	}
	return err
}
