// Package grade runs a clean-room grade: it captures only a sandbox's
// workspace paths (a snapshot with include), starts a fresh sandbox from
// the sandbox's layers, that capture and the trusted tests on top, with no
// network and none of the sandbox's processes, runs the grader there as
// another user, and turns its exit, or the number it writes to the reward
// file, into a reward.
//
// It composes the public sandbox API (Snapshot, Create, WriteFile, Exec,
// ReadFile, Delete, DeleteSnapshot) through the API interface, so the
// apiserver runs it with the caller's own rights: the clean room is the
// caller's sandbox, charged to its project. docs/grading.md describes what
// it shuts out and how.
package grade

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// API is the part of the sandbox service a grade uses;
// dsecv1connect.SandboxServiceClient implements it.
type API interface {
	Get(context.Context, *connect.Request[dsecv1.GetRequest]) (*connect.Response[dsecv1.Sandbox], error)
	Snapshot(context.Context, *connect.Request[dsecv1.SnapshotRequest]) (*connect.Response[dsecv1.SnapshotInfo], error)
	DeleteSnapshot(context.Context, *connect.Request[dsecv1.DeleteSnapshotRequest]) (*connect.Response[dsecv1.DeleteSnapshotResponse], error)
	Create(context.Context, *connect.Request[dsecv1.CreateRequest]) (*connect.Response[dsecv1.CreateResponse], error)
	Delete(context.Context, *connect.Request[dsecv1.DeleteRequest]) (*connect.Response[dsecv1.DeleteResponse], error)
	WriteFile(context.Context, *connect.Request[dsecv1.WriteFileRequest]) (*connect.Response[dsecv1.WriteFileResponse], error)
	ReadFile(context.Context, *connect.Request[dsecv1.ReadFileRequest]) (*connect.Response[dsecv1.ReadFileResponse], error)
	Exec(context.Context, *connect.Request[dsecv1.ExecRequest]) (*connect.ServerStreamForClient[dsecv1.ExecEvent], error)
}

const (
	// RewardDir holds the reward file in the clean room: a trusted path,
	// so nothing of the workspace is there.
	RewardDir = "/.dsec-grade"
	// RewardFile is where the grader may write its reward, a number; the
	// grader finds the path in $DSEC_REWARD_FILE.
	RewardFile = RewardDir + "/reward"
	// RewardEnv names the reward file in the grader's environment.
	RewardEnv = "DSEC_REWARD_FILE"
	// DefaultUser is who the grader runs as unless the request names
	// someone: nobody, never the sandbox's own user.
	DefaultUser = "65534:65534"
	// RoomHostname is every clean room's host name.
	RoomHostname = "dsec-grade"
	// GradeOfLabel marks a clean room with the sandbox it grades.
	GradeOfLabel = "dsec.dev/grade-of"

	defaultTimeout     = 600 * time.Second
	defaultOutputLimit = 1 << 20
	// roomMargin is the clean room's lifetime past its grader's timeout:
	// its start, the tests and the reward's read.
	roomMargin = 300 * time.Second
	// projectLabel is iam.ProjectLabel: the clean room is the sandbox's
	// project's.
	projectLabel = "dsec.dev/project"
)

