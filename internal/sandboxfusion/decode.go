package sandboxfusion

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"maps"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
)

// FieldError is one entry of FastAPI's 422 body: where (loc, from "body"
// down), what (msg) and which kind (type, pydantic's names).
type FieldError struct {
	Loc  []any          `json:"loc"`
	Msg  string         `json:"msg"`
	Type string         `json:"type"`
	Ctx  map[string]any `json:"ctx,omitempty"`
}

// validationBody is FastAPI's 422 body.
type validationBody struct {
	Detail []FieldError `json:"detail"`
}

// errTooLarge marks a body over MaxBodyBytes.
var errTooLarge = errors.New("request body too large")

// readBody reads the request's JSON object, answering 413 or 422 itself
// when it cannot (ok false).
func (h *handler) readBody(w http.ResponseWriter, req *http.Request) (map[string]any, bool) {
	data, err := io.ReadAll(http.MaxBytesReader(w, req.Body, h.cfg.MaxBodyBytes))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			writeJSON(w, http.StatusRequestEntityTooLarge,
				detail("the request body is over the %d bytes this server takes", h.cfg.MaxBodyBytes))
			return nil, false
		}
		// The client went away mid-body; there is no one to answer.
		return nil, false
	}
	if len(bytes.TrimSpace(data)) == 0 {
		writeJSON(w, http.StatusUnprocessableEntity, validationBody{[]FieldError{{Loc: []any{"body"}, Msg: "Field required", Type: "missing"}}})
		return nil, false
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var v any
	err = dec.Decode(&v)
	if err == nil {
		if _, terr := dec.Token(); terr != io.EOF {
			err = errors.New("extra data after the JSON value")
		}
	}
	if err != nil {
		offset := dec.InputOffset()
		var se *json.SyntaxError
		if errors.As(err, &se) {
			offset = se.Offset
		}
		writeJSON(w, http.StatusUnprocessableEntity, validationBody{[]FieldError{{
			Loc: []any{"body", offset}, Msg: "JSON decode error", Type: "json_invalid",
			Ctx: map[string]any{"error": err.Error()},
		}}})
		return nil, false
	}
	m, ok := v.(map[string]any)
	if !ok {
		writeJSON(w, http.StatusUnprocessableEntity, validationBody{[]FieldError{{
			Loc: []any{"body"}, Msg: "Input should be a valid dictionary or object to extract fields from", Type: "model_attributes_type",
		}}})
		return nil, false
	}
	return m, true
}

// checker reads fields out of decoded JSON as pydantic's lax mode would,
// collecting an error per bad field. Unknown fields are ignored.
type checker struct {
	errs []FieldError
}

func (c *checker) add(loc []any, key any, typ, msg string) {
	c.errs = append(c.errs, FieldError{Loc: append(slices.Clone(loc), key), Msg: msg, Type: typ})
}

func (c *checker) failed() bool { return len(c.errs) > 0 }

// get returns m[key] and whether it is there and not null; a required
// field that is missing is an error.
func (c *checker) get(m map[string]any, loc []any, key string, required bool) (any, bool) {
	v, ok := m[key]
	if !ok {
		if required {
			c.add(loc, key, "missing", "Field required")
		}
		return nil, false
	}
	return v, v != nil
}

// str reads a string field; null is an error unless nullable.
func (c *checker) str(m map[string]any, loc []any, key string, required, nullable bool) (string, bool) {
	v, ok := c.get(m, loc, key, required)
	if !ok {
		if _, present := m[key]; present && !nullable {
			c.add(loc, key, "string_type", "Input should be a valid string")
		}
		return "", false
	}
	s, isStr := v.(string)
	if !isStr {
		c.add(loc, key, "string_type", "Input should be a valid string")
		return "", false
	}
	return s, true
}

