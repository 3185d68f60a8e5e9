package call

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/proc"
	"dsec.dev/dsec/internal/errdefs"
)

// Defaults of a call.
const (
	DefaultOutputLimit = 1 << 20
	DefaultTimeout     = 10 * time.Second
	DefaultPids        = 256
	DefaultFetchLimit  = 64 << 20
	DefaultUIDBase     = 61000
	DefaultUIDCount    = 64
	defaultPath        = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	cfsPeriod          = 100000
	// maxTimeout bounds one step, whatever the request says.
	maxTimeout = 15 * time.Minute
)

// DefaultWipe are the directories a call's uid may write to outside its
// scratch directory in a fncall environment; every call ends with them
// emptied.
var DefaultWipe = []string{"/tmp", "/var/tmp", "/dev/shm"}

// Config configures a Runner.
type Config struct {
	Procs *proc.Manager
	// The sandbox's cgroup v1 directories (PidsFD: the commands' pids
	// cgroup); -1 where there is none. The call's cgroups are made under
	// them.
	FreezerFD, MemoryFD, CPUFD, PidsFD int
	// Python is the zygote's interpreter; "" looks up python3 on the PATH.
	Python string
	// Preload are the modules the zygote imports before its first fork.
	Preload []string
	// UIDBase and UIDCount are the pool of uids calls run as.
	UIDBase, UIDCount uint32
	// ScratchRoot holds the calls' scratch directories ("" = /tmp).
	ScratchRoot string
	// Wipe are the directories emptied after every call (nil =
	// DefaultWipe).
	Wipe []string
	// RemoveIPC removes every System V IPC object after each call: only
	// for an agent in the container's own IPC namespace (pid 1).
	RemoveIPC bool
	Log       *slog.Logger
}

// DefaultPreload are the zygote's preloaded modules when the agent is not
// told otherwise: what short scoring programs import most, all standard.
// Every preloaded module makes every run dearer (a larger image to fork,
// fault in and unmap): dataclasses, fractions, decimal, statistics and
// datetime together cost each run about 0.3 ms on a 2-core VM, against the
// 1-6 ms their import costs the few programs that use them.
var DefaultPreload = []string{
	"runpy", "traceback", "io", "json", "re", "math", "collections", "itertools",
	"functools", "heapq", "bisect", "string", "random", "typing", "copy",
	"operator", "array",
}

// Runner runs calls, one at a time.
type Runner struct {
	cfg Config
	log *slog.Logger

	busy sync.Mutex // held for a whole call
	seq  atomic.Uint64

	cgOnce sync.Once
	cg     *cgroups
	cgErr  error

	zygOnce sync.Once
	zyg     *zygote // nil when it could not start: zygote steps fall back to argv
}

// New returns a Runner; it starts nothing until the first call.
func New(cfg Config) *Runner {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.UIDBase == 0 {
		cfg.UIDBase = DefaultUIDBase
	}
	if cfg.UIDCount == 0 {
		cfg.UIDCount = DefaultUIDCount
	}
	if cfg.ScratchRoot == "" {
		cfg.ScratchRoot = "/tmp"
	}
	if cfg.Preload == nil {
		cfg.Preload = DefaultPreload
	}
	if cfg.Wipe == nil {
		cfg.Wipe = DefaultWipe
	}
	return &Runner{cfg: cfg, log: cfg.Log}
}

// Warm starts the zygote now rather than at the first python call, so
// that call does not pay the interpreter's start and imports.
func (r *Runner) Warm() { r.zygote() }

// Settle brings the container's CPU weight back to the default: the
// runtime starts a fncall container at a raised one, so that on a node
// busy with calls its start (the agent, the zygote) comes before the
// running calls' next slices; once warm it is one container among the
// others. It is called once, before the agent answers.
func (r *Runner) Settle() error {
	if r.cfg.CPUFD < 0 {
		return nil
	}
	// cgroup v1's default weight, or v2's.
	for _, w := range []struct{ file, value string }{{"cpu.shares", "1024"}, {"cpu.weight", "100"}} {
		err := write(r.cfg.CPUFD, w.file, w.value)
		if !errors.Is(err, unix.ENOENT) {
			if err != nil {
				return fmt.Errorf("set the container's CPU weight back to the default: %w", err)
			}
			return nil
		}
	}
	return nil
}

