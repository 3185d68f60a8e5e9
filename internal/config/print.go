package config

import (
	"fmt"
	"io"
	"net/url"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Print writes cfg, a pointer to a role's struct, as a TOML file that
// LoadFile reads back to the same settings, each with what it does, its
// flag and its variable. Passwords in URLs are redacted. derived, by key,
// is what a setting left at its zero comes to on this machine (the node's
// memory, its host name), noted beside it.
func Print(w io.Writer, role string, cfg any, derived map[string]string) error {
	var b strings.Builder
	fmt.Fprintf(&b, "# dsecd's configuration, role %s (docs/configuration.md).\n", role)
	for i, t := range tableOrder(Fields(cfg)) {
		if t.name != "" {
			fmt.Fprintf(&b, "\n[%s]\n", t.name)
		} else if i > 0 {
			b.WriteString("\n")
		}
		for j, f := range t.fields {
			if j > 0 {
				b.WriteString("\n")
			}
			fmt.Fprintf(&b, "# %s\n# --%s, %s\n", f.Help, f.Flag, f.Env)
			if d, ok := derived[f.Key]; ok && f.v.IsZero() {
				fmt.Fprintf(&b, "# on this machine: %s\n", d)
			}
			name := f.Key[strings.LastIndex(f.Key, ".")+1:]
			fmt.Fprintf(&b, "%s = %s\n", name, tomlValue(f, true))
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

type table struct {
	name   string
	fields []Field
}

// tableOrder groups fields by table: the top level's first, as TOML
// needs, then each table in the order its first field is declared.
func tableOrder(fields []Field) []table {
	var out []table
	index := map[string]int{}
	for _, f := range fields {
		name := ""
		if i := strings.LastIndex(f.Key, "."); i >= 0 {
			name = f.Key[:i]
		}
		i, ok := index[name]
		if !ok {
			i = len(out)
			index[name] = i
			out = append(out, table{name: name})
		}
		out[i].fields = append(out[i].fields, f)
	}
	slices.SortStableFunc(out, func(a, b table) int {
		if (a.name == "") == (b.name == "") {
			return 0
		}
		if a.name == "" {
			return -1
		}
		return 1
	})
	return out
}

// tomlValue is the field's value as TOML writes it; redact hides a
// secret field's password.
func tomlValue(f Field, redact bool) string {
	v := f.v
	switch {
	case v.Type() == durationType:
		return tomlString(time.Duration(v.Int()).String())
	case v.Kind() == reflect.Slice:
		items := v.Interface().([]string)
		q := make([]string, len(items))
		for i, it := range items {
			q[i] = tomlString(it)
		}
		return "[" + strings.Join(q, ", ") + "]"
	case v.Kind() == reflect.String:
		s := v.String()
		if redact && f.Secret {
			s = redactURL(s)
		}
		return tomlString(s)
	case v.Kind() == reflect.Float64:
		return strconv.FormatFloat(v.Float(), 'g', -1, 64)
	case v.Kind() == reflect.Bool, v.Kind() == reflect.Int, v.Kind() == reflect.Int64, v.Kind() == reflect.Uint16:
		return fmt.Sprint(v.Interface())
	}
	return tomlString(formatValue(v))
}

// tomlString quotes s as a TOML basic string.
func tomlString(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r < 0x20 || r == 0x7f:
			fmt.Fprintf(&b, "\\u%04X", r)
		default:
			b.WriteRune(r)
		}
	}
	b.WriteByte('"')
	return b.String()
}

// dsnPassword is a password in a PostgreSQL key/value connection string
// ("host=db user=dsec password=secret", the value maybe quoted: 'a b').
var dsnPassword = regexp.MustCompile(`(?i)\bpassword\s*=\s*(?:'(?:[^'\\]|\\.)*'|[^\s']*)`)

// redactURL hides a URL's password and the values of its query's
// secret-looking parameters, and the password of a PostgreSQL key/value
// connection string.
func redactURL(s string) string {
	u, err := url.Parse(s)
	if err != nil || u.Scheme == "" {
		return dsnPassword.ReplaceAllString(s, "password=REDACTED")
	}
	changed := false
	if _, ok := u.User.Password(); ok {
		u.User = url.UserPassword(u.User.Username(), "REDACTED")
		changed = true
	}
	q := u.Query()
	for k := range q {
		lk := strings.ToLower(k)
		if strings.Contains(lk, "password") || strings.Contains(lk, "secret") || strings.Contains(lk, "token") || strings.HasSuffix(lk, "key") {
			q.Set(k, "REDACTED")
			changed = true
		}
	}
	if !changed {
		return s
	}
	u.RawQuery = q.Encode()
	return u.String()
}

// Markdown writes the table of every role's settings that
// docs/configuration.md holds: key, flag, variable, roles, defaults and
// what each does.
func Markdown(w io.Writer) error {
	type row struct {
		f        Field
		roles    []string
		defaults []string
	}
	var rows []*row
	byKey := map[string]*row{}
	none := func(string) string { return "" }
	for _, role := range Roles {
		cfg, _ := Default(role, none)
		for _, f := range Fields(cfg) {
			r := byKey[f.Key]
			if r == nil {
				r = &row{f: f}
				byKey[f.Key] = r
				rows = append(rows, r)
			}
			r.roles = append(r.roles, role)
			r.defaults = append(r.defaults, tomlValue(f, false))
		}
	}
	var b strings.Builder
	b.WriteString("| key | flag | variable | roles | default | what it sets |\n|---|---|---|---|---|---|\n")
	for _, r := range rows {
		def := "`" + r.defaults[0] + "`"
		if slices.ContainsFunc(r.defaults, func(d string) bool { return d != r.defaults[0] }) {
			var parts []string
			for i, d := range r.defaults {
				parts = append(parts, r.roles[i]+": `"+d+"`")
			}
			def = strings.Join(parts, ", ")
		}
		roles := strings.Join(r.roles, ", ")
		if len(r.roles) == len(Roles) {
			roles = "all"
		}
		fmt.Fprintf(&b, "| `%s` | `--%s` | `%s` | %s | %s | %s |\n", r.f.Key, r.f.Flag, r.f.Env, roles, def,
			strings.ReplaceAll(r.f.Help, "|", `\|`))
	}
	_, err := io.WriteString(w, b.String())
	return err
}
