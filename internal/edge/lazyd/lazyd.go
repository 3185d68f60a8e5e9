// Package lazyd runs the node's on-demand layer file system (package lazy)
// in a process of its own, `dsecd lazyfs`, and gives dsecd a client for it.
//
// Running sandboxes read their layers through that FUSE mount. Were it served
// by dsecd itself, a crash or restart of dsecd would abort the FUSE
// connection and every uncached read in every sandbox would fail. The
// separate process outlives dsecd: a restarted dsecd finds it through its
// control socket and carries on, exactly as it re-adopts its containers.
package lazyd

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/edge/lazy"
	"dsec.dev/dsec/internal/errdefs"
)

// Config says where the file system lives and what it serves from.
type Config struct {
	Dir        string // state: ctl.sock, pid, log, cache/, mnt/
	BlobStore  string // blob store spec (blob.Open)
	CacheBytes int64  // chunk cache's disk tier limit; 0 = lazy's default
	// MemoryBytes bounds the chunk cache's memory tier; 0 = lazy's default.
	MemoryBytes int64
	// NoPagePush: see lazy.Config.NoPagePush.
	NoPagePush bool
	// BandwidthBytesPerSec caps reads from the blob store (a model of a
	// remote store); 0 = none.
	BandwidthBytesPerSec int64
}

func (c Config) socket() string     { return filepath.Join(c.Dir, "ctl.sock") }
func (c Config) pidFile() string    { return filepath.Join(c.Dir, "lazyfs.pid") }
func (c Config) MountPoint() string { return filepath.Join(c.Dir, "mnt") }
func (c Config) cacheDir() string   { return filepath.Join(c.Dir, "cache") }

// Args are the `dsecd lazyfs` arguments that serve cfg.
func (c Config) Args() []string {
	args := []string{"lazyfs", "--dir", c.Dir, "--blob-store", c.BlobStore,
		"--cache-bytes", strconv.FormatInt(c.CacheBytes, 10),
		"--chunk-memory-bytes", strconv.FormatInt(c.MemoryBytes, 10),
		"--bandwidth", strconv.FormatInt(c.BandwidthBytesPerSec, 10)}
	if c.NoPagePush {
		args = append(args, "--no-page-push")
	}
	return args
}

// Serve mounts the file system and serves its control socket until ctx ends,
// then unmounts. It is the body of `dsecd lazyfs`.
func Serve(ctx context.Context, cfg Config, log *slog.Logger) error {
	for _, d := range []string{cfg.Dir, cfg.MountPoint(), cfg.cacheDir()} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return fmt.Errorf("lazyfs: %w", err)
		}
	}
	st, err := blob.Open(ctx, cfg.BlobStore)
	if err != nil {
		return fmt.Errorf("lazyfs: %w", err)
	}
	if cfg.BandwidthBytesPerSec > 0 {
		st = blob.Throttle(st, cfg.BandwidthBytesPerSec)
	}
	// A mount left by a crashed predecessor is detached first.
	unix.Unmount(cfg.MountPoint(), unix.MNT_DETACH)
	fsys, err := lazy.Mount(ctx, lazy.Config{
		Store: st, MountPoint: cfg.MountPoint(), CacheDir: cfg.cacheDir(), CacheBytes: cfg.CacheBytes,
		MemoryBytes: cfg.MemoryBytes, NoPagePush: cfg.NoPagePush, Log: log,
	})
	if err != nil {
		return fmt.Errorf("lazyfs: %w", err)
	}
	// The process's heap is mostly the chunk cache's memory tier, which
	// fills up to its limit and stays there: at the default GOGC the heap
	// would grow to twice that. A soft limit a quarter above it (plus room
	// for the fetches and FUSE buffers in flight) makes the collector keep
	// the process near what --chunk-memory-bytes says.
	if os.Getenv("GOMEMLIMIT") == "" {
		mem := fsys.MemoryBytes()
		debug.SetMemoryLimit(mem + mem/4 + 256<<20)
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if err := fsys.Close(cctx); err != nil {
			log.Warn("unmount lazy file system", "err", err)
		}
	}()
	os.Remove(cfg.socket())
	ln, err := net.Listen("unix", cfg.socket())
	if err != nil {
		return fmt.Errorf("lazyfs: %w", err)
	}
	if err := os.WriteFile(cfg.pidFile(), []byte(strconv.Itoa(os.Getpid())), 0o600); err != nil {
		return fmt.Errorf("lazyfs: %w", err)
	}
	srv := &http.Server{Handler: handler(fsys, cfg, log), ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	log.Info("lazyfs ready", "mount", cfg.MountPoint(), "blob_store", cfg.BlobStore)
	err = srv.Serve(ln)
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	return err
}

