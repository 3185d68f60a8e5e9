// Command dsecd is the dsec daemon. With no arguments it runs a whole
// single-machine dsec (apiserver, edge and metadata store) with its state
// under /var/lib/dsec. `dsecd teardown` removes every sandbox of the node and
// unmounts what dsecd mounted.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"dsec.dev/dsec/internal/clustertls"
	"dsec.dev/dsec/internal/config"
	"dsec.dev/dsec/internal/daemon"
	"dsec.dev/dsec/internal/e2b"
	"dsec.dev/dsec/internal/edge/lazyd"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/version"
	"dsec.dev/dsec/internal/vm/fuse2fs"
)

const usage = `usage:
  dsecd [flags]                the whole dsec on this machine: apiserver, edge and embedded store
  dsecd teardown [flags]       remove every sandbox of the node and unmount what dsecd mounted
  dsecd edge [flags]           one node of a cluster: serves EdgeService to apiservers (mutual TLS)
  dsecd apiserver [flags]      a stateless apiserver of a cluster, in front of its edges
  dsecd config print [--role R] the effective configuration of a role (all-in-one, edge, apiserver) as TOML
  dsecd init-cluster [flags]   make the cluster's CA and the certificates of its apiservers and edges
  dsecd hollow-fleet [flags]   many hollow edges in one process, for control-plane scale tests
  dsecd token [flags]          mint an API token in a metadata store and print it
  dsecd --version              print which build this is

Run "dsecd COMMAND -h" for a command's flags. Every setting of dsecd,
dsecd edge and dsecd apiserver can also be set in a file (--config FILE,
TOML or YAML) and in the environment (--max-sandboxes as
DSECD_MAX_SANDBOXES, and so on): flags win over the environment, the
environment over the file (docs/configuration.md).
`

func main() {
	if fuse2fs.IsFusermount(os.Args[0]) {
		// fuse2fs's fusermount while a microVM's disk is captured
		// (package fuse2fs).
		os.Exit(fuse2fs.Fusermount(os.Args))
	}
	os.Exit(dispatch(os.Args[1:], os.Stdout))
}

// dispatch runs the command args name and returns the exit code.
func dispatch(args []string, stdout io.Writer) int {
	if len(args) == 1 && (args[0] == "--version" || args[0] == "-version" || args[0] == "version") {
		fmt.Fprintln(stdout, version.String("dsecd"))
		return 0
	}
	cmd := ""
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		cmd, args = args[0], args[1:]
	}
	var code int
	switch cmd {
	case "":
		code = nodeMain("dsecd", args, false)
	case "teardown":
		code = nodeMain("dsecd teardown", args, true)
	case "edge":
		code = edgeMain(args)
	case "apiserver":
		code = apiserverMain(args)
	case "config":
		code = configMain(args, stdout)
	case "init-cluster":
		code = initClusterMain(args)
	case "hollow-fleet":
		code = hollowFleetMain(args)
	case "token":
		code = tokenMain(args)
	case "lazyfs":
		code = lazyfsMain(args)
	default:
		fmt.Fprint(os.Stderr, usage)
		code = 2
	}
	return code
}

func logger(level slog.Level) *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
}

// levelLogger is logger at a level package config checked.
func levelLogger(name string) *slog.Logger {
	var level slog.Level
	_ = level.UnmarshalText([]byte(name))
	return logger(level)
}

// roleFlags is a role's flag set, whose usage lists each setting's flag
// with its file key and variable.
func roleFlags(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage of %s:\n", name)
		config.PrintFlags(fs.Output(), fs)
	}
	return fs
}

