package agent

import (
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	"dsec.dev/dsec/api/gen/dsec/agent/v1/agentv1connect"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/account"
	"dsec.dev/dsec/internal/agent/call"
	"dsec.dev/dsec/internal/agent/fs"
	"dsec.dev/dsec/internal/agent/proc"
	"dsec.dev/dsec/internal/agent/session"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/flushhold"
)

// keepaliveEvery is the silence after which a stream gets a keepalive.
const keepaliveEvery = 15 * time.Second

// defaultPath is the PATH of every command unless overridden.
const defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// etcDir is where the sandbox's passwd and group live.
const etcDir = "/etc"

type handler struct {
	cfg        Config
	procs      *proc.Manager
	sessions   *session.Manager
	files      *fs.FS
	accounts   *account.Cache
	calls      *call.Runner // nil unless --fncall
	fg         *foreground
	terminals  sync.Map // process ID → *terminal, the PTY shells
	lastActive atomic.Int64
}

var _ agentv1connect.AgentServiceHandler = (*handler)(nil)

func newHandler(cfg Config, agentPath string) (*handler, error) {
	h := &handler{cfg: cfg, files: &fs.FS{Dir: cfg.Workdir}, accounts: account.NewCache(etcDir), fg: newForeground(nil, cfg.Log)}
	h.touch()
	procs, err := proc.NewManager(proc.Config{
		CgroupFD:       cfg.CgroupFD,
		MemoryCgroupFD: cfg.MemoryCgroupFD,
		PidsCgroupFD:   cfg.PidsCgroupFD,
		NodeOOM:        !cfg.Guest,
		OnExit:         h.touch,
		Log:            cfg.Log,
	})
	if err != nil {
		return nil, err
	}
	h.procs = procs
	if cfg.FnCall {
		var preload []string
		if cfg.ZygotePreload != "" {
			preload = strings.Split(cfg.ZygotePreload, ",")
		}
		var wipe []string
		if cfg.CallWipe != "" {
			wipe = strings.Split(cfg.CallWipe, ",")
		}
		h.calls = call.New(call.Config{
			Procs:       procs,
			ScratchRoot: cfg.CallScratch,
			Wipe:        wipe,
			RemoveIPC:   os.Getpid() == 1,
			FreezerFD:   cfg.CgroupFD,
			MemoryFD:    cfg.MemoryCgroupFD,
			CPUFD:       cfg.CPUCgroupFD,
			PidsFD:      cfg.PidsCgroupFD,
			Preload:     preload,
			Log:         cfg.Log,
		})
	}
	h.sessions = session.NewManager(procs, func(user, shell string) (session.Base, error) {
		return h.spec(user, "", shell, nil, nil, "-")
	}, agentPath)
	return h, nil
}

// Call runs one fncall call (package call).
func (h *handler) Call(ctx context.Context, req *connect.Request[agentv1.CallRequest]) (*connect.Response[agentv1.CallResponse], error) {
	if h.calls == nil {
		return nil, errdefs.ToConnect(fmt.Errorf("run call: this sandbox is not a fncall container: %w", errdefs.ErrFailedPrecondition))
	}
	resp, err := h.calls.Call(ctx, req.Msg)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(resp), nil
}

func (h *handler) touch() { h.lastActive.Store(time.Now().UnixMilli()) }

func (h *handler) account(user string) (account.Account, error) {
	if user == "" {
		user = h.cfg.User
	}
	return h.accounts.Lookup(user)
}

