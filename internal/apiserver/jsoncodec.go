package apiserver

import (
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strconv"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"dsec.dev/dsec/internal/pbjson"
)

// jsonCodec is Connect's JSON codec with two differences. Its answers
// carry 64-bit integers as JSON numbers, not strings (pbjson): the Python
// SDK's dicts hold "memoryMb": 512, not "512". And when a request does
// not decode, it names the field at fault. protojson's own error gives a
// line and column only, which says nothing useful about a network rule
// written as {"pypi": "false"}: a string, where allow or deny must be a JSON
// boolean. Rules are security policy, so a value that is not exactly true or
// false is refused, and the refusal names the rule.
type jsonCodec struct{ name string }

// jsonCodecs serve both names Connect knows JSON by.
func jsonCodecs() []jsonCodec {
	return []jsonCodec{{name: "json"}, {name: "json; charset=utf-8"}}
}

func (c jsonCodec) Name() string   { return c.name }
func (c jsonCodec) IsBinary() bool { return false }

func (c jsonCodec) Marshal(m any) ([]byte, error) {
	pm, ok := m.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("marshal %T: not a protobuf message", m)
	}
	if len(pm.ProtoReflect().GetUnknown()) > 0 {
		// A message relayed from a remote edge undecoded (its fields are
		// the edge's wire bytes, kept as unknown fields): decode it for JSON.
		full := pm.ProtoReflect().New().Interface()
		b, err := proto.Marshal(pm)
		if err == nil {
			err = proto.Unmarshal(b, full)
		}
		if err != nil {
			return nil, fmt.Errorf("marshal %T: decode its relayed bytes: %w", m, err)
		}
		pm = full
	}
	return pbjson.Marshal(pm, pbjson.Options{})
}

func (c jsonCodec) Unmarshal(data []byte, m any) error {
	pm, ok := m.(proto.Message)
	if !ok {
		return fmt.Errorf("unmarshal into %T: not a protobuf message", m)
	}
	if len(data) == 0 {
		return errors.New("an empty payload is not a JSON object")
	}
	// Unknown fields are dropped, as Connect does, so clients and servers
	// need not share one version of the schema.
	err := protojson.UnmarshalOptions{DiscardUnknown: true}.Unmarshal(data, pm)
	if err == nil {
		return nil
	}
	var doc any
	if json.Unmarshal(data, &doc) == nil {
		if why := badBool(pm.ProtoReflect().Descriptor(), doc, ""); why != "" {
			return errors.New(why)
		}
	}
	return fmt.Errorf("unmarshal into %T: %w", m, err)
}

// badBool walks a decoded JSON document along message descriptor md and
// describes the first boolean (a field or a map value) given anything but
// true or false; "" when there is none.
func badBool(md protoreflect.MessageDescriptor, doc any, path string) string {
	obj, ok := doc.(map[string]any)
	if !ok {
		return ""
	}
	keys := make([]string, 0, len(obj))
	for k := range obj {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fd := md.Fields().ByJSONName(k)
		if fd == nil {
			fd = md.Fields().ByName(protoreflect.Name(k))
		}
		if fd == nil || obj[k] == nil {
			continue
		}
		p := k
		if path != "" {
			p = path + "." + k
		}
		v := obj[k]
		switch {
		case fd.IsMap():
			m, ok := v.(map[string]any)
			if !ok {
				continue
			}
			vd := fd.MapValue()
			mkeys := make([]string, 0, len(m))
			for mk := range m {
				mkeys = append(mkeys, mk)
			}
			sort.Strings(mkeys)
			for _, mk := range mkeys {
				if why := badValue(vd, m[mk], p+"["+strconv.Quote(mk)+"]"); why != "" {
					return why
				}
			}
		case fd.IsList():
			l, ok := v.([]any)
			if !ok {
				continue
			}
			for i, e := range l {
				if why := badValue(fd, e, fmt.Sprintf("%s[%d]", p, i)); why != "" {
					return why
				}
			}
		default:
			if why := badValue(fd, v, p); why != "" {
				return why
			}
		}
	}
	return ""
}

func badValue(fd protoreflect.FieldDescriptor, v any, path string) string {
	switch fd.Kind() {
	case protoreflect.BoolKind:
		if _, ok := v.(bool); !ok {
			return fmt.Sprintf("%s is %s: want a JSON boolean, true or false", path, describeJSON(v))
		}
	case protoreflect.MessageKind:
		return badBool(fd.Message(), v, path)
	}
	return ""
}

func describeJSON(v any) string {
	switch v := v.(type) {
	case string:
		return "the string " + strconv.Quote(v)
	case float64:
		return "the number " + strconv.FormatFloat(v, 'g', -1, 64)
	case []any:
		return "a list"
	case map[string]any:
		return "an object"
	case nil:
		return "null"
	}
	return fmt.Sprintf("%v", v)
}