// load sets cfg, a role's settings, from its file, the environment and
// args (package config). It returns false with the exit code when they
// are wrong or -h asked for the usage.
func load(fs *flag.FlagSet, cfg any, args []string) (int, bool) {
	for _, w := range strayEnv(os.Environ()) {
		fmt.Fprintf(fs.Output(), "%s: warning: %s\n", fs.Name(), w)
	}
	err := config.Load(cfg, fs, args, os.Getenv)
	switch {
	case err == nil:
		return 0, true
	case !errors.Is(err, config.ErrFlags): // the flag set said what was wrong
		fmt.Fprintf(fs.Output(), "%s: %v\n", fs.Name(), err)
	}
	return 2, false
}

// run runs fn until SIGINT or SIGTERM and returns the process's exit code.
func run(name string, fn func(ctx context.Context) error) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := fn(ctx); err != nil {
		fmt.Fprintln(os.Stderr, name+":", err)
		return 1
	}
	return 0
}

// fromEnv sets every flag its environment variable names; the command
// line, parsed after, wins. The roles' settings take theirs through
// package config; this is for the other commands' flags.
func fromEnv(fs *flag.FlagSet, getenv func(string) string) error {
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if v := getenv(config.EnvName(f.Name)); v != "" && err == nil {
			if serr := f.Value.Set(v); serr != nil {
				err = fmt.Errorf("%s=%q: %w", config.EnvName(f.Name), v, serr)
			}
		}
	})
	return err
}

func parse(fs *flag.FlagSet, args []string) bool {
	if err := fromEnv(fs, os.Getenv); err != nil {
		fmt.Fprintf(fs.Output(), "%s: %v\n", fs.Name(), err)
		return false
	}
	if fs.Parse(args) != nil {
		return false
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(fs.Output(), "%s: unexpected argument %q\n", fs.Name(), fs.Arg(0))
		fs.Usage()
		return false
	}
	return true
}

func nodeMain(name string, args []string, teardown bool) int {
	c := config.DefaultAllInOne(os.Getenv)
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usage+"\nflags of "+name+":\n")
		config.PrintFlags(fs.Output(), fs)
	}
	if code, ok := load(fs, &c, args); !ok {
		return code
	}
	cfg, err := daemon.FromAllInOne(c)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		return 2
	}
	log := levelLogger(c.LogLevel)
	return run("dsecd", func(ctx context.Context) error {
		if teardown {
			return daemon.Teardown(ctx, cfg, log)
		}
		return daemon.Run(ctx, cfg, log)
	})
}

func edgeMain(args []string) int {
	c := config.DefaultEdge(os.Getenv)
	fs := roleFlags("dsecd edge")
	if code, ok := load(fs, &c, args); !ok {
		return code
	}
	cfg, err := daemon.FromEdge(c)
	if err != nil {
		fmt.Fprintln(os.Stderr, "dsecd edge:", err)
		return 2
	}
	log := levelLogger(c.LogLevel)
	return run("dsecd edge", func(ctx context.Context) error { return daemon.RunEdge(ctx, cfg, log) })
}

func apiserverMain(args []string) int {
	c := config.DefaultAPIServer()
	fs := roleFlags("dsecd apiserver")
	if code, ok := load(fs, &c, args); !ok {
		return code
	}
	cfg, err := daemon.FromAPIServer(c)
	if err != nil {
		fmt.Fprintln(os.Stderr, "dsecd apiserver:", err)
		return 2
	}
	log := levelLogger(c.LogLevel)
	return run("dsecd apiserver", func(ctx context.Context) error { return daemon.RunAPIServer(ctx, cfg, log) })
}

