// Package execwire is the agent channel's fast path for exec: the same
// ExecRequest and ExecEvent messages as the Connect service, framed on a
// plain connection with no HTTP around them.
//
// Exec is the call a training loop makes thousands of times a second, and
// on these machines a Connect call over HTTP/1.1 spends about 0.15 ms per
// hop in net/http's connection machinery (a reader and a writer goroutine
// per client connection, a background read per server request) before any
// message moves. Everything else on the channel stays Connect.
//
// A connection opens with Preface, which is how the agent tells it from an
// HTTP connection on the same socket (see Split). Then, one call at a time:
//
//	client: frame(ExecRequest)
//	agent:  frame(ExecEvent) ... frame(end)
//
// A frame is Connect's envelope: one flags byte, a big-endian uint32
// length, and that many bytes of protobuf. The end frame has FlagEnd set
// and carries an empty payload on success, or the call's error as JSON
// {"code": "not_found", "message": "..."}. After the end frame the
// connection carries the next call. The client sends nothing while a call
// runs; closing the connection cancels the call.
//
// The same socket carries the edge's watch connection (WatchPreface,
// Watch): one per agent, held open and silent, whose end tells the edge
// the agent is gone.
package execwire

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
)

// Preface opens every connection of the framed path.
const Preface = "DSECX/1\n"

// FlagEnd marks the frame that ends a call.
const FlagEnd = 0x02

// MaxFrame bounds one frame, in either direction.
const MaxFrame = 64 << 20

// MaxStdin is the largest stdin an exec request may carry: the frame of
// the request holds it, with room for the rest of the request.
const MaxStdin = MaxFrame - 1<<20

// maxKept is the largest frame buffer a connection keeps for its next
// frame; larger frames get a buffer of their own.
const maxKept = 64 << 10

// errFrameTooLarge is returned for a frame longer than MaxFrame.
var errFrameTooLarge = fmt.Errorf("frame larger than %d bytes", MaxFrame)

// appendFrame appends m, framed, to b.
func appendFrame(b []byte, flags byte, m proto.Message) ([]byte, error) {
	start := len(b)
	b = append(b, flags, 0, 0, 0, 0)
	b, err := proto.MarshalOptions{}.MarshalAppend(b, m)
	if err != nil {
		return nil, fmt.Errorf("marshal %T: %w", m, err)
	}
	n := len(b) - start - 5
	if n > MaxFrame {
		return nil, fmt.Errorf("%T of %d bytes: %w", m, n, errFrameTooLarge)
	}
	binary.BigEndian.PutUint32(b[start+1:], uint32(n))
	return b, nil
}

// endPayload is the JSON of an end frame that carries an error.
type endPayload struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// appendEnd appends the end frame of a call that returned err.
func appendEnd(b []byte, err error) []byte {
	var payload []byte
	if err != nil {
		code := connect.CodeUnknown
		msg := err.Error()
		var ce *connect.Error
		if errors.As(err, &ce) {
			code, msg = ce.Code(), ce.Message()
		}
		payload, _ = json.Marshal(endPayload{Code: code.String(), Message: msg})
	}
	b = append(b, FlagEnd, 0, 0, 0, 0)
	binary.BigEndian.PutUint32(b[len(b)-4:], uint32(len(payload)))
	return append(b, payload...)
}

// parseEnd turns an end frame's payload back into the call's error: nil,
// or a *connect.Error with the code and message the agent sent.
func parseEnd(payload []byte) error {
	if len(payload) == 0 {
		return nil
	}
	var p endPayload
	if err := json.Unmarshal(payload, &p); err != nil {
		return fmt.Errorf("agent's end frame: %w", err)
	}
	var code connect.Code
	if err := code.UnmarshalText([]byte(p.Code)); err != nil {
		code = connect.CodeUnknown
	}
	return connect.NewError(code, errors.New(p.Message))
}

// readFrame reads one frame and returns its flags and payload, which may
// alias buf, and the buffer to pass next time.
func readFrame(r *bufio.Reader, buf []byte) (flags byte, payload, grown []byte, err error) {
	var hdr [5]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return 0, nil, buf, err
	}
	n := binary.BigEndian.Uint32(hdr[1:])
	if n > MaxFrame {
		return 0, nil, buf, fmt.Errorf("frame of %d bytes: %w", n, errFrameTooLarge)
	}
	switch {
	case int(n) <= cap(buf):
		payload = buf[:n]
	case n <= maxKept:
		buf = make([]byte, n)
		payload = buf
	default:
		payload = make([]byte, n) // a large stdin is not kept for the next call
	}
	if _, err := io.ReadFull(r, payload); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return 0, nil, buf, err
	}
	return hdr[0], payload, buf, nil
}