// Close stops the zygote.
func (r *Runner) Close() {
	if r.zyg != nil {
		r.zyg.close()
	}
}

// Call runs one call. Errors are for calls that could not be run at all
// (bad requests, a busy runner, a broken container); what the program did
// is in the steps.
func (r *Runner) Call(ctx context.Context, req *agentv1.CallRequest) (*agentv1.CallResponse, error) {
	if err := validate(req); err != nil {
		return nil, err
	}
	if !r.busy.TryLock() {
		return nil, fmt.Errorf("run call: the container is running another call: %w", errdefs.ErrUnavailable)
	}
	defer r.busy.Unlock()
	r.cgOnce.Do(func() { r.cg, r.cgErr = makeCgroups(r.cfg) })
	if r.cgErr != nil {
		return nil, r.cgErr
	}

	n := r.seq.Add(1)
	uid := r.cfg.UIDBase + uint32(n%uint64(r.cfg.UIDCount))
	scratch := filepath.Join(r.cfg.ScratchRoot, "call-"+strconv.FormatUint(n, 10))
	resp := &agentv1.CallResponse{Uid: uid, Scratch: scratch}

	// Cleanup runs whatever happens from here on.
	defer func() {
		if reason := r.cleanup(scratch, uid); reason != "" {
			resp.Dirty, resp.DirtyReason = true, reason
			r.log.Warn("call left something behind", "uid", uid, "reason", reason)
		}
	}()
	if err := r.cg.setLimits(req); err != nil {
		return resp, err
	}
	if err := writeFiles(scratch, uid, req.GetFiles()); err != nil {
		return resp, err
	}
	env := callEnv(scratch, req.GetEnv())
	limit := req.GetOutputLimitBytes()
	if limit <= 0 {
		limit = DefaultOutputLimit
	}
	for _, st := range req.GetSteps() {
		res := r.runStep(ctx, st, scratch, uid, env, limit, req.GetMemoryBytes())
		resp.Steps = append(resp.Steps, res)
		if res.GetExited().GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_OK {
			break
		}
	}
	fl := req.GetFetchLimitBytes()
	if fl <= 0 {
		fl = DefaultFetchLimit
	}
	files, err := fetchFiles(scratch, req.GetFetchFiles(), fl)
	if err != nil {
		return resp, err
	}
	resp.Files = files
	return resp, nil
}