// configMain runs `dsecd config print [--role ROLE] [ROLE's flags]`: the
// role's effective configuration, from its defaults, --config file,
// environment and flags, as TOML.
func configMain(args []string, stdout io.Writer) int {
	if len(args) == 0 || args[0] != "print" {
		fmt.Fprint(os.Stderr, "usage: dsecd config print [--role all-in-one|edge|apiserver] [--config FILE] [the role's flags]\n")
		return 2
	}
	args = args[1:]
	role := roleOf(args)
	cfg, ok := config.Default(role, os.Getenv)
	if !ok {
		fmt.Fprintf(os.Stderr, "dsecd config print: role %q: want %s\n", role, strings.Join(config.Roles, ", "))
		return 2
	}
	fs := roleFlags("dsecd config print")
	fs.String("role", config.RoleAllInOne, "whose configuration: "+strings.Join(config.Roles, ", "))
	if code, ok := load(fs, cfg, args); !ok {
		return code
	}
	var derived map[string]string
	if role != config.RoleAPIServer {
		derived = daemon.Derived(rootOf(cfg))
	}
	if err := config.Print(stdout, role, cfg, derived); err != nil {
		fmt.Fprintln(os.Stderr, "dsecd config print:", err)
		return 1
	}
	return 0
}

// rootOf is the state directory of a node's configuration.
func rootOf(cfg any) string {
	switch c := cfg.(type) {
	case *config.AllInOne:
		return c.Root
	case *config.Edge:
		return c.Root
	}
	return ""
}

// roleOf finds --role's value in args (the flag set parses it again).
func roleOf(args []string) string {
	for i, a := range args {
		if a == "--" {
			break
		}
		name, v, hasV := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !strings.HasPrefix(a, "-") || name != "role" {
			continue
		}
		if hasV {
			return v
		}
		if i+1 < len(args) {
			return args[i+1]
		}
	}
	return config.RoleAllInOne
}

func initClusterFlags(dir *string, apiservers, edges *listFlag) *flag.FlagSet {
	fs := flag.NewFlagSet("dsecd init-cluster", flag.ContinueOnError)
	fs.StringVar(dir, "dir", "", "where the CA and certificates go (made 0700); an existing CA there is kept and used")
	fs.Var(apiservers, "apiserver", "an apiserver's name (repeatable)")
	fs.Var(edges, "edge", "an edge: NAME or NAME=HOST[,HOST...], the host names and addresses it serves on (repeatable)")
	return fs
}

func initClusterMain(args []string) int {
	var dir string
	var apiservers, edges listFlag
	fs := initClusterFlags(&dir, &apiservers, &edges)
	if !parse(fs, args) {
		return 2
	}
	if dir == "" {
		fmt.Fprintln(os.Stderr, "dsecd init-cluster: --dir is required")
		return 2
	}
	var specs []clustertls.EdgeSpec
	for _, e := range edges {
		name, hosts, _ := strings.Cut(e, "=")
		spec := clustertls.EdgeSpec{Name: name}
		if hosts != "" {
			spec.Hosts = strings.Split(hosts, ",")
		}
		specs = append(specs, spec)
	}
	if err := clustertls.InitCluster(dir, apiservers, specs); err != nil {
		fmt.Fprintln(os.Stderr, "dsecd init-cluster:", err)
		return 1
	}
	// The apiservers' shared secret for E2B's access tokens (--e2b-secret-file).
	if err := daemon.EnsureE2BSecret(filepath.Join(dir, daemon.E2BSecretFile)); err != nil {
		fmt.Fprintln(os.Stderr, "dsecd init-cluster:", err)
		return 1
	}
	return 0
}

// tokenOpts are dsecd token's flags.
type tokenOpts struct {
	db, principal, project, role string
	ttl                          time.Duration
	asE2B                        bool
}

func tokenFlags(o *tokenOpts) *flag.FlagSet {
	fs := flag.NewFlagSet("dsecd token", flag.ContinueOnError)
	fs.StringVar(&o.project, "project", "/", "the project the token is for (a path: ml/rl-run-42)")
	fs.StringVar(&o.role, "role", "admin", "the token's role: viewer, runner, builder or admin (the principal is granted it on the project if it holds less)")
	fs.BoolVar(&o.asE2B, "e2b", false, "print the token as an E2B API key (e2b_…), for E2B_API_KEY")
	fs.StringVar(&o.db, "db", "", "the metadata store: postgres://… (a cluster's) or the all-in-one's <root>/meta.db")
	fs.StringVar(&o.principal, "principal", daemon.AdminPrincipal, "who the token is for (made if new)")
	fs.DurationVar(&o.ttl, "ttl", 0, "how long the token is valid (default: until revoked)")
	return fs
}