// spec builds the process spec shared by Exec, sessions and Shell. With
// command set, argv becomes `shell -c command`.
func (h *handler) spec(user, cwd, shell string, env map[string]string, argv []string, command string) (proc.Spec, error) {
	switch {
	case len(argv) > 0 && command != "":
		return proc.Spec{}, fmt.Errorf("build command: give argv or command, not both: %w", errdefs.ErrInvalidArgument)
	case len(argv) == 0 && command == "":
		return proc.Spec{}, fmt.Errorf("build command: argv or command is required: %w", errdefs.ErrInvalidArgument)
	}
	a, err := h.account(user)
	if err != nil {
		return proc.Spec{}, err
	}
	if command != "" {
		if shell == "" {
			shell = h.cfg.Shell
		}
		argv = []string{shell, "-c", command}
	}
	home := a.Home
	if home == "" {
		home = "/"
	}
	vars := map[string]string{"PATH": defaultPath, "HOME": home}
	if a.Name != "" {
		vars["USER"] = a.Name
		vars["LOGNAME"] = a.Name
	}
	for _, kv := range h.cfg.Env {
		if k, v, ok := strings.Cut(kv, "="); ok {
			vars[k] = v
		}
	}
	for k, v := range env {
		if k == "" || strings.ContainsAny(k, "=\x00") || strings.ContainsRune(v, 0) {
			return proc.Spec{}, fmt.Errorf("build command: bad environment variable %q: %w", k, errdefs.ErrInvalidArgument)
		}
		vars[k] = v
	}
	keys := make([]string, 0, len(vars))
	for k := range vars {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	envList := make([]string, 0, len(keys))
	for _, k := range keys {
		envList = append(envList, k+"="+vars[k])
	}

	dir := h.files.WorkDir(a)
	if cwd != "" {
		if filepath.IsAbs(cwd) {
			dir = cwd
		} else {
			dir = filepath.Join(dir, cwd)
		}
	}
	return proc.Spec{Argv: argv, Env: envList, Dir: dir, UID: a.UID, GID: a.GID, Groups: a.Groups}, nil
}

func seconds(s float64) time.Duration {
	if s <= 0 {
		return 0
	}
	return time.Duration(s * float64(time.Second))
}

func (h *handler) Ping(ctx context.Context, req *connect.Request[agentv1.PingRequest]) (*connect.Response[agentv1.PingResponse], error) {
	return connect.NewResponse(&agentv1.PingResponse{
		RunningProcesses: int32(h.procs.Running()),
		LastActiveUnixMs: h.lastActive.Load(),
		OomKills:         h.procs.OOMKills(),
		Version:          Version,
	}), nil
}

// follow streams a process through f: started, then its output until it
// exits. beforeExit runs before the exit is sent and returns the exit to
// send.
func follow(ctx context.Context, p *proc.Process, f *proc.Follower, send func(*dsecv1.ExecEvent) error, beforeExit func(*dsecv1.ExecExited) *dsecv1.ExecExited) error {
	if e := p.Exited(); e == nil || e.Status != dsecv1.ExitStatus_EXIT_STATUS_START_ERROR {
		if err := send(startedEvent(p)); err != nil {
			return err
		}
	}
	for {
		chunks, exited, err := f.Next(ctx, keepaliveEvery)
		if err != nil {
			return err
		}
		for _, c := range chunks {
			if err := send(chunkEvent(c)); err != nil {
				return err
			}
		}
		if exited != nil {
			if beforeExit != nil {
				exited = beforeExit(exited)
			}
			// The exit is the last message: it leaves with the end of the stream.
			flushhold.Hold(ctx)
			return send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Exited{Exited: exited}})
		}
		if len(chunks) == 0 {
			if err := send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Keepalive{Keepalive: true}}); err != nil {
				return err
			}
		}
	}
}

func startedEvent(p *proc.Process) *dsecv1.ExecEvent {
	return &dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Started{Started: &dsecv1.ExecStarted{
		ProcessId: p.ID, Pid: int32(p.Pid), Tag: p.Tag}}}
}

func chunkEvent(c proc.Chunk) *dsecv1.ExecEvent {
	if c.Dropped > 0 {
		return &dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Dropped{Dropped: &dsecv1.ExecDropped{
			Stderr: c.Stream == proc.Stderr, Bytes: c.Dropped}}}
	}
	if c.Stream == proc.Stderr {
		return &dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Stderr{Stderr: c.Data}}
	}
	return &dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Stdout{Stdout: c.Data}}
}

func (h *handler) outputLimit(n int64) int64 {
	if n > 0 {
		return n
	}
	return h.cfg.OutputLimit
}

func (h *handler) Exec(ctx context.Context, req *connect.Request[dsecv1.ExecRequest], stream *connect.ServerStream[dsecv1.ExecEvent]) error {
	return h.exec(ctx, req.Msg, stream.Send)
}

// execFramed serves Exec on the channel's framed path (package execwire).
func (h *handler) execFramed(ctx context.Context, r *dsecv1.ExecRequest, send func(*dsecv1.ExecEvent) error) error {
	h.touch()
	return h.exec(ctx, r, send)
}

