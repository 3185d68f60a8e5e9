package config

import (
	"flag"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

var noEnv = func(string) string { return "" }

func envOf(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

// load runs Load for the all-in-one with a file of the given name and
// text (none if empty), env and args.
func load(t *testing.T, name, text string, env map[string]string, args ...string) (AllInOne, error) {
	t.Helper()
	c := DefaultAllInOne(noEnv)
	if name != "" {
		path := filepath.Join(t.TempDir(), name)
		if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		args = append([]string{"--config", path}, args...)
	}
	fs := flag.NewFlagSet("dsecd", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	err := Load(&c, fs, args, envOf(env))
	return c, err
}

// TestPrecedence: a setting's default, under its file's value, under its
// variable, under its flag; each source leaves alone what it does not
// name. The same file in TOML and in YAML reads the same.
func TestPrecedence(t *testing.T) {
	files := map[string]string{
		"dsecd.toml": `
root = "/srv/dsec"
retention = "20m"
max_warm = 10
[limits]
max_sandboxes = 100
max_cpus = 4
[network]
dns_upstreams = ["10.0.0.53:53"]
pool = "10.99.0.0/16"
[storage]
mode = "eager"
`,
		"dsecd.yaml": `
root: /srv/dsec
retention: 20m
max_warm: 10
limits:
  max_sandboxes: 100
  max_cpus: 4
network:
  dns_upstreams: ["10.0.0.53:53"]
  pool: 10.99.0.0/16
storage:
  mode: eager
`,
	}
	env := map[string]string{"DSECD_MAX_WARM": "20", "DSECD_MAX_SANDBOXES": "200", "DSECD_DNS_UPSTREAM": "1.1.1.1:53,8.8.8.8:53"}
	for name, text := range files {
		t.Run(name, func(t *testing.T) {
			c, err := load(t, name, text, env, "--max-sandboxes", "300", "--no-network")
			if err != nil {
				t.Fatal(err)
			}
			want := DefaultAllInOne(noEnv)
			want.Root = "/srv/dsec"                                          // file
			want.Retention = 20 * time.Minute                                // file
			want.MaxWarm = 20                                                // env over file
			want.Limits.MaxSandboxes = 300                                   // flag over env over file
			want.Limits.MaxCPUs = 4                                          // file
			want.Network.DNSUpstreams = []string{"1.1.1.1:53", "8.8.8.8:53"} // env over file
			want.Network.Pool = netip.MustParsePrefix("10.99.0.0/16")
			want.Network.Disabled = true // flag
			want.Storage.Mode = "eager"
			if diff := cmp.Diff(want, c, prefixes); diff != "" {
				t.Errorf("-want +got:\n%s", diff)
			}
		})
	}
	// DSECD_CONFIG names the file when --config does not.
	dir := t.TempDir()
	path := filepath.Join(dir, "c.toml")
	os.WriteFile(path, []byte("node = \"n7\"\n"), 0o644)
	c, err := load(t, "", "", map[string]string{"DSECD_CONFIG": path})
	if err != nil || c.Node.Node != "n7" {
		t.Errorf("DSECD_CONFIG: node %q, %v", c.Node.Node, err)
	}
	// A repeated flag replaces the file's list, then adds to it.
	a := DefaultAPIServer()
	apath := filepath.Join(dir, "a.toml")
	os.WriteFile(apath, []byte("edges = [\"e0=https://e0:1\"]\n"), 0o644)
	fs := flag.NewFlagSet("dsecd apiserver", flag.ContinueOnError)
	if err := Load(&a, fs, []string{"--config", apath, "--edge", "e1=https://e1:1", "--edge", "e2=https://e2:1"}, noEnv); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"e1=https://e1:1", "e2=https://e2:1"}, a.Edges); diff != "" {
		t.Errorf("edges -want +got:\n%s", diff)
	}
}

var prefixes = cmp.Comparer(func(a, b netip.Prefix) bool { return a == b })

// TestBadFiles: a key the role lacks, a value of the wrong kind and a bad
// value are errors that name the file's line and the key.
func TestBadFiles(t *testing.T) {
	for _, tc := range []struct {
		name, text string
		want       []string
	}{
		{"unknown.toml", "root = \"/r\"\n\n[limits]\nmax_sandbox = 3\n", []string{"unknown.toml:4:", `unknown key "limits.max_sandbox"`}},
		{"unknown.yaml", "root: /r\nlimits:\n  max_sandbox: 3\n", []string{"unknown.yaml:3:", `unknown key "limits.max_sandbox"`}},
		{"table.toml", "[limit]\nmax_sandboxes = 3\n", []string{"table.toml:1:", `unknown table "limit"`}},
		{"role.toml", "registry = \"postgres://db\"\n", []string{"role.toml:1:", `unknown key "registry" (a setting of the edge only)`}}, // an edge's, not the all-in-one's
		{"kind.toml", "[limits]\nmax_sandboxes = \"many\"\n", []string{"kind.toml:2:", "limits.max_sandboxes", "want an integer, not a string"}},
		{"kind.yaml", "limits:\n  max_sandboxes: many\n", []string{"kind.yaml:2:", "limits.max_sandboxes", "not a string"}},
		{"duration.toml", "retention = 600\n", []string{"duration.toml:1:", "retention", "want a duration, not an integer"}},
		{"duration.yaml", "retention: 10 minutes\n", []string{"duration.yaml:1:", "retention", "want a duration such as 90s"}},
		{"choice.toml", "[storage]\nmode = \"lazy\"\n", []string{"choice.toml:2:", "storage.mode", "want ondemand, eager, local or tar"}},
		{"swap.yaml", "swap: disk:8G\n", []string{"swap.yaml:1:", "swap", "want none, file:SIZE or zram:SIZE"}},
		{"prefix.toml", "[network]\npool = \"10.1.2.3\"\n", []string{"prefix.toml:2:", "network.pool"}},
		{"twice.toml", "root = \"/a\"\nroot = \"/b\"\n", []string{"twice.toml:2:", "root set again (first on line 1)"}},
		{"syntax.toml", "root = \"/a\"\nmax_warm = = 3\n", []string{"syntax.toml:2:"}},
		{"syntax.yaml", "root: /a\n  max_warm: 3\n", []string{"syntax.yaml:", "line 2"}},
		{"table.yaml", "limits: 5\n", []string{"table.yaml:1:", "limits: want a table of settings (limits.…), not an integer"}},
		{"table-value.toml", "limits = \"big\"\n", []string{"table-value.toml:1:", "limits: want a table of settings (limits.…), not a string"}},
		{"upstream.toml", "[network]\ndns_upstreams = [\"10.0.0.53:53\", \"1.1.1.1\"]\n", []string{"upstream.toml:2:", "network.dns_upstreams", `want HOST:PORT, such as 10.0.0.53:53: "1.1.1.1"`}},
		{"dsecd.json", "{}", []string{"want a name ending in .toml, .yaml or .yml"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := load(t, tc.name, tc.text, nil)
			if err == nil {
				t.Fatal("loaded")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("%v: no %q", err, w)
				}
			}
		})
	}
}