func tokenMain(args []string) int {
	var o tokenOpts
	fs := tokenFlags(&o)
	if !parse(fs, args) {
		return 2
	}
	if o.db == "" {
		fmt.Fprintln(os.Stderr, "dsecd token: --db is required")
		return 2
	}
	r, err := iam.ParseRole(o.role)
	if err != nil {
		fmt.Fprintln(os.Stderr, "dsecd token:", err)
		return 2
	}
	return run("dsecd token", func(ctx context.Context) error {
		tok, err := daemon.IssueToken(ctx, o.db, o.principal, o.project, r, o.ttl)
		if err == nil && o.asE2B {
			tok, err = e2b.APIKey(tok)
		}
		if err == nil {
			fmt.Println(tok)
		}
		return err
	})
}

func hollowFleetMain(args []string) int {
	var cfg daemon.HollowFleetConfig
	var level slog.Level
	fs := hollowFleetFlags(&cfg, &level)
	if !parse(fs, args) {
		return 2
	}
	log := logger(level)
	return run("dsecd hollow-fleet", func(ctx context.Context) error { return daemon.RunHollowFleet(ctx, cfg, log) })
}

func hollowFleetFlags(cfg *daemon.HollowFleetConfig, level *slog.Level) *flag.FlagSet {
	fs := flag.NewFlagSet("dsecd hollow-fleet", flag.ContinueOnError)
	fs.IntVar(&cfg.Count, "count", 160, "hollow edges to run")
	fs.StringVar(&cfg.Prefix, "prefix", "h", "their names: PREFIX1…PREFIXn (dsecd init-cluster must have made their certificates)")
	fs.StringVar(&cfg.TLSDir, "tls-dir", "", "dsecd init-cluster's directory")
	fs.StringVar(&cfg.Registry, "registry", "", "the cluster's metadata store (postgres://…)")
	fs.IntVar(&cfg.Hollow.MaxSandboxes, "max-sandboxes", 200, "sandboxes each admits")
	fs.DurationVar(&cfg.Hollow.StartDelay, "start-delay", 0, "how long each create takes")
	fs.IntVar(&cfg.Hollow.MaxStarting, "max-starting", 0, "creates each starts at once (0: no bound)")
	fs.TextVar(level, "log-level", slog.LevelInfo, "log level: debug, info, warn, error")
	return fs
}

type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

// lazyfsMain runs `dsecd lazyfs`: the on-demand layer file system in a
// process of its own, which dsecd starts and which outlives a dsecd restart.
func lazyfsMain(args []string) int {
	var cfg lazyd.Config
	fs := flag.NewFlagSet("dsecd lazyfs", flag.ExitOnError)
	fs.StringVar(&cfg.Dir, "dir", "", "state directory")
	fs.StringVar(&cfg.BlobStore, "blob-store", "", "blob store spec")
	fs.Int64Var(&cfg.CacheBytes, "cache-bytes", 0, "chunk cache limit on disk")
	fs.Int64Var(&cfg.MemoryBytes, "chunk-memory-bytes", 0, "chunk cache limit in memory")
	fs.Int64Var(&cfg.BandwidthBytesPerSec, "bandwidth", 0, "cap on blob store reads in bytes/s")
	fs.BoolVar(&cfg.NoPagePush, "no-page-push", false, "do not hand the kernel the rest of a chunk a read took some of")
	fs.Parse(args)
	if cfg.Dir == "" || cfg.BlobStore == "" {
		fmt.Fprintln(os.Stderr, "dsecd lazyfs: --dir and --blob-store are required")
		return 2
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := lazyd.Serve(ctx, cfg, log); err != nil {
		fmt.Fprintln(os.Stderr, "dsecd lazyfs:", err)
		return 1
	}
	return 0
}