// Check refuses a request Run would refuse before it touches anything,
// with errdefs.ErrInvalidArgument.
func Check(req *dsecv1.GradeRequest) error {
	switch {
	case req.GetSandboxId() == "":
		return fmt.Errorf("grade: sandbox_id is required: %w", errdefs.ErrInvalidArgument)
	case len(req.GetPaths()) == 0:
		return fmt.Errorf("grade: paths is required: name the workspace paths the grade captures: %w", errdefs.ErrInvalidArgument)
	case len(req.GetArgv()) == 0 && req.GetCommand() == "":
		return fmt.Errorf("grade: the grader is required (argv or command): %w", errdefs.ErrInvalidArgument)
	case len(req.GetArgv()) > 0 && req.GetCommand() != "":
		return fmt.Errorf("grade: argv or command, not both: %w", errdefs.ErrInvalidArgument)
	case req.GetTimeoutSeconds() < 0 || req.GetOutputLimitBytes() < 0:
		return fmt.Errorf("grade: timeout_seconds and output_limit_bytes must not be negative: %w", errdefs.ErrInvalidArgument)
	}
	for _, p := range req.GetPaths() {
		if err := checkPath(p); err != nil {
			return fmt.Errorf("grade: path %q: %w: %w", p, err, errdefs.ErrInvalidArgument)
		}
		if under(p, RewardDir) || under(RewardDir, p) {
			return fmt.Errorf("grade: path %q holds the reward file's directory %s: %w", p, RewardDir, errdefs.ErrInvalidArgument)
		}
	}
	for _, p := range trustedPaths(req) {
		if err := checkPath(p); err != nil {
			return fmt.Errorf("grade: tests path %q: %w: %w", p, err, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

func checkPath(p string) error {
	switch {
	case !strings.HasPrefix(p, "/"):
		return errors.New("not absolute")
	case strings.ContainsRune(p, 0):
		return errors.New("holds a NUL byte")
	case path.Clean(p) == "/":
		return errors.New("is the whole file system")
	}
	for _, c := range strings.Split(p, "/") {
		if c == ".." {
			return errors.New("has a .. component")
		}
	}
	return nil
}

// under reports whether p is dir or inside it.
func under(p, dir string) bool {
	p, dir = path.Clean(p), path.Clean(dir)
	return p == dir || strings.HasPrefix(p, dir+"/")
}

// trustedPaths are the paths the capture leaves out for the trusted tree:
// the tests' paths, each tests file and the reward file's directory.
func trustedPaths(req *dsecv1.GradeRequest) []string {
	out := append([]string(nil), req.GetTests().GetPaths()...)
	for p := range req.GetTests().GetFiles() {
		out = append(out, p)
	}
	return append(out, RewardDir)
}

// Rooms is how a grade takes its clean room from a grade pool: a room
// started ahead on the graded sandbox's node, on its layers, into which
// the capture is laid instead of packed into a layer (the apiserver's,
// which keeps the pools; docs/grading.md).
type Rooms interface {
	// Room starts a clean room of spec on node, taking one of the node's
	// grade pool when it holds one ready (Sandbox.from_warm_pool says
	// which).
	Room(ctx context.Context, node string, spec *dsecv1.SandboxSpec) (*dsecv1.Sandbox, error)
	// Lay captures the paths req names of its sandbox and lays them into
	// running sandbox req.lay_into of the same node (SnapshotRequest.lay_into).
	Lay(ctx context.Context, req *dsecv1.SnapshotRequest) (*dsecv1.SnapshotInfo, error)
}

// Layable reports whether a clean room of spec can take a laid capture:
// a container (runc or crun), whose root file system the host sees.
func Layable(spec *dsecv1.SandboxSpec) bool {
	switch spec.GetIsolation() {
	case dsecv1.Isolation_ISOLATION_UNSPECIFIED, dsecv1.Isolation_ISOLATION_CONTAINER:
		return true
	}
	return false
}

// Run grades sandbox req.sandbox_id in a clean room through api. An error
// means the grade did not happen (the capture, the clean room's start or
// a call to it failed): that is the platform's failure, never a reward of
// 0. A grader that fails, times out or is killed is a grade: its reward is
// in the result.
//
// The clean room (unless req.keep) and the capture are deleted before Run
// returns an error; with a result, Run leaves them to done, which the
// caller runs once it has answered (the reply need not wait for the
// deletes), on a context of its own; done returns what it could not
// delete, in words.
//
// With rooms, a clean room that can take it (Layable) comes from rooms on
// the sandbox's node and the capture is laid into it; where the node
// cannot lay it (ErrNotSupported) the grade packs a layer as without.
func Run(ctx context.Context, api API, req *dsecv1.GradeRequest, rooms Rooms) (res *dsecv1.GradeResult, done func(context.Context) []string, err error) {
	start := time.Now()
	if err := Check(req); err != nil {
		return nil, nil, err
	}
	var tidy []func(context.Context) string
	// tidyAll, not done: a return of an error sets done to nil before the
	// deferred cleanup below runs.
	tidyAll := func(ctx context.Context) []string {
		var warnings []string
		for i := len(tidy) - 1; i >= 0; i-- {
			if w := tidy[i](ctx); w != "" {
				warnings = append(warnings, w)
			}
		}
		return warnings
	}
	done = tidyAll
	defer func() {
		if err != nil {
			tidyAll(context.WithoutCancel(ctx))
			res, done = nil, nil
		}
	}()
	res = &dsecv1.GradeResult{Times: &dsecv1.GradeTimes{}, User: req.GetUser()}
	defer func() {
		if res != nil {
			res.Times.TotalMs = time.Since(start).Milliseconds()
		}
	}()
	id := req.GetSandboxId()
	src, err := api.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: id}))
	if err != nil {
		return nil, nil, fmt.Errorf("grade %s: %w", id, err)
	}
	if res.User == "" {
		res.User = DefaultUser
	}

	name := fmt.Sprintf("grade-%s-%d", id, time.Now().UnixNano())
	room := ""
	if rooms != nil && Layable(roomSpec(src.Msg, src.Msg.GetSpec().GetEnvironment(), req)) && req.GetTests().GetLayer() == "" {
		room, err = pooledRoom(ctx, api, rooms, src.Msg, name, req, res, &tidy)
		if errors.Is(err, errdefs.ErrNotSupported) {
			// The node cannot lay it: a layer, as without a pool.
			room, err = "", nil
		}
		if err != nil {
			return nil, nil, fmt.Errorf("grade %s: %w", id, err)
		}
	}
	if room == "" {
		if room, err = layerRoom(ctx, api, src.Msg, name, req, res, &tidy); err != nil {
			return nil, nil, fmt.Errorf("grade %s: %w", id, err)
		}
	}

	t := time.Now()
	if !res.Times.GetLaid() {
		// A pooled room got them with the capture (pooledRoom).
		if err := layTests(ctx, api, room, req.GetTests().GetFiles()); err != nil {
			return nil, nil, fmt.Errorf("grade %s: %w", id, err)
		}
	}
	res.Times.TestsMs = time.Since(t).Milliseconds()

	t = time.Now()
	if err := runGrader(ctx, api, room, req, res); err != nil {
		return nil, nil, fmt.Errorf("grade %s: %w", id, err)
	}
	res.Times.GraderMs = time.Since(t).Milliseconds()
	if after := res.GetExit().GetAfter(); after != nil {
		// The node killed the grader's leftovers and read the reward file
		// in the grader's own call.
		took := time.Duration(after.GetDurationSeconds() * float64(time.Second))
		res.Times.RewardMs = took.Milliseconds()
		res.Times.GraderMs = max(0, res.Times.GraderMs-res.Times.RewardMs)
		res.Reward, res.RewardSource = Reward(res.GetExit(), after.GetFile())
		return res, done, nil
	}
	// A grader the platform ended, or a node that did not do the after
	// steps: two more calls.
	t = time.Now()
	if err := killLeft(ctx, api, room, res.GetUser()); err != nil {
		return nil, nil, fmt.Errorf("grade %s: %w", id, err)
	}
	if err := readReward(ctx, api, room, res); err != nil {
		return nil, nil, fmt.Errorf("grade %s: %w", id, err)
	}
	res.Times.RewardMs = time.Since(t).Milliseconds()
	return res, done, nil
}

// layerRoom captures the paths into layer snap:NAME and starts the clean
// room on the sandbox's layers with it and the tests' layer on top. It
// returns the room's ID, having added the capture's and (unless req.keep)
// the room's deletes to tidy.
func layerRoom(ctx context.Context, api API, src *dsecv1.Sandbox, name string, req *dsecv1.GradeRequest, res *dsecv1.GradeResult, tidy *[]func(context.Context) string) (string, error) {
	t := time.Now()
	// The capture is the sandbox's project's, as a fork's snapshot is: the
	// clean room of that project starts on it.
	snap, err := api.Snapshot(ctx, connect.NewRequest(&dsecv1.SnapshotRequest{
		SandboxId: src.GetId(), Name: name, Include: req.GetPaths(), Trusted: trustedPaths(req),
		Project: src.GetSpec().GetLabels()[projectLabel]}))
	if err != nil {
		return "", fmt.Errorf("capture %s: %w", strings.Join(req.GetPaths(), " "), err)
	}
	res.Capture = snap.Msg
	res.Times.CaptureMs = time.Since(t).Milliseconds()
	*tidy = append(*tidy, func(ctx context.Context) string {
		if _, err := api.DeleteSnapshot(ctx, connect.NewRequest(&dsecv1.DeleteSnapshotRequest{Name: name})); err != nil && connect.CodeOf(err) != connect.CodeNotFound {
			return fmt.Sprintf("delete the capture %s: %v", name, err)
		}
		return ""
	})

	t = time.Now()
	spec := roomSpec(src, snap.Msg.GetEnvironment(), req)
	res.Environment = spec.GetEnvironment()
	created, err := api.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: spec}))
	if err != nil {
		return "", fmt.Errorf("start the clean room on %s: %w", spec.GetEnvironment(), err)
	}
	if len(created.Msg.GetSandboxes()) != 1 {
		return "", fmt.Errorf("the clean room's create returned %d sandboxes", len(created.Msg.GetSandboxes()))
	}
	room := created.Msg.GetSandboxes()[0].GetId()
	res.GraderSandboxId = room
	res.Times.StartMs = time.Since(t).Milliseconds()
	if !req.GetKeep() {
		*tidy = append(*tidy, deleteRoom(api, room))
	}
	return room, nil
}