// exec runs a command and streams it; a foreground command dies with its
// stream (foreground.end: unless the stream ended with the agent channel).
func (h *handler) exec(ctx context.Context, r *dsecv1.ExecRequest, send func(*dsecv1.ExecEvent) error) error {
	spec, err := h.spec(r.User, r.Cwd, r.Shell, r.Env, r.Argv, r.Command)
	if err != nil {
		return errdefs.ToConnect(err)
	}
	spec.Stdin, spec.KeepStdinOpen = r.Stdin, r.KeepStdinOpen
	spec.Timeout = seconds(r.TimeoutSeconds)
	spec.Background, spec.Tag = r.Background, r.Tag
	spec.OutputLimit = h.outputLimit(r.OutputLimitBytes)
	spec.Followed = true
	p, err := h.procs.Start(context.WithoutCancel(ctx), spec)
	if err != nil {
		return errdefs.ToConnect(err)
	}
	f := p.Follower()
	defer f.Close()
	if !r.Background {
		h.fg.own(p)
		defer h.fg.end(ctx, p)
	}
	var before func(*dsecv1.ExecExited) *dsecv1.ExecExited
	if r.GetAfter() != nil {
		before = func(x *dsecv1.ExecExited) *dsecv1.ExecExited { return h.after(r.GetAfter(), spec.UID, x) }
	}
	return errdefs.ToConnect(follow(ctx, p, f, send, before))
}

// after does what an exec's after asks once its command exited (x), on
// the exit it returns (a copy: the process keeps its own): it kills every
// process of uid, the command's user, but the agent (killUser), then reads
// the file as root. A command the platform ended is left as it is, and so
// is one whose after steps failed: the edge does them then.
func (h *handler) after(a *dsecv1.ExecAfter, uid uint32, x *dsecv1.ExecExited) *dsecv1.ExecExited {
	if x.GetFault() != dsecv1.Fault_FAULT_UNSPECIFIED {
		return x
	}
	began := time.Now()
	done := &dsecv1.ExecAfterDone{}
	if a.GetKillUser() {
		if err := killUser(uid); err != nil {
			h.cfg.Log.Warn("kill a command's user's processes after it", "uid", uid, "err", err)
			return x
		}
	}
	if p := a.GetReadFile(); p != "" {
		root, err := h.account("root")
		if err != nil {
			return x
		}
		data, _, _, err := h.files.ReadFile(root, p, 0, afterReadLimit)
		switch {
		case errors.Is(err, errdefs.ErrNotFound):
			done.FileMissing = true
		case err != nil:
			h.cfg.Log.Warn("read a file after a command", "path", p, "err", err)
			return x
		default:
			done.File = data
		}
	}
	done.DurationSeconds = time.Since(began).Seconds()
	out := proto.Clone(x).(*dsecv1.ExecExited)
	out.After = done
	return out
}

// afterReadLimit bounds the file ExecAfter.read_file reads back: a grade's
// reward, a number.
const afterReadLimit = 4 << 10

func (h *handler) Attach(ctx context.Context, req *connect.Request[dsecv1.AttachRequest], stream *connect.ServerStream[dsecv1.ExecEvent]) error {
	return h.attach(ctx, req.Msg, stream.Send)
}

// attach follows a process from its start, or from the offsets of a
// stream that broke; with reattach it takes over an orphaned foreground
// command (foreground.adopt).
func (h *handler) attach(ctx context.Context, r *dsecv1.AttachRequest, send func(*dsecv1.ExecEvent) error) error {
	key := r.ProcessId
	if key == "" {
		key = r.Tag
	}
	if key == "" {
		return errdefs.ToConnect(fmt.Errorf("attach: process_id or tag is required: %w", errdefs.ErrInvalidArgument))
	}
	p, err := h.procs.Get(key)
	if err != nil {
		return errdefs.ToConnect(err)
	}
	if r.Reattach {
		owns, err := h.fg.adopt(ctx, p)
		if err != nil {
			return errdefs.ToConnect(err)
		}
		if owns {
			defer h.fg.end(ctx, p) // after f.Close: the output is freed once no stream follows
		}
	}
	f := p.FollowFrom(r.StdoutOffset, r.StderrOffset)
	defer f.Close()
	if r.NoFollow {
		return errdefs.ToConnect(replay(ctx, p, f, send))
	}
	return errdefs.ToConnect(follow(ctx, p, f, send, nil))
}