func validate(req *agentv1.CallRequest) error {
	if len(req.GetSteps()) == 0 {
		return fmt.Errorf("run call: no steps: %w", errdefs.ErrInvalidArgument)
	}
	for i, st := range req.GetSteps() {
		if len(st.GetArgv()) == 0 {
			return fmt.Errorf("run call: step %d has no argv: %w", i, errdefs.ErrInvalidArgument)
		}
		if f := st.GetZygoteFile(); f != "" {
			if _, err := cleanRel(f); err != nil {
				return fmt.Errorf("run call: step %d: %w", i, err)
			}
		}
	}
	for p := range req.GetFiles() {
		if _, err := cleanRel(p); err != nil {
			return fmt.Errorf("run call: files: %w", err)
		}
	}
	for _, p := range req.GetFetchFiles() {
		if _, err := cleanRel(p); err != nil {
			return fmt.Errorf("run call: fetch_files: %w", err)
		}
	}
	for k, v := range req.GetEnv() {
		if k == "" || strings.ContainsAny(k, "=\x00") || strings.ContainsRune(v, 0) {
			return fmt.Errorf("run call: bad environment variable %q: %w", k, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

// cleanRel checks that p names something inside the scratch directory and
// returns it cleaned. The edge turns absolute paths inside the scratch
// directory into relative ones before they get here.
func cleanRel(p string) (string, error) {
	c := path.Clean(p)
	if p == "" || strings.ContainsRune(p, 0) || path.IsAbs(c) || c == "." || c == ".." || strings.HasPrefix(c, "../") {
		return "", fmt.Errorf("path %q is not inside the scratch directory: %w", p, errdefs.ErrInvalidArgument)
	}
	return c, nil
}

func callEnv(scratch string, extra map[string]string) []string {
	vars := map[string]string{
		"PATH":   defaultPath,
		"HOME":   scratch,
		"TMPDIR": "/tmp",
		"LANG":   "C.UTF-8",
	}
	for k, v := range extra {
		vars[k] = v
	}
	env := make([]string, 0, len(vars))
	for k, v := range vars {
		env = append(env, k+"="+v)
	}
	sort.Strings(env)
	return env
}

// writeFiles makes the scratch directory and writes files into it, every
// path resolved inside it (os.Root), owned by uid.
func writeFiles(scratch string, uid uint32, files map[string][]byte) error {
	if err := os.Mkdir(scratch, 0o700); err != nil {
		return fmt.Errorf("make scratch directory: %w", err)
	}
	if err := os.Chown(scratch, int(uid), int(uid)); err != nil {
		return fmt.Errorf("make scratch directory: %w", err)
	}
	if len(files) == 0 {
		return nil
	}
	root, err := os.OpenRoot(scratch)
	if err != nil {
		return fmt.Errorf("open scratch directory: %w", err)
	}
	defer root.Close()
	names := make([]string, 0, len(files))
	for p := range files {
		names = append(names, p)
	}
	sort.Strings(names)
	for _, p := range names {
		rel, _ := cleanRel(p)
		if err := mkdirAll(root, path.Dir(rel), uid); err != nil {
			return fmt.Errorf("write file %s: %w", p, err)
		}
		f, err := root.OpenFile(rel, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
		if err != nil {
			return fmt.Errorf("write file %s: %w", p, fileErr(err))
		}
		_, err = f.Write(files[p])
		if err == nil {
			err = f.Chown(int(uid), int(uid))
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("write file %s: %w", p, fileErr(err))
		}
	}
	return nil
}

func fileErr(err error) error {
	switch {
	case errors.Is(err, unix.ENOSPC), errors.Is(err, unix.EDQUOT):
		return fmt.Errorf("%w: %w", err, errdefs.ErrResourceExhausted)
	case errors.Is(err, fs.ErrExist), errors.Is(err, unix.ENOTDIR), errors.Is(err, unix.EISDIR):
		return fmt.Errorf("%w: %w", err, errdefs.ErrInvalidArgument)
	}
	return err
}

func mkdirAll(root *os.Root, dir string, uid uint32) error {
	if dir == "." || dir == "" {
		return nil
	}
	if err := mkdirAll(root, path.Dir(dir), uid); err != nil {
		return err
	}
	err := root.Mkdir(dir, 0o755)
	if errors.Is(err, fs.ErrExist) {
		st, serr := root.Stat(dir)
		if serr == nil && st.IsDir() {
			return nil
		}
		return fmt.Errorf("%s is not a directory: %w", dir, errdefs.ErrInvalidArgument)
	}
	if err != nil {
		return fileErr(err)
	}
	d, err := root.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Chown(int(uid), int(uid))
}

// fetchFiles reads the named files back, inside the scratch directory
// only (a symlink the call made that leads out of it is not followed out).
// Missing files, directories and what does not fit in limit are left out.
func fetchFiles(scratch string, names []string, limit int64) (map[string][]byte, error) {
	if len(names) == 0 {
		return nil, nil
	}
	root, err := os.OpenRoot(scratch)
	if err != nil {
		return nil, fmt.Errorf("open scratch directory: %w", err)
	}
	defer root.Close()
	out := map[string][]byte{}
	for _, p := range names {
		rel, _ := cleanRel(p)
		f, err := root.Open(rel)
		if err != nil {
			continue
		}
		st, err := f.Stat()
		if err != nil || !st.Mode().IsRegular() || st.Size() > limit {
			f.Close()
			continue
		}
		data, err := io.ReadAll(io.LimitReader(f, limit+1))
		f.Close()
		if err != nil || int64(len(data)) > limit {
			continue
		}
		limit -= int64(len(data))
		out[p] = data
	}
	return out, nil
}

// runStep runs one step and says how it ended; memory is the call's
// memory limit (0 = none).
func (r *Runner) runStep(ctx context.Context, st *agentv1.CallStep, scratch string, uid uint32, env []string, limit, memory int64) *agentv1.CallStepResult {
	timeout := DefaultTimeout
	if s := st.GetTimeoutSeconds(); s > 0 {
		timeout = min(time.Duration(s*float64(time.Second)), maxTimeout)
	}
	oom0 := r.cg.oomKills()
	var res *agentv1.CallStepResult
	if f := st.GetZygoteFile(); f != "" {
		if z := r.zygote(); z != nil {
			res = z.run(ctx, r.cg, zygoteRun{file: f, cwd: scratch, uid: uid, env: env, stdin: st.GetStdin(), timeout: timeout, limit: limit, data: memory})
		}
	}
	if res == nil {
		res = r.runProc(ctx, st, scratch, uid, env, timeout, limit)
	}
	if r.cg.oomKills() > oom0 {
		res.OomKilled = true
		if e := res.GetExited(); e.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_OK && e.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_TIMEOUT {
			e.Status = dsecv1.ExitStatus_EXIT_STATUS_OOM
			e.Message = "killed by the OOM killer at the call's memory limit"
		}
	}
	return res
}

func (r *Runner) runProc(ctx context.Context, st *agentv1.CallStep, scratch string, uid uint32, env []string, timeout time.Duration, limit int64) *agentv1.CallStepResult {
	p, err := r.cfg.Procs.Start(ctx, proc.Spec{
		Argv:        st.GetArgv(),
		Env:         env,
		Dir:         scratch,
		UID:         uid,
		GID:         uid,
		Groups:      []uint32{},
		Stdin:       st.GetStdin(),
		Timeout:     timeout,
		OutputLimit: limit,
		Join:        r.cg.joins(),
		KillOnExit:  true,
	})
	if err != nil {
		return &agentv1.CallStepResult{Exited: &dsecv1.ExecExited{ExitCode: 127, Status: dsecv1.ExitStatus_EXIT_STATUS_START_ERROR, Message: err.Error()}}
	}
	select {
	case <-p.DoneC():
	case <-ctx.Done():
		p.KillTree()
		<-p.DoneC()
	}
	res := &agentv1.CallStepResult{}
	for from := 0; ; {
		chunks, exited, next, err := p.Next(context.Background(), from, 0)
		if err != nil {
			break
		}
		for _, c := range chunks {
			if c.Stream == proc.Stdout {
				res.Stdout = append(res.Stdout, c.Data...)
			} else {
				res.Stderr = append(res.Stderr, c.Data...)
			}
		}
		if exited != nil {
			res.Exited = exited
			break
		}
		from = next
	}
	p.Release()
	return res
}

// cleanup kills what the call left, removes its files and says what could
// not be cleaned ("" = nothing).
func (r *Runner) cleanup(scratch string, uid uint32) string {
	var problems []string
	if left := r.cg.killAll(); left > 0 {
		problems = append(problems, fmt.Sprintf("%d processes of the call survived SIGKILL", left))
	}
	if pids := processesOf(uid); len(pids) > 0 {
		problems = append(problems, fmt.Sprintf("processes %v still run as the call's uid %d", pids, uid))
	}
	if err := os.RemoveAll(scratch); err != nil {
		problems = append(problems, "remove the scratch directory: "+err.Error())
	}
	for _, d := range r.cfg.Wipe {
		if err := emptyDir(d); err != nil {
			problems = append(problems, err.Error())
		}
	}
	if r.cfg.RemoveIPC && ipcInUse() {
		removeIPC()
	}
	return strings.Join(problems, "; ")
}

// emptyDir removes everything in dir, dir itself kept.
func emptyDir(dir string) error {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("empty %s: %w", dir, err)
	}
	var errs []error
	for _, e := range entries {
		if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("empty %s: %w", dir, errors.Join(errs...))
	}
	return nil
}

// processesOf lists the pids running as uid in the agent's pid namespace.
// It runs after every call: names only (no sorting, no entries), each
// pid's owner by fstatat on the open /proc.
func processesOf(uid uint32) []int {
	proc, err := os.Open("/proc")
	if err != nil {
		return nil
	}
	defer proc.Close()
	names, err := proc.Readdirnames(-1)
	if err != nil {
		return nil
	}
	dir := int(proc.Fd())
	var pids []int
	for _, name := range names {
		if name[0] < '1' || name[0] > '9' {
			continue
		}
		pid, err := strconv.Atoi(name)
		if err != nil {
			continue
		}
		var st unix.Stat_t
		if unix.Fstatat(dir, name, &st, 0) != nil || st.Uid != uid {
			continue
		}
		// A zombie is dead, only not yet reaped by its parent.
		if stat, err := os.ReadFile("/proc/" + name + "/stat"); err == nil {
			if i := strings.LastIndexByte(string(stat), ')'); i > 0 && i+2 < len(stat) && stat[i+2] == 'Z' {
				continue
			}
		}
		pids = append(pids, pid)
	}
	return pids
}

// The *_INFO commands of shmctl, semctl and msgctl (linux/shm.h, sem.h,
// msg.h): each fills a struct whose first (shm, msg) or eighth (sem) int
// counts the namespace's objects of its kind.
const (
	shmInfo = 14
	semInfo = 19
	msgInfo = 12
)

// ipcInUse says whether the IPC namespace holds any System V object, by
// the counts of the *_INFO commands: three system calls where reading
// /proc/sysvipc's files takes nine, and most calls make none.
func ipcInUse() bool {
	var buf [16]int32 // larger than shm_info, seminfo and msginfo
	for _, c := range []struct {
		nr, cmd uintptr
		count   int
	}{{unix.SYS_SHMCTL, shmInfo, 0}, {unix.SYS_SEMCTL, semInfo, 7}, {unix.SYS_MSGCTL, msgInfo, 0}} {
		clear(buf[:])
		var errno unix.Errno
		if c.nr == unix.SYS_SEMCTL {
			_, _, errno = unix.Syscall6(c.nr, 0, 0, c.cmd, uintptr(unsafe.Pointer(&buf[0])), 0, 0)
		} else {
			_, _, errno = unix.Syscall(c.nr, 0, c.cmd, uintptr(unsafe.Pointer(&buf[0])))
		}
		if errno != 0 || buf[c.count] != 0 {
			return true // when in doubt, look
		}
	}
	return false
}

// removeIPC removes every System V shared memory segment, semaphore set
// and message queue of the container's IPC namespace: only calls make them.
// IPC_RMID needs the object's owner or creator, or CAP_SYS_ADMIN, which the
// agent does not hold; so the calling thread, locked to its goroutine,
// takes each owner's uid as its effective uid for the removal (the kernel
// keeps credentials per thread; the saved uid stays 0 to come back by,
// and coming back restores the effective capabilities). A thread that
// could not come back stays locked, so it ends with its goroutine.
func removeIPC() {
	runtime.LockOSThread()
	keep := ^uintptr(0) // setresuid's -1: unchanged
	for _, kind := range []struct {
		file string
		nr   uintptr
	}{{"shm", unix.SYS_SHMCTL}, {"sem", unix.SYS_SEMCTL}, {"msg", unix.SYS_MSGCTL}} {
		data, err := os.ReadFile("/proc/sysvipc/" + kind.file)
		if err != nil {
			continue
		}
		lines := strings.Split(string(data), "\n")
		uidCol := slices.Index(strings.Fields(lines[0]), "uid")
		for _, line := range lines[1:] {
			f := strings.Fields(line)
			if uidCol < 0 || len(f) <= uidCol {
				continue
			}
			id, err1 := strconv.Atoi(f[1])
			uid, err2 := strconv.ParseUint(f[uidCol], 10, 32)
			if err1 != nil || err2 != nil {
				continue
			}
			unix.RawSyscall(unix.SYS_SETRESUID, keep, uintptr(uid), keep)
			if kind.nr == unix.SYS_SEMCTL {
				unix.Syscall6(kind.nr, uintptr(id), 0, unix.IPC_RMID, 0, 0, 0)
			} else {
				unix.Syscall(kind.nr, uintptr(id), unix.IPC_RMID, 0)
			}
			if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, keep, 0, keep); e != 0 {
				return // still locked: the thread goes with its goroutine
			}
		}
	}
	if euid, _, _ := unix.RawSyscall(unix.SYS_GETEUID, 0, 0, 0); euid == 0 {
		runtime.UnlockOSThread()
	}
}