// pooledRoom takes a clean room on the sandbox's own layers from its
// node's grade pool (or starts one there) and lays the capture into it.
// It returns the room's ID, having added the room's delete (unless
// req.keep) to tidy. ErrNotSupported: the node cannot lay a capture, and
// the room is deleted again.
func pooledRoom(ctx context.Context, api API, rooms Rooms, src *dsecv1.Sandbox, name string, req *dsecv1.GradeRequest, res *dsecv1.GradeResult, tidy *[]func(context.Context) string) (string, error) {
	t := time.Now()
	spec := roomSpec(src, src.GetSpec().GetEnvironment(), req)
	sb, err := rooms.Room(ctx, src.GetNode(), spec)
	if err != nil {
		return "", fmt.Errorf("start the clean room on %s: %w", spec.GetEnvironment(), err)
	}
	room := sb.GetId()
	res.Times.StartMs = time.Since(t).Milliseconds()
	res.Times.Pooled = sb.GetFromWarmPool()
	del := deleteRoom(api, room)

	t = time.Now()
	snap, err := rooms.Lay(ctx, &dsecv1.SnapshotRequest{
		SandboxId: src.GetId(), Name: name, Include: req.GetPaths(), Trusted: trustedPaths(req), LayInto: room,
		LayFiles: testFiles(req.GetTests().GetFiles())})
	if err != nil {
		if errors.Is(err, errdefs.ErrNotSupported) || req.GetKeep() {
			del(context.WithoutCancel(ctx))
		} else {
			*tidy = append(*tidy, del)
		}
		return "", fmt.Errorf("capture %s: %w", strings.Join(req.GetPaths(), " "), err)
	}
	if !req.GetKeep() {
		*tidy = append(*tidy, del)
	}
	res.Capture = snap
	res.Times.CaptureMs = time.Since(t).Milliseconds()
	res.Times.Laid = true
	res.Environment = spec.GetEnvironment()
	res.GraderSandboxId = room
	return room, nil
}

