package cli

import (
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	dsec "dsec.dev/dsec/sdk/go"
)

// provFlags are a sandbox's provenance paths, for create, run and
// provenance mark.
type provFlags struct {
	workspace, tests, protected []string
}

func (f *provFlags) add(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.StringArrayVar(&f.workspace, "workspace", nil, "a workspace path for provenance: writes elsewhere are flagged (repeatable)")
	fl.StringArrayVar(&f.tests, "tests", nil, "a test path for provenance: changes below it raise tests_modified (repeatable)")
	fl.StringArrayVar(&f.protected, "protected", nil, "a protected path (hidden tests, answers): opens raise protected_read (repeatable)")
}

func (f *provFlags) paths() *dsecv1.ProvenancePaths {
	if len(f.workspace)+len(f.tests)+len(f.protected) == 0 {
		return nil
	}
	return &dsecv1.ProvenancePaths{Workspace: f.workspace, Tests: f.tests, Protected: f.protected}
}

func (a *app) provenanceCommand() *cobra.Command {
	var flagsOnly bool
	cmd := &cobra.Command{
		Use:   "provenance ID",
		Short: "print how a sandbox's state came to be: files written, binaries and tests replaced, protected reads, network, processes, packages, and the flags",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			res, err := a.c.Sandboxes.Provenance(cmd.Context(), connect.NewRequest(&dsecv1.ProvenanceRequest{SandboxId: args[0], FlagsOnly: flagsOnly}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(res.Msg)
			}
			return a.printProvenance(res.Msg)
		},
	}
	cmd.Flags().BoolVar(&flagsOnly, "flags-only", false, "leave out the list of files written")
	cmd.AddCommand(a.provenanceMarkCommand())
	return cmd
}

func (a *app) provenanceMarkCommand() *cobra.Command {
	var pf provFlags
	cmd := &cobra.Command{
		Use:   "mark ID",
		Short: "replace a sandbox's provenance paths (--workspace, --tests, --protected); protected paths are watched from then on",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			paths := pf.paths()
			if paths == nil {
				paths = &dsecv1.ProvenancePaths{}
			}
			res, err := a.c.Sandboxes.SetProvenancePaths(cmd.Context(), connect.NewRequest(&dsecv1.SetProvenancePathsRequest{SandboxId: args[0], Paths: paths}))
			if err != nil {
				return err
			}
			for _, u := range res.Msg.GetUnwatched() {
				fmt.Fprintf(a.stderr, "not watched: %s\n", u)
			}
			if a.json {
				return a.printProto(res.Msg)
			}
			return nil
		},
	}
	pf.add(cmd)
	return cmd
}

func (a *app) printProvenance(p *dsecv1.SandboxProvenance) error {
	flags := dsec.ProvenanceFlagNames(p.GetFlags())
	if len(flags) == 0 {
		flags = []string{"none"}
	}
	fmt.Fprintf(a.stdout, "sandbox %s (%s) at %s\nflags: %s\n", p.GetSandboxId(), p.GetIsolation(),
		time.UnixMilli(p.GetTakenUnixMs()).UTC().Format(time.RFC3339), strings.Join(flags, " "))
	for _, u := range p.GetUnseen() {
		fmt.Fprintf(a.stdout, "unseen: %s\n", u)
	}
	tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
	files := func(title string, fs []*dsecv1.ProvenanceFile, total int64) {
		if len(fs) == 0 {
			return
		}
		fmt.Fprintf(tw, "\n%s (%d)\n", title, max(total, int64(len(fs))))
		for _, f := range fs {
			where := ""
			if f.GetInWorkspace() {
				where = "workspace"
			}
			fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\n", f.GetChange(), f.GetKind(), f.GetSize(), f.GetPath(), where)
		}
	}
	files("REPLACED", p.GetReplaced(), 0)
	files("TESTS CHANGED", p.GetTestsChanged(), 0)
	if rs := p.GetProtectedReads(); len(rs) > 0 {
		fmt.Fprintf(tw, "\nPROTECTED READS (%d)\n", len(rs))
		for _, r := range rs {
			fmt.Fprintf(tw, "%s\t%d\t%s\t%d\t%s\n", r.GetPath(), r.GetPid(), r.GetCommand(), r.GetCount(),
				time.UnixMilli(r.GetTimeUnixMs()).UTC().Format("15:04:05.000"))
		}
	}
	if ns := p.GetNetwork(); len(ns) > 0 {
		fmt.Fprintf(tw, "\nNETWORK (%d)\n", len(ns))
		for _, n := range ns {
			fmt.Fprintf(tw, "%s\t%s\t%s:%d\t%s\t%d\n", n.GetVerdict(), n.GetKind(), n.GetHost(), n.GetPort(), n.GetService(), n.GetCount())
		}
	}
	if ps := p.GetProcesses(); len(ps) > 0 {
		fmt.Fprintf(tw, "\nPROCESSES (%d)\n", len(ps))
		for _, pr := range ps {
			fmt.Fprintf(tw, "%d\t%s\n", pr.GetPid(), pr.GetCommand())
		}
	}
	if pk := p.GetPackages(); len(pk) > 0 {
		fmt.Fprintf(tw, "\nPACKAGES (%d)\n", len(pk))
		for _, k := range pk {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", k.GetManager(), k.GetChange(), k.GetName(), k.GetVersion())
		}
	}
	if sc := p.GetSyscallsDenied(); len(sc) > 0 {
		var total int64
		for _, c := range sc {
			total += c.GetCount()
		}
		fmt.Fprintf(tw, "\nSYSCALLS DENIED (%d calls", total)
		if lost := p.GetSyscallRecordsLost(); lost > 0 {
			fmt.Fprintf(tw, ", at least: %d audit records lost", lost)
		}
		fmt.Fprintln(tw, ")")
		for _, c := range sc {
			fmt.Fprintf(tw, "%s\t%d\tfirst by %d\t%s\t%s\n", c.GetName(), c.GetCount(), c.GetPid(), c.GetCommand(),
				time.UnixMilli(c.GetTimeUnixMs()).UTC().Format("15:04:05.000"))
		}
	} else if lost := p.GetSyscallRecordsLost(); lost > 0 {
		fmt.Fprintf(tw, "\nSYSCALLS DENIED: none seen, %d audit records lost\n", lost)
	}
	files("FILES WRITTEN", p.GetFilesWritten(), p.GetFilesWrittenTotal())
	return tw.Flush()
}
