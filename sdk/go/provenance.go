package dsec

import (
	"context"
	"fmt"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// ProvenancePaths are the paths a sandbox's provenance judges it by,
// absolute paths in the sandbox, each a file or a directory.
type ProvenancePaths struct {
	// Workspace: where the task's work goes; a write elsewhere raises
	// files_outside_workspace.
	Workspace []string
	// Tests: the task's tests; a change below one raises tests_modified.
	Tests []string
	// Protected: hidden tests, answer files; an open by a process of the
	// sandbox raises protected_read.
	Protected []string
}

func (p *ProvenancePaths) proto() *dsecv1.ProvenancePaths {
	if p == nil {
		return nil
	}
	return &dsecv1.ProvenancePaths{Workspace: p.Workspace, Tests: p.Tests, Protected: p.Protected}
}

// Provenance says how the sandbox's state came to be: files written
// outside its workspace, binaries and tests replaced, protected reads,
// network attempts, processes still running, packages installed, and the
// flags summarising them (ProvenanceFlagNames lists those set); Unseen
// says what its backend cannot see (docs/provenance.md). With flagsOnly
// the list of files written is left out. It may be sent again.
func (s *Sandbox) Provenance(ctx context.Context, flagsOnly bool) (*dsecv1.SandboxProvenance, error) {
	var out *dsecv1.SandboxProvenance
	err := s.c.unary(ctx, true, func(ctx context.Context) error {
		r, err := s.c.sb.Provenance(ctx, connect.NewRequest(&dsecv1.ProvenanceRequest{SandboxId: s.ID, FlagsOnly: flagsOnly}))
		if err == nil {
			out = r.Msg
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("provenance of %s: %w", s.ID, err)
	}
	return out, nil
}

// SetProvenancePaths replaces the provenance paths the sandbox was made
// with (CreateOptions.Provenance); its protected paths are watched from
// now on. It returns the protected paths that cannot be watched, with why.
func (s *Sandbox) SetProvenancePaths(ctx context.Context, paths ProvenancePaths) ([]string, error) {
	var unwatched []string
	err := s.c.unary(ctx, true, func(ctx context.Context) error {
		r, err := s.c.sb.SetProvenancePaths(ctx, connect.NewRequest(&dsecv1.SetProvenancePathsRequest{SandboxId: s.ID, Paths: paths.proto()}))
		if err == nil {
			unwatched = r.Msg.GetUnwatched()
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("set provenance paths of %s: %w", s.ID, err)
	}
	return unwatched, nil
}

// ProvenanceFlagNames lists the flags set, by their API names
// (tests_modified, interpreter_replaced, protected_read, ...).
func ProvenanceFlagNames(f *dsecv1.ProvenanceFlags) []string {
	var out []string
	for _, x := range []struct {
		on   bool
		name string
	}{
		{f.GetFilesOutsideWorkspace(), "files_outside_workspace"},
		{f.GetTestsModified(), "tests_modified"},
		{f.GetInterpreterReplaced(), "interpreter_replaced"},
		{f.GetProtectedRead(), "protected_read"},
		{f.GetNetworkAllowed(), "network_allowed"},
		{f.GetNetworkDenied(), "network_denied"},
		{f.GetLeftoverProcesses(), "leftover_processes"},
		{f.GetPackagesInstalled(), "packages_installed"},
		{f.GetSyscallsDenied(), "syscalls_denied"},
	} {
		if x.on {
			out = append(out, x.name)
		}
	}
	return out
}