func deleteRoom(api API, room string) func(context.Context) string {
	return func(ctx context.Context) string {
		if _, err := api.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: room})); err != nil && connect.CodeOf(err) != connect.CodeNotFound {
			return fmt.Sprintf("delete the clean room %s: %v", room, err)
		}
		return ""
	}
}

// roomSpec is the clean room's spec: the sandbox's own, on env (its
// layers and the capture) with the tests' layer on top, with no network,
// no privilege escalation and labels of its own.
func roomSpec(src *dsecv1.Sandbox, env string, req *dsecv1.GradeRequest) *dsecv1.SandboxSpec {
	spec := proto.Clone(src.GetSpec()).(*dsecv1.SandboxSpec)
	if l := req.GetTests().GetLayer(); l != "" {
		env += "+" + l
	}
	spec.Environment = env
	spec.NetworkRules = nil
	spec.AllowPrivilegeEscalation = false
	spec.Labels = map[string]string{GradeOfLabel: src.GetId()}
	if p := src.GetSpec().GetLabels()[projectLabel]; p != "" {
		spec.Labels[projectLabel] = p
	}
	// A name of its own, which also keeps a grade pool's shape apart from
	// the warm pools of the sandboxes graded (pools match by shape).
	spec.Hostname = RoomHostname
	// The trainer waits on the reward: the clean room runs at the latency
	// class (docs/qos.md) even when the rollout it grades was best-effort
	// work, which then yields the CPU to it.
	spec.Qos = "latency"
	spec.OnTimeout = dsecv1.OnTimeout_ON_TIMEOUT_UNSPECIFIED
	spec.AutoResume = nil
	spec.Phases = nil            // the sandbox's phases are its own: the clean room's life is the grade's
	spec.IdleTimeoutSeconds = -1 // ttl bounds it
	spec.TtlSeconds = int64((graderTimeout(req) + roomMargin) / time.Second)
	if req.GetCpus() > 0 {
		spec.Cpus = req.GetCpus()
	}
	if req.GetMemoryMb() > 0 {
		spec.MemoryMb = req.GetMemoryMb()
	}
	if req.GetIsolation() != dsecv1.Isolation_ISOLATION_UNSPECIFIED {
		spec.Isolation = req.GetIsolation()
	}
	return spec
}

