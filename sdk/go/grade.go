package dsec

import (
	"context"
	"fmt"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// GradeOptions say what a clean-room grade captures, lays on top and runs;
// see Client.Grade and docs/grading.md.
type GradeOptions struct {
	// Paths are the workspace: the only paths of the sandbox the grade
	// sees as the sandbox left them. At least one.
	Paths []string
	// TestsLayer is a layer (name:tag or digest) laid above the
	// workspace; TestsFiles are files (absolute path -> content) written
	// by root into the clean room before the grader starts. TestsPaths
	// are the paths the trusted tree owns (the tests' directory): the
	// workspace's version of each is left out whole. Each of TestsFiles'
	// paths is added; a TestsLayer's paths must be named here.
	TestsLayer string
	TestsFiles map[string][]byte
	TestsPaths []string
	// The grader: Argv runs directly, Command under `sh -c`; one of them.
	Argv    []string
	Command string
	// User runs the grader; "" = 65534:65534 (nobody).
	User string
	Cwd  string
	Env  map[string]string
	// Timeout is the grader's; 0 = 10 minutes. OutputLimit bounds each
	// stream returned; 0 = 1 MiB.
	Timeout     time.Duration
	OutputLimit int64
	// CPUs and MemoryMB size the clean room; 0 = the sandbox's own.
	CPUs     float64
	MemoryMB int64
	// Isolation is the clean room's (IsolationContainer, IsolationGVisor,
	// IsolationMicroVM); "" = the sandbox's own.
	Isolation string
	// Keep leaves the clean room running for a look; it is the caller's to
	// delete (GradeResult.GraderSandboxId).
	Keep bool
}

func (o GradeOptions) request(id string) (*dsecv1.GradeRequest, error) {
	iso, err := isolation(o.Isolation)
	if err != nil {
		return nil, err
	}
	return &dsecv1.GradeRequest{Isolation: iso,
		SandboxId: id, Paths: o.Paths,
		Tests: &dsecv1.GradeTests{Layer: o.TestsLayer, Files: o.TestsFiles, Paths: o.TestsPaths},
		Argv:  o.Argv, Command: o.Command, User: o.User, Cwd: o.Cwd, Env: o.Env,
		TimeoutSeconds: o.Timeout.Seconds(), OutputLimitBytes: o.OutputLimit,
		Cpus: o.CPUs, MemoryMb: o.MemoryMB, Keep: o.Keep,
	}, nil
}

// Grade grades sandbox id in a clean room: it captures only opts.Paths,
// starts a fresh sandbox from the sandbox's layers, that capture and the
// trusted tests on top, with no network and none of the sandbox's
// processes, runs the grader there as another user and returns the
// reward (the number the grader wrote to $DSEC_REWARD_FILE, else 1 on
// exit 0 and 0 otherwise) with the grader's output, exit and times. An
// error means no grade happened (the platform failed): mask the rollout,
// do not score it 0. The sandbox runs on; a grade is not sent again on a
// broken connection.
func (c *Client) Grade(ctx context.Context, id string, opts GradeOptions) (*dsecv1.GradeResult, error) {
	req, err := opts.request(id)
	if err != nil {
		return nil, fmt.Errorf("grade sandbox %s: %w", id, err)
	}
	resp, err := c.sb.Grade(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, fmt.Errorf("grade sandbox %s: %w", id, fromConnect(err, false))
	}
	return resp.Msg, nil
}

// Grade grades this sandbox in a clean room; see Client.Grade.
func (s *Sandbox) Grade(ctx context.Context, opts GradeOptions) (*dsecv1.GradeResult, error) {
	return s.c.Grade(ctx, s.ID, opts)
}

// isolation is the clean room's isolation: unspecified ("") keeps the
// sandbox's own.
func isolation(s string) (dsecv1.Isolation, error) {
	switch s {
	case "":
		return dsecv1.Isolation_ISOLATION_UNSPECIFIED, nil
	case IsolationContainer:
		return dsecv1.Isolation_ISOLATION_CONTAINER, nil
	case IsolationGVisor:
		return dsecv1.Isolation_ISOLATION_GVISOR, nil
	case IsolationMicroVM:
		return dsecv1.Isolation_ISOLATION_MICROVM, nil
	}
	return 0, invalid("isolation %q is not known (container, gvisor, microvm)", s)
}