// float reads a number (or a numeric string, as pydantic accepts).
func (c *checker) float(m map[string]any, loc []any, key string, def float64, nullable bool) float64 {
	v, ok := c.get(m, loc, key, false)
	if !ok {
		if _, present := m[key]; present && !nullable {
			c.add(loc, key, "float_type", "Input should be a valid number")
		}
		return def
	}
	var s string
	switch x := v.(type) {
	case json.Number:
		s = x.String()
	case string:
		s = strings.TrimSpace(x)
	default:
		c.add(loc, key, "float_type", "Input should be a valid number")
		return def
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsNaN(f) {
		c.add(loc, key, "float_parsing", "Input should be a valid number, unable to parse string as a number")
		return def
	}
	return f
}

// integer reads an integer (a float with no fraction, or a string of
// digits, as pydantic accepts).
func (c *checker) integer(m map[string]any, loc []any, key string, def int64) int64 {
	v, ok := c.get(m, loc, key, false)
	if !ok {
		if _, present := m[key]; present {
			c.add(loc, key, "int_type", "Input should be a valid integer")
		}
		return def
	}
	var s string
	switch x := v.(type) {
	case json.Number:
		s = x.String()
	case string:
		s = strings.TrimSpace(x)
	default:
		c.add(loc, key, "int_type", "Input should be a valid integer")
		return def
	}
	if n, err := strconv.ParseInt(s, 10, 64); err == nil {
		return n
	}
	if f, err := strconv.ParseFloat(s, 64); err == nil && f == math.Trunc(f) && math.Abs(f) < 1<<62 {
		return int64(f)
	}
	c.add(loc, key, "int_parsing", "Input should be a valid integer, unable to parse string as an integer")
	return def
}

func (c *checker) boolean(v any) (bool, bool) {
	switch x := v.(type) {
	case bool:
		return x, true
	case json.Number:
		switch x.String() {
		case "0":
			return false, true
		case "1":
			return true, true
		}
	case string:
		switch strings.ToLower(x) {
		case "true", "1", "yes", "on", "y", "t":
			return true, true
		case "false", "0", "no", "off", "n", "f":
			return false, true
		}
	}
	return false, false
}

// object reads a JSON object field (null = absent).
func (c *checker) object(m map[string]any, loc []any, key string, required bool) (map[string]any, bool) {
	v, ok := c.get(m, loc, key, required)
	if !ok {
		return nil, false
	}
	o, isObj := v.(map[string]any)
	if !isObj {
		c.add(loc, key, "dict_type", "Input should be a valid dictionary")
		return nil, false
	}
	return o, true
}

// strList reads a list of strings.
func (c *checker) strList(m map[string]any, loc []any, key string) []string {
	v, ok := c.get(m, loc, key, false)
	if !ok {
		if _, present := m[key]; present {
			c.add(loc, key, "list_type", "Input should be a valid list")
		}
		return nil
	}
	l, isList := v.([]any)
	if !isList {
		c.add(loc, key, "list_type", "Input should be a valid list")
		return nil
	}
	out := make([]string, 0, len(l))
	for i, e := range l {
		s, isStr := e.(string)
		if !isStr {
			c.add(append(slices.Clone(loc), key), i, "string_type", "Input should be a valid string")
			continue
		}
		out = append(out, s)
	}
	return out
}

// files reads SandboxFusion's files: path → base64 content, where null
// (when nullable) or a path holding IGNORE_THIS_FILE skips the entry, as
// SandboxFusion's restore_files does.
func (c *checker) files(m map[string]any, loc []any, key string, nullable bool) map[string][]byte {
	o, ok := c.object(m, loc, key, false)
	if !ok {
		if v, present := m[key]; present && v == nil {
			c.add(loc, key, "dict_type", "Input should be a valid dictionary")
		}
		return nil
	}
	out := make(map[string][]byte, len(o))
	floc := append(slices.Clone(loc), key)
	for _, p := range slices.Sorted(maps.Keys(o)) {
		v := o[p]
		if v == nil && nullable {
			continue
		}
		s, isStr := v.(string)
		if !isStr {
			c.add(floc, p, "string_type", "Input should be a valid string")
			continue
		}
		if strings.Contains(p, "IGNORE_THIS_FILE") {
			continue
		}
		data, err := decodeBase64(s)
		if err != nil {
			c.add(floc, p, "base64_decode", "Base64 decoding error: "+err.Error())
			continue
		}
		out[p] = data
	}
	return out
}

// decodeBase64 decodes standard base64 as Python's b64decode does by
// default: white space (line breaks of MIME-style encoders) is ignored,
// padding is required.
func decodeBase64(s string) ([]byte, error) {
	s = strings.Map(func(r rune) rune {
		switch r {
		case ' ', '\t', '\r', '\n', '\v', '\f':
			return -1
		}
		return r
	}, s)
	return base64.StdEncoding.DecodeString(s)
}

func (h *handler) reject(w http.ResponseWriter, c *checker) {
	writeJSON(w, http.StatusUnprocessableEntity, validationBody{c.errs})
}

func stringReader(s string) io.Reader { return strings.NewReader(s) }