func graderTimeout(req *dsecv1.GradeRequest) time.Duration {
	if s := req.GetTimeoutSeconds(); s > 0 {
		return time.Duration(s * float64(time.Second))
	}
	return defaultTimeout
}

// layTests writes the tests' files and an empty reward file, writable by
// anyone, as root into the clean room. Their paths were left out of the
// capture with any symlink or file on their way, so each lands where the
// environment's directories put it.
func layTests(ctx context.Context, api API, room string, files map[string][]byte) error {
	type file struct {
		path string
		data []byte
		mode uint32
	}
	all := make([]file, 0, len(files)+1)
	for p, data := range files {
		all = append(all, file{p, data, 0o644})
	}
	all = append(all, file{RewardFile, nil, 0o666})
	// Written at once, a few at a time: each is a call to the room's
	// agent, and a grade waits for the last.
	errs := make([]error, len(all))
	sem := make(chan struct{}, layConcurrency)
	var wg sync.WaitGroup
	for i, f := range all {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			_, err := api.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{
				SandboxId: room, Path: f.path, Data: f.data, Mode: f.mode, MakeParents: true, User: "root"}))
			switch {
			case err != nil && f.path == RewardFile:
				errs[i] = fmt.Errorf("make the reward file: %w", err)
			case err != nil:
				errs[i] = fmt.Errorf("write tests file %s: %w", f.path, err)
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// testFiles are the tests' files and an empty reward file, writable by
// anyone, as a pooled room's node writes them beside the capture (the
// files layTests writes through the room's agent otherwise).
func testFiles(files map[string][]byte) []*dsecv1.LayFile {
	out := make([]*dsecv1.LayFile, 0, len(files)+1)
	for _, p := range slices.Sorted(maps.Keys(files)) {
		out = append(out, &dsecv1.LayFile{Path: path.Clean(p), Data: files[p], Mode: 0o644})
	}
	return append(out, &dsecv1.LayFile{Path: RewardFile, Mode: 0o666})
}

// layConcurrency bounds the tests' files written at once.
const layConcurrency = 8

// runGrader runs the grader in the clean room and keeps its exit and up
// to the request's limit of each stream.
func runGrader(ctx context.Context, api API, room string, req *dsecv1.GradeRequest, res *dsecv1.GradeResult) error {
	env := map[string]string{}
	for k, v := range req.GetEnv() {
		env[k] = v
	}
	env[RewardEnv] = RewardFile
	limit := req.GetOutputLimitBytes()
	if limit == 0 {
		limit = defaultOutputLimit
	}
	// Once the grader exits, its node kills every process its user still
	// runs in the clean room (what the grader or the code it tested left
	// behind, so none writes the reward file after the grader exited),
	// then reads the reward file: in this call, not two more.
	stream, err := api.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{
		SandboxId: room, Argv: req.GetArgv(), Command: req.GetCommand(), Env: env,
		Cwd: req.GetCwd(), User: res.GetUser(), TimeoutSeconds: graderTimeout(req).Seconds(),
		After: &dsecv1.ExecAfter{KillUser: true, ReadFile: RewardFile},
	}))
	if err != nil {
		return fmt.Errorf("run the grader: %w", err)
	}
	defer stream.Close()
	keep := func(buf []byte, b []byte) []byte {
		if room := limit - int64(len(buf)); room > 0 {
			buf = append(buf, b[:min(int64(len(b)), room)]...)
		}
		return buf
	}
	for stream.Receive() {
		switch e := stream.Msg().GetEvent().(type) {
		case *dsecv1.ExecEvent_Stdout:
			res.Stdout = keep(res.Stdout, e.Stdout)
		case *dsecv1.ExecEvent_Stderr:
			res.Stderr = keep(res.Stderr, e.Stderr)
		case *dsecv1.ExecEvent_Exited:
			res.Exit = e.Exited
		}
	}
	if err := stream.Err(); err != nil {
		return fmt.Errorf("run the grader: %w", err)
	}
	if res.Exit == nil {
		return fmt.Errorf("run the grader: its stream ended without an exit")
	}
	if int64(len(res.Stdout)) < res.Exit.GetStdoutBytes() {
		res.Exit.StdoutTruncated = true
	}
	if int64(len(res.Stderr)) < res.Exit.GetStderrBytes() {
		res.Exit.StderrTruncated = true
	}
	return nil
}