// TestBadEnvAndFlags: a bad variable names itself and the setting; a bad
// flag is refused as it is parsed.
func TestBadEnvAndFlags(t *testing.T) {
	_, err := load(t, "", "", map[string]string{"DSECD_DEFAULT_TTL": "soon"})
	if err == nil || !strings.Contains(err.Error(), "DSECD_DEFAULT_TTL") || !strings.Contains(err.Error(), "defaults.ttl") {
		t.Errorf("variable: %v", err)
	}
	for _, args := range [][]string{{"--dns-upstream", "1.1.1.1"}, {"--max-cpus", "lots"}, {"--runsc-platform", "vmware"}, {"--fncall-qos", "fast"}, {"--log-level", "loud"}, {"--nflog-group", "70000"}} {
		if _, err := load(t, "", "", nil, args...); err == nil || !strings.Contains(err.Error(), args[0][1:]) {
			t.Errorf("%v: %v", args, err)
		}
	}
}

// TestPrintRoundTrip: what Print writes, read back as a file over the
// defaults, is the configuration it printed, for every role.
func TestPrintRoundTrip(t *testing.T) {
	args := map[string][]string{
		RoleAllInOne: {"--max-sandboxes", "9", "--dns-upstream", "10.0.0.1:53,10.0.0.2:53", "--network-pool", "10.77.0.0/16",
			"--default-cpus", "0.5", "--swap", "zram:1G", "--sandboxfusion-project", `we "quote" \ this`, "--no-trajectories", "--nflog-group", "2140"},
		RoleEdge:      {"--node", "n1", "--registry", "postgres://db/dsec", "--tls-dir", "/etc/dsec", "--hollow-start-delay", "1.5s"},
		RoleAPIServer: {"--edge", "a=https://a:1", "--edge", "b=https://b:1", "--poll-interval", "1s", "--audit-retention", "-1s"},
	}
	for _, role := range Roles {
		t.Run(role, func(t *testing.T) {
			cfg, _ := Default(role, noEnv)
			fs := flag.NewFlagSet(role, flag.ContinueOnError)
			if err := Load(cfg, fs, args[role], noEnv); err != nil {
				t.Fatal(err)
			}
			var b strings.Builder
			if err := Print(&b, role, cfg, map[string]string{"limits.max_sandboxes": "64"}); err != nil {
				t.Fatal(err)
			}
			back, _ := Default(role, envOf(map[string]string{"DSEC_RUNSC": "/elsewhere"}))
			if err := loadData(back, "printed.toml", []byte(b.String())); err != nil {
				t.Fatalf("%v\n%s", err, b.String())
			}
			if diff := cmp.Diff(cfg, back, prefixes); diff != "" {
				t.Errorf("-printed +read back:\n%s", diff)
			}
		})
	}
}

