// Package pbjson is the JSON form of dsec's API messages that people and
// scripts read: the CLI's --json and the apiserver's Connect JSON (the
// Python SDK's dicts). It is protojson's form (camelCase field names, enums
// by name, bytes in base64) with one difference: 64-bit integers are JSON
// numbers, not strings. protojson quotes them because a JavaScript number
// holds integers exactly only up to 2^53; no dsec field comes near that
// (byte counts, milliseconds since 1970, counts), and a script that reads
// "memoryMb": "512" must convert every number it reads.
package pbjson

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Options change what Marshal writes.
type Options struct {
	// EmitDefaults writes every field, zero values, empty lists and empty
	// maps included (protojson's EmitDefaultValues), so that a record has
	// one shape whatever it holds: a script finds "sandboxes": [] rather
	// than no key. Unset message fields and unset optional fields stay out.
	EmitDefaults bool
}

// Marshal writes m as compact JSON.
func Marshal(m proto.Message, o Options) ([]byte, error) {
	b, err := protojson.MarshalOptions{EmitDefaultValues: o.EmitDefaults}.Marshal(m)
	if err != nil {
		return nil, err
	}
	return Numbers(b, m.ProtoReflect().Descriptor())
}

// Numbers rewrites b, protojson's form of a message of type md, with its
// 64-bit integer fields as JSON numbers. Everything else is kept as it is,
// in its order.
func Numbers(b []byte, md protoreflect.MessageDescriptor) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	w := &writer{dec: dec}
	tok, err := dec.Token()
	if err != nil {
		return nil, fmt.Errorf("rewrite the JSON of %s: %w", md.FullName(), err)
	}
	if err := w.message(tok, md); err != nil {
		return nil, fmt.Errorf("rewrite the JSON of %s: %w", md.FullName(), err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, fmt.Errorf("rewrite the JSON of %s: more than one value", md.FullName())
	}
	return w.out.Bytes(), nil
}

// writer copies the tokens of a decoder to out, following the message's
// descriptor to find the 64-bit integers.
type writer struct {
	dec *json.Decoder
	out bytes.Buffer
}

func (w *writer) next() (json.Token, error) { return w.dec.Token() }

// message copies a message whose first token is tok.
func (w *writer) message(tok json.Token, md protoreflect.MessageDescriptor) error {
	if tok == nil || strings.HasPrefix(string(md.FullName()), "google.protobuf.") {
		// null, or a well-known type with a JSON form of its own.
		return w.any(tok)
	}
	if tok != json.Delim('{') {
		return fmt.Errorf("%s: want an object, have %v", md.FullName(), tok)
	}
	w.out.WriteByte('{')
	for first := true; w.dec.More(); first = false {
		key, err := w.key(first)
		if err != nil {
			return err
		}
		tok, err := w.next()
		if err != nil {
			return err
		}
		fd := md.Fields().ByJSONName(key)
		if fd == nil {
			fd = md.Fields().ByName(protoreflect.Name(key))
		}
		if fd == nil {
			err = w.any(tok)
		} else {
			err = w.field(tok, fd)
		}
		if err != nil {
			return err
		}
	}
	return w.end('}')
}

// field copies the value of field fd: a list, a map or a single value.
func (w *writer) field(tok json.Token, fd protoreflect.FieldDescriptor) error {
	switch {
	case fd.IsList() && tok == json.Delim('['):
		w.out.WriteByte('[')
		for first := true; w.dec.More(); first = false {
			if !first {
				w.out.WriteByte(',')
			}
			tok, err := w.next()
			if err != nil {
				return err
			}
			if err := w.single(tok, fd); err != nil {
				return err
			}
		}
		return w.end(']')
	case fd.IsMap() && tok == json.Delim('{'):
		w.out.WriteByte('{')
		for first := true; w.dec.More(); first = false {
			if _, err := w.key(first); err != nil {
				return err
			}
			tok, err := w.next()
			if err != nil {
				return err
			}
			if err := w.single(tok, fd.MapValue()); err != nil {
				return err
			}
		}
		return w.end('}')
	}
	return w.single(tok, fd)
}

// single copies one value of fd's kind.
func (w *writer) single(tok json.Token, fd protoreflect.FieldDescriptor) error {
	switch fd.Kind() {
	case protoreflect.MessageKind, protoreflect.GroupKind:
		return w.message(tok, fd.Message())
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		if s, ok := tok.(string); ok {
			if _, err := strconv.ParseInt(s, 10, 64); err == nil {
				w.out.WriteString(s)
				return nil
			}
		}
	case protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		if s, ok := tok.(string); ok {
			if _, err := strconv.ParseUint(s, 10, 64); err == nil {
				w.out.WriteString(s)
				return nil
			}
		}
	}
	return w.any(tok)
}

// any copies a value whose first token is tok, as it is.
func (w *writer) any(tok json.Token) error {
	switch tok {
	case json.Delim('{'):
		w.out.WriteByte('{')
		for first := true; w.dec.More(); first = false {
			if _, err := w.key(first); err != nil {
				return err
			}
			tok, err := w.next()
			if err != nil {
				return err
			}
			if err := w.any(tok); err != nil {
				return err
			}
		}
		return w.end('}')
	case json.Delim('['):
		w.out.WriteByte('[')
		for first := true; w.dec.More(); first = false {
			if !first {
				w.out.WriteByte(',')
			}
			tok, err := w.next()
			if err != nil {
				return err
			}
			if err := w.any(tok); err != nil {
				return err
			}
		}
		return w.end(']')
	}
	return w.scalar(tok)
}

// key reads an object's next key and writes it, after a comma unless it
// is the first.
func (w *writer) key(first bool) (string, error) {
	tok, err := w.next()
	if err != nil {
		return "", err
	}
	key, ok := tok.(string)
	if !ok {
		return "", fmt.Errorf("want an object key, have %v", tok)
	}
	if !first {
		w.out.WriteByte(',')
	}
	if err := w.scalar(key); err != nil {
		return "", err
	}
	w.out.WriteByte(':')
	return key, nil
}

// end reads the closing delimiter d and writes it.
func (w *writer) end(d json.Delim) error {
	tok, err := w.next()
	if err != nil {
		return err
	}
	if tok != d {
		return fmt.Errorf("want %v, have %v", d, tok)
	}
	w.out.WriteString(d.String())
	return nil
}

// scalar writes a string, number, boolean or null.
func (w *writer) scalar(tok json.Token) error {
	switch v := tok.(type) {
	case nil:
		w.out.WriteString("null")
	case bool:
		w.out.WriteString(strconv.FormatBool(v))
	case json.Number:
		w.out.WriteString(v.String())
	case string:
		// As protojson writes strings: <, > and & as they are.
		enc := json.NewEncoder(&w.out)
		enc.SetEscapeHTML(false)
		if err := enc.Encode(v); err != nil {
			return err
		}
		w.out.Truncate(w.out.Len() - 1) // Encode's newline
	default:
		return fmt.Errorf("unexpected JSON token %v", tok)
	}
	return nil
}
