package execwire

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
)

// WatchPreface opens a watch connection. The agent answers it with the
// same bytes and then holds the connection open, silent, for as long as it
// runs: the edge learns that the agent exited (or was killed, or
// OOM-killed) from the connection's end, at once, without asking. An idle
// watch costs neither side a wake-up, where asking every agent in turn cost
// the node a round trip per sandbox every few seconds.
const WatchPreface = "DSECW/1\n"

// watchPadding follows WatchPreface from the client. An agent older than
// watch connections hands the connection to its HTTP server, which reads
// 14 bytes (the length of HTTP/2's "PRI * HTTP/2.0") before it answers
// anything: with these it has exactly them, and refuses the request at
// once, also over a channel that buffers nothing. The agent drops them.
const watchPadding = "\r\n\r\n\r\n"

// ErrNotWatched means the agent does not hold watch connections: it is
// older than them, and only asking it (Ping) tells whether it lives.
var ErrNotWatched = errors.New("agent does not hold watch connections")

// holdWatch serves a watch connection whose preface Split read: it
// answers, then reads (and drops) whatever comes until the client closes
// it. The agent's exit closes it from this side.
func holdWatch(c net.Conn) {
	defer c.Close()
	if _, err := io.WriteString(c, WatchPreface); err != nil {
		return
	}
	var b [64]byte
	for {
		if _, err := c.Read(b[:]); err != nil {
			return
		}
	}
}

// Watch opens a watch connection through dial and holds it until the
// agent's end closes or ctx ends. It returns ctx's error once ctx ended,
// ErrNotWatched for an agent older than watch connections (it answers the
// preface as HTTP), and otherwise why the connection ended or could not be
// made: the agent exited, or its channel is gone. A frozen agent answers
// once thawed; Watch waits for that.
func Watch(ctx context.Context, dial func(ctx context.Context) (net.Conn, error)) error {
	c, err := dial(ctx)
	if err != nil {
		return orCtx(ctx, fmt.Errorf("connect to agent: %w", err))
	}
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	if _, err := io.WriteString(c, WatchPreface+watchPadding); err != nil {
		return orCtx(ctx, fmt.Errorf("open watch connection: %w", err))
	}
	answer := make([]byte, len(WatchPreface))
	if _, err := io.ReadFull(c, answer); err != nil {
		return orCtx(ctx, fmt.Errorf("open watch connection: %w", err))
	}
	if string(answer) != WatchPreface {
		return ErrNotWatched
	}
	var b [64]byte
	for {
		if _, err := c.Read(b[:]); err != nil {
			return orCtx(ctx, fmt.Errorf("watch connection ended: %w", err))
		}
	}
}

// orCtx is ctx's error once ctx ended (the error was Watch closing the
// connection itself), else err.
func orCtx(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}
