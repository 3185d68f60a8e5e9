package config

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/pelletier/go-toml/v2/unstable"
	"go.yaml.in/yaml/v3"
)

// entry is one value of a configuration file.
type entry struct {
	key   string // dotted: limits.max_sandboxes
	line  int
	kind  string // string, integer, float, bool, list or table (a header, no value)
	value string
	items []string
}

// LoadFile sets cfg, a pointer to a role's struct, from the file at path:
// TOML if its name ends in .toml, YAML if in .yaml or .yml. Settings the
// file does not name keep their values. A key the role does not have, a
// value of the wrong kind or a bad value is an error naming the file, the
// line and the key.
func LoadFile(cfg any, path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("read configuration: %w", err)
	}
	return loadData(cfg, path, data)
}

func loadData(cfg any, path string, data []byte) error {
	var entries []entry
	var err error
	switch strings.ToLower(filepath.Ext(path)) {
	case ".toml":
		entries, err = parseTOML(data)
	case ".yaml", ".yml":
		entries, err = parseYAML(data)
	default:
		return fmt.Errorf("configuration %s: want a name ending in .toml, .yaml or .yml", path)
	}
	if err != nil {
		return fmt.Errorf("%s:%w", path, err)
	}
	fields := map[string]Field{}
	tables := map[string]bool{}
	for _, f := range Fields(cfg) {
		fields[f.Key] = f
		for k := f.Key; strings.Contains(k, "."); {
			k = k[:strings.LastIndex(k, ".")]
			tables[k] = true
		}
	}
	var errs []error
	seen := map[string]int{}
	for _, e := range entries {
		at := fmt.Sprintf("%s:%d", path, e.line)
		if e.kind == "table" {
			if !tables[e.key] {
				errs = append(errs, fmt.Errorf("%s: unknown table %q", at, e.key))
			}
			continue
		}
		f, ok := fields[e.key]
		if !ok && tables[e.key] {
			// A YAML table whose settings are all commented out is null:
			// an empty table, not an unknown key.
			if e.kind != "null" {
				errs = append(errs, fmt.Errorf("%s: %s: want a table of settings (%s.…), not %s", at, e.key, e.key, a(e.kind)))
			}
			continue
		}
		if !ok {
			if roles := rolesWith(e.key); len(roles) > 0 {
				errs = append(errs, fmt.Errorf("%s: unknown key %q (a setting of the %s only)", at, e.key, strings.Join(roles, " and ")))
				continue
			}
			errs = append(errs, fmt.Errorf("%s: unknown key %q", at, e.key))
			continue
		}
		if line, dup := seen[e.key]; dup {
			errs = append(errs, fmt.Errorf("%s: %s set again (first on line %d)", at, e.key, line))
			continue
		}
		seen[e.key] = e.line
		if err := setEntry(f, e); err != nil {
			errs = append(errs, fmt.Errorf("%s: %s: %w", at, e.key, err))
		}
	}
	return errors.Join(errs...)
}

func setEntry(f Field, e entry) error {
	want := kindName(f.v.Type())
	ok := false
	switch want {
	case "list of strings":
		if e.kind == "list" {
			return f.setList(e.items)
		}
	case "duration", "string":
		ok = e.kind == "string"
	case "bool":
		ok = e.kind == "bool"
	case "integer":
		ok = e.kind == "integer"
	case "number":
		ok = e.kind == "integer" || e.kind == "float"
	}
	if !ok {
		return fmt.Errorf("want %s, not %s", a(want), a(e.kind))
	}
	return f.set(e.value, false)
}

// a puts an article before a kind of value.
func a(kind string) string {
	if strings.IndexByte("aeiou", kind[0]) >= 0 {
		return "an " + kind
	}
	return "a " + kind
}

// parseTOML lists a TOML document's values.
func parseTOML(data []byte) ([]entry, error) {
	var p unstable.Parser
	p.Reset(data)
	var out []entry
	var table []string
	line := func(r unstable.Range) int { return p.Shape(r).Start.Line }
	for p.NextExpression() {
		e := p.Expression()
		switch e.Kind {
		case unstable.Table:
			var at int
			table, at = tomlKey(e.Key(), line)
			out = append(out, entry{key: strings.Join(table, "."), line: at, kind: "table"})
		case unstable.ArrayTable:
			k, at := tomlKey(e.Key(), line)
			return nil, fmt.Errorf("%d: %s: an array of tables is no setting", at, strings.Join(k, "."))
		case unstable.KeyValue:
			vals, err := tomlValues(table, e, line)
			if err != nil {
				return nil, err
			}
			out = append(out, vals...)
		}
	}
	if err := p.Error(); err != nil {
		var perr *unstable.ParserError
		if errors.As(err, &perr) && len(perr.Highlight) > 0 {
			return nil, fmt.Errorf("%d: %s", line(p.Range(perr.Highlight)), perr.Message)
		}
		return nil, fmt.Errorf(" %w", err)
	}
	return out, nil
}