// replay sends what follow would, up to now: the start, the retained output
// (and a gap where output was dropped), what came since, and the exit if
// the process has exited. It never waits for more.
func replay(ctx context.Context, p *proc.Process, f *proc.Follower, send func(*dsecv1.ExecEvent) error) error {
	if err := send(startedEvent(p)); err != nil {
		return err
	}
	for {
		chunks, exited, err := f.Next(ctx, 0)
		if err != nil {
			return err
		}
		for _, c := range chunks {
			if err := send(chunkEvent(c)); err != nil {
				return err
			}
		}
		if exited != nil {
			return send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Exited{Exited: exited}})
		}
		if len(chunks) == 0 {
			return nil
		}
	}
}

func (h *handler) WriteStdin(ctx context.Context, req *connect.Request[dsecv1.WriteStdinRequest]) (*connect.Response[dsecv1.WriteStdinResponse], error) {
	p, err := h.procs.Get(req.Msg.ProcessId)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	if err := p.WriteStdin(req.Msg.Data, req.Msg.Close); err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(&dsecv1.WriteStdinResponse{}), nil
}

func (h *handler) Signal(ctx context.Context, req *connect.Request[dsecv1.SignalRequest]) (*connect.Response[dsecv1.SignalResponse], error) {
	p, err := h.procs.Get(req.Msg.ProcessId)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	sig := req.Msg.Signal
	if sig < 0 || sig > 64 {
		return nil, errdefs.ToConnect(fmt.Errorf("signal process %s: bad signal %d: %w", p.ID, sig, errdefs.ErrInvalidArgument))
	}
	if err := p.Signal(unix.Signal(sig)); err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(&dsecv1.SignalResponse{}), nil
}

func (h *handler) ListProcesses(ctx context.Context, req *connect.Request[dsecv1.ListProcessesRequest]) (*connect.Response[dsecv1.ListProcessesResponse], error) {
	resp := &dsecv1.ListProcessesResponse{}
	for _, p := range h.procs.List() {
		resp.Processes = append(resp.Processes, p.Info())
	}
	return connect.NewResponse(resp), nil
}

func (h *handler) SessionRun(ctx context.Context, req *connect.Request[dsecv1.SessionRunRequest], stream *connect.ServerStream[dsecv1.ExecEvent]) error {
	r := req.Msg
	if r.Command == "" {
		return errdefs.ToConnect(fmt.Errorf("run in session: command is required: %w", errdefs.ErrInvalidArgument))
	}
	run, err := h.sessions.Start(context.WithoutCancel(ctx), session.RunRequest{
		Session: r.Session, Command: r.Command, Timeout: seconds(r.TimeoutSeconds), Stdin: r.Stdin,
		Shell: r.Shell, User: r.User, OutputLimit: h.cfg.OutputLimit,
	})
	if err != nil {
		return errdefs.ToConnect(err)
	}
	p := run.Process
	f := p.Follower()
	defer f.Close()
	h.fg.own(p)
	defer h.fg.end(ctx, p)
	return errdefs.ToConnect(follow(ctx, p, f, stream.Send, func(x *dsecv1.ExecExited) *dsecv1.ExecExited {
		<-run.Finished
		return x
	}))
}

func (h *handler) SessionInterrupt(ctx context.Context, req *connect.Request[dsecv1.SessionInterruptRequest]) (*connect.Response[dsecv1.SessionInterruptResponse], error) {
	if err := h.sessions.Interrupt(req.Msg.Session); err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(&dsecv1.SessionInterruptResponse{}), nil
}

func (h *handler) SessionClose(ctx context.Context, req *connect.Request[dsecv1.SessionCloseRequest]) (*connect.Response[dsecv1.SessionCloseResponse], error) {
	if err := h.sessions.Close(req.Msg.Session); err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(&dsecv1.SessionCloseResponse{}), nil
}

func (h *handler) ReadFile(ctx context.Context, req *connect.Request[dsecv1.ReadFileRequest]) (*connect.Response[dsecv1.ReadFileResponse], error) {
	r := req.Msg
	a, err := h.account(r.User)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	data, size, truncated, err := h.files.ReadFile(a, r.Path, r.Offset, r.Limit)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(&dsecv1.ReadFileResponse{Data: data, Size: size, Truncated: truncated}), nil
}

func (h *handler) WriteFile(ctx context.Context, req *connect.Request[dsecv1.WriteFileRequest]) (*connect.Response[dsecv1.WriteFileResponse], error) {
	r := req.Msg
	a, err := h.account(r.User)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	n, err := h.files.WriteFile(a, r.Path, r.Data, r.Mode, r.Append, r.MakeParents)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(&dsecv1.WriteFileResponse{Written: n}), nil
}