// TestFields: every setting of every role has a key, a flag and words,
// none twice in a role, and a kind a file can hold.
func TestFields(t *testing.T) {
	for _, role := range Roles {
		cfg, _ := Default(role, noEnv)
		keys, flags := map[string]bool{}, map[string]bool{ConfigFlag: true}
		for _, f := range Fields(cfg) {
			if f.Key == "" || f.Flag == "" || f.Help == "" {
				t.Errorf("%s: %+v lacks a key, flag or help", role, f)
			}
			if keys[f.Key] || flags[f.Flag] {
				t.Errorf("%s: key %s or flag %s twice", role, f.Key, f.Flag)
			}
			keys[f.Key], flags[f.Flag] = true, true
			if f.Env != EnvName(f.Flag) {
				t.Errorf("%s: %s's variable %s", role, f.Key, f.Env)
			}
		}
		if len(keys) < 10 {
			t.Errorf("%s: %d settings", role, len(keys))
		}
	}
}

// TestRedact: passwords and secret parameters of URLs, and the password of
// a PostgreSQL key/value connection string, are hidden, the
// rest kept.
func TestRedact(t *testing.T) {
	for in, want := range map[string]string{
		"postgres://u:pw@db:5432/dsec?sslmode=disable": "postgres://u:REDACTED@db:5432/dsec?sslmode=disable",
		"postgres://u@db/dsec":                         "postgres://u@db/dsec",
		"s3://b/p?endpoint=h:1&secret_key=abc":         "s3://b/p?endpoint=h%3A1&secret_key=REDACTED",
		"/var/lib/dsec/meta.db":                        "/var/lib/dsec/meta.db",
		// PostgreSQL's key/value form (scripts/cluster.sh uses it) printed
		// its password as given.
		"host=/run/pg user=dsec password=sekrit dbname=dsec": "host=/run/pg user=dsec password=REDACTED dbname=dsec",
		"host=db password = 'se cr\\'et' dbname=dsec":        "host=db password=REDACTED dbname=dsec",
		"host=db user=dsec dbname=dsec":                      "host=db user=dsec dbname=dsec",
	} {
		if got := redactURL(in); got != want {
			t.Errorf("%s: %s, want %s", in, got, want)
		}
	}
}

var update = flag.Bool("update", false, "rewrite docs/configuration.md's table")

const (
	docsPath  = "../../docs/configuration.md"
	docsBegin = "<!-- BEGIN settings: generated by go test ./internal/config -update -->\n"
	docsEnd   = "<!-- END settings -->\n"
)

// TestDocs: docs/configuration.md's table of settings is the one the
// structs make (go test ./internal/config -update rewrites it).
func TestDocs(t *testing.T) {
	var b strings.Builder
	if err := Markdown(&b); err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(docsPath)
	if err != nil {
		t.Fatal(err)
	}
	s := string(doc)
	i, j := strings.Index(s, docsBegin), strings.Index(s, docsEnd)
	if i < 0 || j < i {
		t.Fatalf("%s has no %q … %q", docsPath, docsBegin, docsEnd)
	}
	got := s[i+len(docsBegin) : j]
	if got == b.String() {
		return
	}
	if *update {
		if err := os.WriteFile(docsPath, []byte(s[:i+len(docsBegin)]+b.String()+s[j:]), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	t.Errorf("%s's table of settings is not the structs' (go test ./internal/config -update rewrites it):\n%s",
		docsPath, cmp.Diff(got, b.String()))
}

// TestPrintFlags: a role's usage names each flag's kind of value, its file
// key, its variable and a default that is not zero.
func TestPrintFlags(t *testing.T) {
	c := DefaultEdge(noEnv)
	fs := flag.NewFlagSet("dsecd edge", flag.ContinueOnError)
	if err := Load(&c, fs, nil, noEnv); err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	PrintFlags(&b, fs)
	for _, want := range []string{
		"  -max-sandboxes integer\n", "(limits.max_sandboxes in a file, DSECD_MAX_SANDBOXES)\n",
		"  -no-network\n", "(max_warm in a file, DSECD_MAX_WARM, default 256)\n", "  -config string\n",
	} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("no %q in\n%s", want, b.String())
		}
	}
}

// TestEmptyTable: a YAML table whose settings are all commented out is
// null, which reads as an empty table, not an unknown key.
func TestEmptyTable(t *testing.T) {
	c, err := load(t, "dsecd.yaml", "root: /srv/dsec\nlimits:\n  # max_sandboxes: 2000\n", nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.Root != "/srv/dsec" {
		t.Errorf("root %q", c.Root)
	}
}