func tomlKey(it unstable.Iterator, line func(unstable.Range) int) ([]string, int) {
	var k []string
	at := 0
	for it.Next() {
		n := it.Node()
		if at == 0 {
			at = line(n.Raw)
		}
		k = append(k, string(n.Data))
	}
	return k, at
}

// tomlValues lists a key-value expression's values under table (an
// inline table holds several).
func tomlValues(table []string, kv *unstable.Node, line func(unstable.Range) int) ([]entry, error) {
	k, at := tomlKey(kv.Key(), line)
	key := strings.Join(append(append([]string{}, table...), k...), ".")
	v := kv.Value()
	e := entry{key: key, line: at, value: string(v.Data)}
	switch v.Kind {
	case unstable.String:
		e.kind = "string"
	case unstable.Integer:
		e.kind = "integer"
	case unstable.Float:
		e.kind = "float"
	case unstable.Bool:
		e.kind = "bool"
	case unstable.Array:
		e.kind = "list"
		it := v.Children()
		for it.Next() {
			n := it.Node()
			if n.Kind != unstable.String {
				return nil, fmt.Errorf("%d: %s: want a list of strings, with a %s in it", at, key, n.Kind)
			}
			e.items = append(e.items, string(n.Data))
		}
	case unstable.InlineTable:
		var out []entry
		it := v.Children()
		for it.Next() {
			vals, err := tomlValues(append(append([]string{}, table...), k...), it.Node(), line)
			if err != nil {
				return nil, err
			}
			out = append(out, vals...)
		}
		return out, nil
	default:
		e.kind = strings.ToLower(v.Kind.String())
	}
	return []entry{e}, nil
}

// parseYAML lists a YAML document's values: a mapping whose mappings are
// tables.
func parseYAML(data []byte) ([]entry, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf(" %w", err)
	}
	if len(doc.Content) == 0 {
		return nil, nil // empty
	}
	root := doc.Content[0]
	if root.Kind != yaml.MappingNode {
		return nil, fmt.Errorf("%d: want a mapping of settings", root.Line)
	}
	var out []entry
	if err := yamlValues("", root, &out); err != nil {
		return nil, err
	}
	return out, nil
}

func yamlValues(prefix string, m *yaml.Node, out *[]entry) error {
	for i := 0; i+1 < len(m.Content); i += 2 {
		k, v := m.Content[i], m.Content[i+1]
		key := prefix + k.Value
		e := entry{key: key, line: k.Line, value: v.Value}
		switch v.Kind {
		case yaml.MappingNode:
			*out = append(*out, entry{key: key, line: k.Line, kind: "table"})
			if err := yamlValues(key+".", v, out); err != nil {
				return err
			}
			continue
		case yaml.SequenceNode:
			e.kind = "list"
			e.items = []string{}
			for _, it := range v.Content {
				if it.Kind != yaml.ScalarNode {
					return fmt.Errorf("%d: %s: want a list of strings", it.Line, key)
				}
				e.items = append(e.items, it.Value)
			}
		case yaml.ScalarNode:
			switch v.ShortTag() {
			case "!!str":
				e.kind = "string"
			case "!!int":
				e.kind = "integer"
			case "!!float":
				e.kind = "float"
			case "!!bool":
				e.kind = "bool"
				e.value = strings.ToLower(v.Value)
			case "!!null":
				e.kind = "null"
			default:
				e.kind = v.ShortTag()
			}
		default:
			return fmt.Errorf("%d: %s: want a value", k.Line, key)
		}
		*out = append(*out, e)
	}
	return nil
}

// rolesWith names the roles that have the setting key: a file written for
// one role and given to another says whose its keys are.
func rolesWith(key string) []string {
	var out []string
	for _, role := range Roles {
		cfg, _ := Default(role, func(string) string { return "" })
		for _, f := range Fields(cfg) {
			if f.Key == key {
				out = append(out, role)
				break
			}
		}
	}
	return out
}