// request is every control call's body; each uses some fields.
type request struct {
	Index  *blob.Index `json:"index,omitempty"`
	Hex    string      `json:"hex,omitempty"`
	Chunks []int       `json:"chunks,omitempty"`
}

type response struct {
	Path   string          `json:"path,omitempty"`
	N      int             `json:"n,omitempty"`
	Wrote  bool            `json:"wrote,omitempty"`
	Chunks []int           `json:"chunks,omitempty"`
	Stats  lazy.LayerStats `json:"stats"`
	Totals *lazy.Totals    `json:"totals,omitempty"`
	Error  string          `json:"error,omitempty"`
	Kind   string          `json:"kind,omitempty"` // errdefs kind of Error
}

func handler(fsys *lazy.FS, cfg Config, log *slog.Logger) http.Handler {
	mux := http.NewServeMux()
	handle := func(path string, fn func(ctx context.Context, req request) (response, error)) {
		mux.HandleFunc("POST "+path, func(w http.ResponseWriter, r *http.Request) {
			var req request
			if err := json.NewDecoder(io.LimitReader(r.Body, 64<<20)).Decode(&req); err != nil {
				writeResp(w, response{}, fmt.Errorf("decode %s request: %w", path, errdefs.ErrInvalidArgument))
				return
			}
			resp, err := fn(r.Context(), req)
			writeResp(w, resp, err)
		})
	}
	handle("/add", func(ctx context.Context, req request) (response, error) {
		if req.Index == nil {
			return response{}, fmt.Errorf("add: no index: %w", errdefs.ErrInvalidArgument)
		}
		p, err := fsys.Add(ctx, req.Index)
		return response{Path: p}, err
	})
	handle("/fetch-all", func(ctx context.Context, req request) (response, error) {
		return response{}, fsys.FetchAll(ctx, req.Hex)
	})
	handle("/prefetch", func(ctx context.Context, req request) (response, error) {
		return response{}, fsys.Prefetch(ctx, req.Hex, req.Chunks)
	})
	handle("/prefetch-trace", func(ctx context.Context, req request) (response, error) {
		n, err := fsys.PrefetchTrace(ctx, req.Hex)
		return response{N: n}, err
	})
	handle("/save-trace", func(ctx context.Context, req request) (response, error) {
		return response{}, fsys.SaveTrace(req.Hex)
	})
	handle("/publish-trace", func(ctx context.Context, req request) (response, error) {
		wrote, err := fsys.PublishTrace(ctx, req.Hex)
		return response{Wrote: wrote}, err
	})
	handle("/stats", func(ctx context.Context, req request) (response, error) {
		return response{Stats: fsys.Stats(req.Hex)}, nil
	})
	handle("/totals", func(ctx context.Context, req request) (response, error) {
		t := fsys.Totals()
		return response{Totals: &t}, nil
	})
	handle("/meta", func(ctx context.Context, req request) (response, error) {
		tmp, err := os.MkdirTemp(cfg.Dir, "meta-")
		if err != nil {
			return response{}, err
		}
		defer os.RemoveAll(tmp)
		chunks, err := lazy.MetaChunks(ctx, fsys, req.Hex, tmp)
		return response{Chunks: chunks}, err
	})
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok\n") })
	return mux
}

var kinds = []error{errdefs.ErrInvalidArgument, errdefs.ErrNotFound, errdefs.ErrUnavailable, errdefs.ErrDeadlineExceeded}

