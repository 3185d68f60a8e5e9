package main

import (
	"flag"
	"fmt"
	"log/slog"
	"strings"

	"dsec.dev/dsec/internal/config"
	"dsec.dev/dsec/internal/daemon"
	"dsec.dev/dsec/internal/editdist"
)

// knownEnv is every DSECD_* variable some command of dsecd reads: each
// role's settings, --config, and the tools' flags.
func knownEnv() map[string]bool {
	known := map[string]bool{config.EnvName(config.ConfigFlag): true}
	for _, role := range config.Roles {
		cfg, _ := config.Default(role, func(string) string { return "" })
		for _, f := range config.Fields(cfg) {
			known[f.Env] = true
		}
	}
	var dir string
	var apiservers, edges listFlag
	var tok tokenOpts
	var fleet daemon.HollowFleetConfig
	var level slog.Level
	for _, fs := range []*flag.FlagSet{initClusterFlags(&dir, &apiservers, &edges), tokenFlags(&tok), hollowFleetFlags(&fleet, &level)} {
		fs.VisitAll(func(f *flag.Flag) { known[config.EnvName(f.Name)] = true })
	}
	return known
}

// strayEnv says which DSECD_* variables of environ (KEY=VALUE) no command
// of dsecd reads, each with the nearest one it may have meant: a
// misspelt variable is otherwise ignored without a word, where a
// misspelt key of a configuration file stops the start.
func strayEnv(environ []string) []string {
	known := knownEnv()
	var out []string
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(name, "DSECD_") || known[name] {
			continue
		}
		msg := fmt.Sprintf("%s names no setting of dsecd and is ignored", name)
		if near := nearest(name, known); near != "" {
			msg += fmt.Sprintf(" (did you mean %s?)", near)
		}
		out = append(out, msg)
	}
	return out
}

// nearest is the name of known closest to name, if close enough to be a
// slip: at most one edit in four characters of the setting's name.
func nearest(name string, known map[string]bool) string {
	best, bestD := "", max(1, len(strings.TrimPrefix(name, "DSECD_"))/4)+1
	for k := range known {
		if d := editdist.Levenshtein(name, k); d < bestD || d == bestD && k < best {
			best, bestD = k, d
		}
	}
	return best
}
