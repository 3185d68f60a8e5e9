package config

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"reflect"
)

// ErrFlags is what Load's error wraps when the flags were wrong, which
// the flag set has reported already (flag.ErrHelp, also wrapped, for -h).
var ErrFlags = errors.New("bad flags")

// ConfigFlag is the flag (and, as DSECD_CONFIG, the variable) that names
// a configuration file.
const ConfigFlag = "config"

// Load sets cfg, a pointer to a role's struct holding its defaults, from
// a configuration file, the environment and args, each over the one
// before: the file is the --config flag's, else DSECD_CONFIG's. It
// registers the role's flags on fs, which reports a bad flag as the flag
// package does (the error then wraps ErrFlags). An error names the file and line,
// the variable or the flag, and the setting.
func Load(cfg any, fs *flag.FlagSet, args []string, getenv func(string) string) error {
	fields := Fields(cfg)
	var flags []setting
	for _, f := range fields {
		fs.Var(&flagValue{f: f, set: &flags}, f.Flag, f.Help)
	}
	path := fs.String(ConfigFlag, "", "a configuration file, TOML (.toml) or YAML (.yaml, .yml), under the environment and the flags (docs/configuration.md)")
	if err := fs.Parse(args); err != nil {
		return fmt.Errorf("%w: %w", ErrFlags, err)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	file := *path
	if file == "" {
		file = getenv(EnvName(ConfigFlag))
	}
	if file != "" {
		if err := LoadFile(cfg, file); err != nil {
			return err
		}
	}
	if err := FromEnv(cfg, getenv); err != nil {
		return err
	}
	added := map[string]bool{}
	for _, s := range flags {
		add := s.f.List == "repeat" && added[s.f.Key]
		if s.f.List == "repeat" && !add {
			// The first of a repeated flag replaces what the file or the
			// environment listed; the rest add to it.
			if err := s.f.setList(nil); err != nil {
				return err
			}
			add = true
		}
		added[s.f.Key] = true
		if err := s.f.set(s.value, add); err != nil {
			return fmt.Errorf("--%s %q: %w", s.f.Flag, s.value, err) // checked as the flag was parsed
		}
	}
	return nil
}

// FromEnv sets every setting whose DSECD_* variable getenv has; a list's
// items are separated by commas.
func FromEnv(cfg any, getenv func(string) string) error {
	var errs []error
	for _, f := range Fields(cfg) {
		v := getenv(f.Env)
		if v == "" {
			continue
		}
		if err := f.set(v, false); err != nil {
			errs = append(errs, fmt.Errorf("%s=%q (%s): %w", f.Env, v, f.Key, err))
		}
	}
	return errors.Join(errs...)
}

// setting is one flag as it was parsed, applied after the file and the
// environment.
type setting struct {
	f     Field
	value string
}

// flagValue is a setting's flag: it checks a value as the flag package
// parses it and keeps it for Load to apply in its turn.
type flagValue struct {
	f   Field
	set *[]setting
}

func (v *flagValue) String() string {
	if v == nil || !v.f.v.IsValid() {
		return ""
	}
	return v.f.String()
}

func (v *flagValue) Set(s string) error {
	scratch := v.f
	scratch.v = reflect.New(v.f.v.Type()).Elem()
	if err := scratch.set(s, v.f.List == "repeat"); err != nil {
		return err
	}
	*v.set = append(*v.set, setting{f: v.f, value: s})
	return nil
}

func (v *flagValue) IsBoolFlag() bool { return v.f.v.IsValid() && v.f.v.Kind() == reflect.Bool }

// PrintFlags writes fs's flags as flag.PrintDefaults does, a setting's
// with the kind of value it takes, its file key and its variable.
func PrintFlags(w io.Writer, fs *flag.FlagSet) {
	fs.VisitAll(func(fl *flag.Flag) {
		fv, ok := fl.Value.(*flagValue)
		if !ok {
			fmt.Fprintf(w, "  -%s string\n    \t%s\n", fl.Name, fl.Usage)
			return
		}
		kind := " " + kindName(fv.f.v.Type())
		if fv.IsBoolFlag() {
			kind = ""
		}
		def := ""
		if !fv.f.v.IsZero() {
			def = ", default " + fl.DefValue
		}
		fmt.Fprintf(w, "  -%s%s\n    \t%s\n    \t(%s in a file, %s%s)\n", fl.Name, kind, fl.Usage, fv.f.Key, fv.f.Env, def)
	})
}