func writeResp(w http.ResponseWriter, resp response, err error) {
	w.Header().Set("Content-Type", "application/json")
	if err != nil {
		resp.Error = err.Error()
		for _, k := range kinds {
			if errors.Is(err, k) {
				resp.Kind = k.Error()
			}
		}
		w.WriteHeader(http.StatusInternalServerError)
	}
	json.NewEncoder(w).Encode(resp)
}

// Client talks to a running `dsecd lazyfs`.
type Client struct {
	cfg Config
	hc  *http.Client
}

// Connect returns a client of the lazyfs serving cfg, starting one (with
// self as the dsecd binary) when none answers. The process is detached: it
// outlives the caller, and Stop ends it.
func Connect(ctx context.Context, cfg Config, self string, log *slog.Logger) (*Client, error) {
	c := &Client{cfg: cfg, hc: &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", cfg.socket())
		},
	}}}
	if c.healthy(ctx) {
		log.Info("reusing running lazyfs", "dir", cfg.Dir)
		return c, nil
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("start lazyfs: %w", err)
	}
	logf, err := os.OpenFile(filepath.Join(cfg.Dir, "lazyfs.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("start lazyfs: %w", err)
	}
	defer logf.Close()
	cmd := exec.Command(self, cfg.Args()...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start lazyfs: %w", err)
	}
	pid := cmd.Process.Pid
	cmd.Process.Release() // not our child to wait for: it outlives us
	deadline := time.Now().Add(20 * time.Second)
	for !c.healthy(ctx) {
		if time.Now().After(deadline) || ctx.Err() != nil {
			syscall.Kill(pid, syscall.SIGKILL)
			tail, _ := os.ReadFile(filepath.Join(cfg.Dir, "lazyfs.log"))
			if len(tail) > 2048 {
				tail = tail[len(tail)-2048:]
			}
			return nil, fmt.Errorf("start lazyfs: it did not answer within 20 s: %w\n%s", errdefs.ErrUnavailable, tail)
		}
		time.Sleep(20 * time.Millisecond)
	}
	log.Info("started lazyfs", "pid", pid, "dir", cfg.Dir)
	return c, nil
}

func (c *Client) healthy(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://lazyfs/healthz", nil)
	resp, err := c.hc.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

func (c *Client) call(ctx context.Context, path string, req request) (response, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return response{}, err
	}
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://lazyfs"+path, bytes.NewReader(body))
	if err != nil {
		return response{}, err
	}
	resp, err := c.hc.Do(hr)
	if err != nil {
		return response{}, fmt.Errorf("lazyfs %s: %v: %w", path, err, errdefs.ErrUnavailable)
	}
	defer resp.Body.Close()
	var out response
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return response{}, fmt.Errorf("lazyfs %s: decode reply: %w", path, err)
	}
	if out.Error != "" {
		for _, k := range kinds {
			if out.Kind == k.Error() {
				return out, fmt.Errorf("lazyfs: %s: %w", out.Error, k)
			}
		}
		return out, fmt.Errorf("lazyfs: %s", out.Error)
	}
	return out, nil
}

// Add registers a layer file and returns its path on the FUSE mount.
func (c *Client) Add(ctx context.Context, ix *blob.Index) (string, error) {
	r, err := c.call(ctx, "/add", request{Index: ix})
	return r.Path, err
}

// FetchAll pulls every chunk of a layer into the cache.
func (c *Client) FetchAll(ctx context.Context, hex string) error {
	_, err := c.call(ctx, "/fetch-all", request{Hex: hex})
	return err
}

// PrefetchTrace fetches the chunks an earlier run on this node recorded
// reading, else those the blob store's published trace names.
func (c *Client) PrefetchTrace(ctx context.Context, hex string) (int, error) {
	r, err := c.call(ctx, "/prefetch-trace", request{Hex: hex})
	return r.N, err
}

// SaveTrace records the chunks read so far for later prefetching.
func (c *Client) SaveTrace(ctx context.Context, hex string) error {
	_, err := c.call(ctx, "/save-trace", request{Hex: hex})
	return err
}

