// Package shellrelay pumps an interactive shell's bidirectional stream one
// hop on: from the apiserver to an edge, or from an edge to the sandbox's
// agent. The hop above has read the stream's first message already (the
// apiserver reads it to route the stream) and hands it over with the rest.
package shellrelay

import (
	"context"
	"errors"
	"io"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// Stream is the server half of a shell's stream, the caller's side.
type Stream = interface {
	Receive() (*dsecv1.ShellInput, error)
	Send(*dsecv1.ShellOutput) error
}

// Hop is the client half of the next hop's stream.
type Hop interface {
	Send(*dsecv1.ShellInput) error
	Receive() (*dsecv1.ShellOutput, error)
	CloseRequest() error
	CloseResponse() error
}

// Relay sends first and then everything the caller sends on to the next
// hop, opened by open, and sends the hop's output back, until the hop ends
// its output. It returns nil at a clean end; the hop's errors go through
// hopErr, which says what they mean at this hop.
func Relay(ctx context.Context, first *dsecv1.ShellInput, stream Stream,
	open func(context.Context) *connect.BidiStreamForClient[dsecv1.ShellInput, dsecv1.ShellOutput], hopErr func(error) error) error {
	return RelayHop(ctx, first, stream, func(ctx context.Context) Hop { return open(ctx) }, hopErr)
}

// RelayHop is Relay to a hop of any kind (the edge's to an agent re-attaches
// across a microVM's pause: agentclient.ReattachingShell).
func RelayHop(ctx context.Context, first *dsecv1.ShellInput, stream Stream, open func(context.Context) Hop, hopErr func(error) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	up := open(ctx)
	if err := up.Send(first); err != nil {
		return hopErr(err)
	}
	go func() {
		defer up.CloseRequest()
		for {
			in, err := stream.Receive()
			if err != nil {
				return
			}
			if err := up.Send(in); err != nil {
				return
			}
		}
	}()
	for {
		msg, err := up.Receive()
		if err != nil {
			up.CloseResponse()
			if errors.Is(err, io.EOF) {
				return nil
			}
			return hopErr(err)
		}
		if err := stream.Send(msg); err != nil {
			return err
		}
	}
}