// killLeft kills every process the grader's user still runs in the clean
// room (what the grader or the code it tested left behind), so none
// writes the reward file after the grader exited.
func killLeft(ctx context.Context, api API, room, user string) error {
	stream, err := api.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{
		SandboxId: room, Command: "kill -9 -1 2>/dev/null; exit 0", User: user, TimeoutSeconds: 30}))
	if err != nil {
		return fmt.Errorf("kill what the grader left: %w", err)
	}
	defer stream.Close()
	for stream.Receive() {
	}
	if err := stream.Err(); err != nil {
		return fmt.Errorf("kill what the grader left: %w", err)
	}
	return nil
}

// MaxRewardBytes bounds the reward file read back: a number.
const MaxRewardBytes = 4096

// readReward sets the reward from the grader's exit and the reward file
// (Reward); a grader the platform ended (exit.fault) gets the fault
// instead, reward 0, and its reward file is not read.
func readReward(ctx context.Context, api API, room string, res *dsecv1.GradeResult) error {
	if f := res.GetExit().GetFault(); f != dsecv1.Fault_FAULT_UNSPECIFIED {
		res.Fault, res.Reward, res.RewardSource = f, 0, "fault"
		return nil
	}
	rf, err := api.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: room, Path: RewardFile, Limit: MaxRewardBytes, User: "root"}))
	if err != nil {
		return fmt.Errorf("read the reward file: %w", err)
	}
	res.Reward, res.RewardSource = Reward(res.GetExit(), rf.Msg.GetData())
	return nil
}

// Reward is the reward of a grader that exited with exit, its reward file
// holding file: the number in the file when the grader wrote one, else 1
// on exit 0 and 0 otherwise. A reward file that holds no finite number, or
// a grader that did not exit 0 (a timeout, a kill, an OOM), scores 0
// whatever the file says. source says which: "exit", "file" or
// "file-invalid". The edge that ran the grader computes it again before it
// signs the grade's receipt.
func Reward(exit *dsecv1.ExecExited, file []byte) (reward float64, source string) {
	ok := exit.GetStatus() == dsecv1.ExitStatus_EXIT_STATUS_OK
	text := strings.TrimSpace(string(file))
	if text == "" {
		if ok {
			return 1, "exit"
		}
		return 0, "exit"
	}
	v, err := strconv.ParseFloat(text, 64)
	if err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
		return 0, "file-invalid"
	}
	if !ok {
		return 0, "file"
	}
	return v, "file"
}