// PublishTrace merges the chunks read so far into the layer's trace in the
// blob store, for other nodes to prefetch, and reports whether it wrote it.
func (c *Client) PublishTrace(ctx context.Context, hex string) (bool, error) {
	r, err := c.call(ctx, "/publish-trace", request{Hex: hex})
	return r.Wrote, err
}

// Stats reports a layer's reads, fetches and cache hits.
func (c *Client) Stats(ctx context.Context, hex string) (lazy.LayerStats, error) {
	r, err := c.call(ctx, "/stats", request{Hex: hex})
	return r.Stats, err
}

// Totals reads the file system's counters over every layer and its
// cache's size (lazy.FS.Totals), for the node's /metrics. A lazyfs older
// than this dsecd, which does not serve them, is NotSupported.
func (c *Client) Totals(ctx context.Context) (lazy.Totals, error) {
	r, err := c.call(ctx, "/totals", request{})
	if err != nil {
		return lazy.Totals{}, err
	}
	if r.Totals == nil {
		return lazy.Totals{}, fmt.Errorf("lazyfs totals: the running lazyfs does not serve them (restart it): %w", errdefs.ErrNotSupported)
	}
	return *r.Totals, nil
}

// MetaChunks finds the chunks holding a layer's file system metadata.
func (c *Client) MetaChunks(ctx context.Context, hex string) ([]int, error) {
	r, err := c.call(ctx, "/meta", request{Hex: hex})
	return r.Chunks, err
}

// Stop ends the lazyfs of dir (if one runs), which unmounts its file system,
// and detaches a mount a dead one left. Sandboxes must be gone first.
func Stop(ctx context.Context, dir string) error {
	cfg := Config{Dir: dir}
	b, err := os.ReadFile(cfg.pidFile())
	if err == nil {
		if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && isLazyfs(pid) {
			syscall.Kill(pid, syscall.SIGTERM)
			deadline := time.Now().Add(10 * time.Second)
			for isLazyfs(pid) && time.Now().Before(deadline) {
				time.Sleep(20 * time.Millisecond)
			}
			if isLazyfs(pid) {
				syscall.Kill(pid, syscall.SIGKILL)
			}
		}
		os.Remove(cfg.pidFile())
	}
	if err := unix.Unmount(cfg.MountPoint(), unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmount %s: %w", cfg.MountPoint(), err)
	}
	return nil
}

// CPUTime returns the CPU time (user and system) the lazyfs of dir has used
// so far, from /proc; an error when none runs.
func CPUTime(dir string) (time.Duration, error) {
	cfg := Config{Dir: dir}
	b, err := os.ReadFile(cfg.pidFile())
	if err != nil {
		return 0, fmt.Errorf("read lazyfs cpu time: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || !isLazyfs(pid) {
		return 0, fmt.Errorf("read lazyfs cpu time: no lazyfs runs for %s: %w", dir, errdefs.ErrNotFound)
	}
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("read lazyfs cpu time: %w", err)
	}
	// Fields after the command (which may hold spaces): state is the
	// third field of stat, utime and stime the 14th and 15th.
	i := bytes.LastIndexByte(st, ')')
	if i < 0 {
		return 0, fmt.Errorf("read lazyfs cpu time: malformed /proc/%d/stat", pid)
	}
	f := strings.Fields(string(st[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("read lazyfs cpu time: malformed /proc/%d/stat", pid)
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return 0, fmt.Errorf("read lazyfs cpu time: %w", err)
	}
	// USER_HZ is 100 on every Linux ABI Go supports.
	return time.Duration(utime+stime) * (time.Second / 100), nil
}

// isLazyfs reports whether pid is alive and a lazyfs (not a recycled pid).
func isLazyfs(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return false
	}
	args := strings.Split(string(b), "\x00")
	if len(args) < 2 || args[1] != "lazyfs" {
		return false
	}
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// A zombie is not alive.
	if i := bytes.LastIndexByte(st, ')'); i > 0 && i+2 < len(st) && st[i+2] == 'Z' {
		return false
	}
	return true
}