func (h *handler) ListDir(ctx context.Context, req *connect.Request[dsecv1.ListDirRequest]) (*connect.Response[dsecv1.ListDirResponse], error) {
	a, err := h.account(req.Msg.User)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	ents, err := h.files.ListDir(a, req.Msg.Path)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(&dsecv1.ListDirResponse{Entries: ents}), nil
}

func (h *handler) Stat(ctx context.Context, req *connect.Request[dsecv1.StatRequest]) (*connect.Response[dsecv1.StatResponse], error) {
	a, err := h.account(req.Msg.User)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	fi, err := h.files.Stat(a, req.Msg.Path)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(&dsecv1.StatResponse{Info: fi}), nil
}

func (h *handler) Remove(ctx context.Context, req *connect.Request[dsecv1.RemoveRequest]) (*connect.Response[dsecv1.RemoveResponse], error) {
	a, err := h.account(req.Msg.User)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	if err := h.files.Remove(a, req.Msg.Path, req.Msg.Recursive); err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(&dsecv1.RemoveResponse{}), nil
}

func (h *handler) MakeDir(ctx context.Context, req *connect.Request[dsecv1.MakeDirRequest]) (*connect.Response[dsecv1.MakeDirResponse], error) {
	a, err := h.account(req.Msg.User)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	if err := h.files.MakeDir(a, req.Msg.Path, req.Msg.Parents, req.Msg.Mode); err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(&dsecv1.MakeDirResponse{}), nil
}

func (h *handler) Move(ctx context.Context, req *connect.Request[dsecv1.MoveRequest]) (*connect.Response[dsecv1.MoveResponse], error) {
	r := req.Msg
	a, err := h.account(r.User)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	fi, err := h.files.Move(a, r.Source, r.Destination, r.MakeParents)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(&dsecv1.MoveResponse{Info: fi}), nil
}

func (h *handler) WatchDir(ctx context.Context, req *connect.Request[dsecv1.WatchDirRequest], stream *connect.ServerStream[dsecv1.WatchEvent]) error {
	r := req.Msg
	a, err := h.account(r.User)
	if err != nil {
		return errdefs.ToConnect(err)
	}
	err = h.files.Watch(ctx, a, r.Path, r.Recursive, func() error {
		return stream.Send(&dsecv1.WatchEvent{Started: true})
	}, func(name string, c dsecv1.FileChange) error {
		return stream.Send(&dsecv1.WatchEvent{Name: name, Change: c})
	})
	return errdefs.ToConnect(err)
}

func (h *handler) Upload(ctx context.Context, req *connect.Request[dsecv1.UploadRequest]) (*connect.Response[dsecv1.UploadResponse], error) {
	a, err := h.account(req.Msg.User)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	files, n, err := h.files.Upload(a, req.Msg.Path, req.Msg.Tar)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(&dsecv1.UploadResponse{Files: files, Bytes: n}), nil
}

func (h *handler) Download(ctx context.Context, req *connect.Request[dsecv1.DownloadRequest], stream *connect.ServerStream[dsecv1.DownloadChunk]) error {
	a, err := h.account(req.Msg.User)
	if err != nil {
		return errdefs.ToConnect(err)
	}
	// A resumed download (its stream cut by the agent channel: a microVM
	// paused to disk) skips what was sent, which must be what it was.
	skip, crc := req.Msg.Offset, uint32(0)
	changed := fmt.Errorf("resume download of %s at byte %d: its files changed since the download was cut; download again: %w",
		req.Msg.Path, req.Msg.Offset, errdefs.ErrFailedPrecondition)
	err = h.files.Download(a, req.Msg.Path, func(b []byte) error {
		if skip > 0 {
			n := min(int64(len(b)), skip)
			crc = crc32.Update(crc, crc32.MakeTable(crc32.Castagnoli), b[:n])
			skip, b = skip-n, b[n:]
			if skip == 0 && crc != req.Msg.PrefixCrc32C {
				return changed
			}
			if len(b) == 0 {
				return nil
			}
		}
		return stream.Send(&dsecv1.DownloadChunk{Data: b})
	})
	if err == nil && skip > 0 {
		err = changed
	}
	return errdefs.ToConnect(err)
}
