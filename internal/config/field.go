package config

import (
	"encoding"
	"fmt"
	"log/slog"
	"net"
	"reflect"
	"strconv"
	"strings"
	"time"

	"dsec.dev/dsec/internal/edge/swap"
	"dsec.dev/dsec/internal/qos"
)

// Field is one setting of a role's struct.
type Field struct {
	Key    string // the file's dotted key: limits.max_sandboxes
	Flag   string // the command-line flag, without dashes: max-sandboxes
	Env    string // the environment variable: DSECD_MAX_SANDBOXES
	Help   string
	Secret bool   // a URL whose password Print redacts
	List   string // for a list: "repeat" (a flag per item) or "comma"
	check  string
	v      reflect.Value // the field, settable
}

// EnvName is the environment variable that sets a flag: DSECD_ and its
// name, upper case, dashes as underscores (--max-sandboxes:
// DSECD_MAX_SANDBOXES).
func EnvName(flag string) string {
	return "DSECD_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}

// Fields lists the settings of cfg, a pointer to a role's struct, in the
// order they are declared. Embedded structs add their fields where they
// are embedded; a struct field with a key is a table of the file.
func Fields(cfg any) []Field {
	v := reflect.ValueOf(cfg)
	if v.Kind() != reflect.Pointer || v.Elem().Kind() != reflect.Struct {
		panic(fmt.Sprintf("config.Fields: %T is not a pointer to a struct", cfg))
	}
	var out []Field
	walk(v.Elem(), "", &out)
	return out
}

var (
	durationType = reflect.TypeFor[time.Duration]()
	textType     = reflect.TypeFor[encoding.TextUnmarshaler]()
)

func walk(v reflect.Value, prefix string, out *[]Field) {
	t := v.Type()
	for i := range t.NumField() {
		sf := t.Field(i)
		fv := v.Field(i)
		key := sf.Tag.Get("key")
		if sf.Anonymous && key == "" {
			walk(fv, prefix, out)
			continue
		}
		if key == "" {
			continue
		}
		if fv.Kind() == reflect.Struct && !isLeaf(fv) {
			walk(fv, prefix+key+".", out)
			continue
		}
		f := Field{
			Key:    prefix + key,
			Flag:   sf.Tag.Get("flag"),
			Help:   sf.Tag.Get("help"),
			Secret: sf.Tag.Get("secret") != "",
			List:   sf.Tag.Get("list"),
			check:  sf.Tag.Get("check"),
			v:      fv,
		}
		f.Env = EnvName(f.Flag)
		*out = append(*out, f)
	}
}

// isLeaf reports whether a struct-typed field is one value (netip.Prefix)
// rather than a table.
func isLeaf(v reflect.Value) bool {
	return v.Addr().Type().Implements(textType)
}

// Value is the field's value.
func (f Field) Value() any { return f.v.Interface() }

// set parses s into the field. A list takes s as one item (adding it)
// when add is set, else as items separated by commas (replacing them).
func (f Field) set(s string, add bool) error {
	nv := reflect.New(f.v.Type()).Elem()
	if f.v.Kind() == reflect.Slice {
		var items []string
		if add {
			items = append(f.v.Interface().([]string), s)
		} else if s != "" {
			for _, it := range strings.Split(s, ",") {
				items = append(items, strings.TrimSpace(it))
			}
		}
		return f.setList(items)
	}
	if err := parseInto(nv, s); err != nil {
		return err
	}
	if err := f.validate(nv); err != nil {
		return err
	}
	f.v.Set(nv)
	return nil
}

// setList sets a list field's items.
func (f Field) setList(items []string) error {
	if f.v.Kind() != reflect.Slice {
		return fmt.Errorf("want %s, not a list", kindName(f.v.Type()))
	}
	for _, it := range items {
		if err := f.validate(reflect.ValueOf(it)); err != nil {
			return err
		}
	}
	f.v.Set(reflect.ValueOf(items))
	return nil
}

func parseInto(v reflect.Value, s string) error {
	if v.Type() == durationType {
		d, err := time.ParseDuration(s)
		if err != nil {
			return fmt.Errorf("want a duration such as 90s or 1h30m: %q", s)
		}
		v.SetInt(int64(d))
		return nil
	}
	if v.Addr().Type().Implements(textType) {
		return v.Addr().Interface().(encoding.TextUnmarshaler).UnmarshalText([]byte(s))
	}
	switch v.Kind() {
	case reflect.String:
		v.SetString(s)
	case reflect.Bool:
		b, err := strconv.ParseBool(s)
		if err != nil {
			return fmt.Errorf("want true or false: %q", s)
		}
		v.SetBool(b)
	case reflect.Int, reflect.Int64:
		n, err := strconv.ParseInt(s, 0, v.Type().Bits())
		if err != nil {
			return fmt.Errorf("want an integer: %q", s)
		}
		v.SetInt(n)
	case reflect.Uint16:
		n, err := strconv.ParseUint(s, 0, 16)
		if err != nil {
			return fmt.Errorf("want an integer from 0 to 65535: %q", s)
		}
		v.SetUint(n)
	case reflect.Float64:
		n, err := strconv.ParseFloat(s, 64)
		if err != nil {
			return fmt.Errorf("want a number: %q", s)
		}
		v.SetFloat(n)
	default:
		return fmt.Errorf("config: a field of type %s cannot be set", v.Type())
	}
	return nil
}

// validate checks a value the field's check names.
func (f Field) validate(v reflect.Value) error {
	s := v.String()
	switch f.check {
	case "":
	case "log-level":
		var l slog.Level
		if err := l.UnmarshalText([]byte(s)); err != nil {
			return fmt.Errorf("want debug, info, warn or error: %q", s)
		}
	case "runsc-platform":
		if s != "" && s != "systrap" && s != "ptrace" && s != "kvm" {
			return fmt.Errorf("want systrap, ptrace or kvm: %q", s)
		}
	case "layer-mode":
		if s != "ondemand" && s != "eager" && s != "local" && s != "tar" {
			return fmt.Errorf("want ondemand, eager, local or tar: %q", s)
		}
	case "swap":
		if _, err := swap.Parse(s); err != nil {
			return err
		}
	case "hostport":
		// A DNS server without its port would fail every query it is
		// asked, long after the start.
		if host, port, err := net.SplitHostPort(s); err != nil || host == "" || port == "" {
			return fmt.Errorf("want HOST:PORT, such as 10.0.0.53:53: %q", s)
		}
	case "qos":
		if _, err := qos.Parse(s, qos.Latency); err != nil {
			return err
		}
	default:
		panic("config: unknown check " + f.check)
	}
	return nil
}

// String formats the field's value as a flag or variable takes it.
func (f Field) String() string {
	return formatValue(f.v)
}

func formatValue(v reflect.Value) string {
	switch {
	case v.Type() == durationType:
		return time.Duration(v.Int()).String()
	case v.Kind() == reflect.Slice:
		return strings.Join(v.Interface().([]string), ",")
	case v.CanAddr() && v.Addr().Type().Implements(reflect.TypeFor[encoding.TextMarshaler]()):
		b, _ := v.Addr().Interface().(encoding.TextMarshaler).MarshalText()
		return string(b)
	}
	if m, ok := v.Interface().(encoding.TextMarshaler); ok {
		b, _ := m.MarshalText()
		return string(b)
	}
	return fmt.Sprint(v.Interface())
}

// kindName says what a field of type t takes, for errors and docs.
func kindName(t reflect.Type) string {
	switch {
	case t == durationType:
		return "duration"
	case t.Kind() == reflect.Slice:
		return "list of strings"
	case reflect.PointerTo(t).Implements(textType):
		return "string"
	}
	switch t.Kind() {
	case reflect.Bool:
		return "bool"
	case reflect.Int, reflect.Int64, reflect.Uint16:
		return "integer"
	case reflect.Float64:
		return "number"
	}
	return "string"
}
