package edgeclient

import (
	"fmt"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// passCodec is the protobuf codec of the client that relays streams. It
// reads a message without decoding it: the frame's bytes are kept as the
// message's unknown fields, which protobuf's marshalling writes out again
// verbatim. So an exec's events, a download's chunks and an import's
// progress cross the apiserver as the edge framed them: one copy, no
// decode and re-encode per message. Whoever needs the fields decodes the
// bytes itself: the apiserver's JSON codec does, for JSON callers.
//
// Requests are marshalled as usual: the apiserver checked them already.
type passCodec struct{}

func (passCodec) Name() string { return "proto" }

func (passCodec) Marshal(m any) ([]byte, error) {
	pm, ok := m.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("marshal %T: not a protobuf message", m)
	}
	return proto.Marshal(pm)
}

func (passCodec) Unmarshal(data []byte, m any) error {
	pm, ok := m.(proto.Message)
	if !ok {
		return fmt.Errorf("unmarshal %T: not a protobuf message", m)
	}
	proto.Reset(pm)
	if len(data) > 0 {
		// Connect reuses its read buffers: keep a copy.
		pm.ProtoReflect().SetUnknown(append(protoreflect.RawFields(nil), data...))
	}
	return nil
}

// hasField reports whether m, decoded or passed through, sets the field
// numbered n at its top level.
func hasField(m proto.Message, n protowire.Number) bool {
	r := m.ProtoReflect()
	if fd := r.Descriptor().Fields().ByNumber(n); fd != nil && r.Has(fd) {
		return true
	}
	b := r.GetUnknown()
	for len(b) > 0 {
		num, typ, l := protowire.ConsumeTag(b)
		if l < 0 {
			return false
		}
		if num == n {
			return true
		}
		b = b[l:]
		l = protowire.ConsumeFieldValue(num, typ, b)
		if l < 0 {
			return false
		}
		b = b[l:]
	}
	return false
}
