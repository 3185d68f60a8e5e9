package cli

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// lifecycleConcurrency bounds the calls a pause or resume of many
// sandboxes makes at once.
const lifecycleConcurrency = 32

func (a *app) pauseCommand() *cobra.Command {
	var labels []string
	var keepMemory bool
	cmd := &cobra.Command{
		Use:   "pause ID... | pause --label K=V",
		Short: "freeze sandboxes and release their memory (any call resumes them)",
		Long: `Pause freezes each sandbox and pushes its memory out of RAM: the page cache
is dropped, and anonymous and shared memory (files in /dev/shm and other
tmpfs) go to swap where the node has it (dsecd --swap). Each line says what
was released and what was kept in RAM, and why where the node can tell. A
paused sandbox survives a restart of its node's dsecd; any call that runs in
it (exec, files, shell, network rules) resumes it first, unless it was made
with auto_resume false. With --label, every running sandbox with those
labels is paused: a preempted trainer pauses its whole job this way.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			ids, err := a.selectIDs(cmd.Context(), args, labels, []dsecv1.State{dsecv1.State_STATE_RUNNING})
			if err != nil {
				return err
			}
			return a.each(cmd.Context(), "pause", ids, func(ctx context.Context, id string) (proto.Message, string, error) {
				resp, err := a.c.Sandboxes.Pause(ctx, connect.NewRequest(&dsecv1.PauseRequest{SandboxId: id, KeepMemory: keepMemory}))
				if err != nil {
					return nil, "", err
				}
				if resp.Msg.GetAlreadyPaused() {
					return resp.Msg, id + " paused already", nil
				}
				st := resp.Msg.GetSandbox().GetLastPause()
				line := fmt.Sprintf("%s paused in %s: released %s of %s", id,
					(time.Duration(st.GetFrozenUs())*time.Microsecond + time.Duration(st.GetReclaimMs())*time.Millisecond).Round(time.Millisecond),
					humanBytes(st.GetReleasedBytes()), humanBytes(st.GetResidentBytes()))
				if st.GetSwappedBytes() > 0 {
					line += fmt.Sprintf(" (%s to swap)", humanBytes(st.GetSwappedBytes()))
				}
				if !keepMemory {
					line += fmt.Sprintf(", kept %s in RAM", humanBytes(st.GetKeptBytes()))
				}
				if r := st.GetKeptReason(); r != "" {
					line += ": " + r
				}
				return resp.Msg, line, nil
			})
		},
	}
	cmd.Flags().StringArrayVar(&labels, "label", nil, "pause every running sandbox with label K=V (repeatable)")
	cmd.Flags().BoolVar(&keepMemory, "keep-memory", false, "freeze only, leaving memory in RAM (for a short pause)")
	return cmd
}

func (a *app) resumeCommand() *cobra.Command {
	var labels []string
	cmd := &cobra.Command{
		Use:   "resume ID... | resume --label K=V",
		Short: "bring paused sandboxes' memory back and let them run",
		RunE: func(cmd *cobra.Command, args []string) error {
			ids, err := a.selectIDs(cmd.Context(), args, labels, []dsecv1.State{dsecv1.State_STATE_PAUSED})
			if err != nil {
				return err
			}
			return a.each(cmd.Context(), "resume", ids, func(ctx context.Context, id string) (proto.Message, string, error) {
				resp, err := a.c.Sandboxes.Resume(ctx, connect.NewRequest(&dsecv1.ResumeRequest{SandboxId: id}))
				if err != nil {
					return nil, "", err
				}
				if resp.Msg.GetAlreadyRunning() {
					return resp.Msg, id + " running already", nil
				}
				return resp.Msg, fmt.Sprintf("%s resumed (memory prefetched in %d ms)", id, resp.Msg.GetPrefetchMs()), nil
			})
		},
	}
	cmd.Flags().StringArrayVar(&labels, "label", nil, "resume every paused sandbox with label K=V (repeatable)")
	return cmd
}

// each runs call on every sandbox, a bounded number at once, and prints
// each outcome in the order of ids: its line (its message with --json), or
// the error on stderr. It fails when any call did.
func (a *app) each(ctx context.Context, verb string, ids []string, call func(ctx context.Context, id string) (proto.Message, string, error)) error {
	type outcome struct {
		msg  proto.Message
		line string
		err  error
	}
	out := make([]outcome, len(ids))
	sem := make(chan struct{}, lifecycleConcurrency)
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			m, line, err := call(ctx, id)
			out[i] = outcome{m, line, err}
		}()
	}
	wg.Wait()
	failed := 0
	for i, o := range out {
		switch {
		case o.err != nil:
			fmt.Fprintf(a.stderr, "dsec: %s %s: %s\n", verb, ids[i], describe(o.err))
			failed++
		case a.json:
			if err := a.printProto(o.msg); err != nil {
				return err
			}
		default:
			fmt.Fprintln(a.stdout, o.line)
		}
	}
	if failed > 0 {
		return &exitCode{code: 1}
	}
	return nil
}

func (a *app) snapshotCommand() *cobra.Command {
	var exclude []string
	var project string
	cmd := &cobra.Command{
		Use:   "snapshot [--exclude PATH]... [--project P] ID NAME | snapshot ls | snapshot rm NAME... | snapshot share|unshare NAME --with P",
		Short: "pack a sandbox's file system into a layer, snap:NAME, that new sandboxes start from",
		Long: `Snapshot freezes the sandbox while its writable layer is captured (a paused
one is resumed first), thaws it, and packs the capture into a layer, snap:NAME,
in the blob store. It prints the environment that restores it,
BASE[+LAYER...]+snap:NAME, for dsec create or run, on any node that shares the
blob store. --exclude leaves out the sandbox's changes under a path (build
residue, reference answers, caches). No processes or memory are kept.
The snapshot belongs to --project (default the token's; builder there), which
is charged its bytes; "snapshot share NAME --with P" lets project P use it.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := a.c.Sandboxes.Snapshot(cmd.Context(), connect.NewRequest(&dsecv1.SnapshotRequest{SandboxId: args[0], Name: args[1], Exclude: exclude, Project: project}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(resp.Msg)
			}
			for _, w := range resp.Msg.GetWarnings() {
				fmt.Fprintln(a.stderr, "dsec: warning:", w)
			}
			fmt.Fprintln(a.stdout, resp.Msg.GetEnvironment())
			return nil
		},
	}
	cmd.Flags().StringArrayVar(&exclude, "exclude", nil, "leave out the sandbox's changes under PATH (repeatable)")
	cmd.Flags().StringVarP(&project, "project", "p", "", "the project the snapshot belongs to (builder there; default the token's), charged its bytes")
	share, unshare := a.shareCommands("snapshot", "NAME", "snap:")
	cmd.AddCommand(share, unshare)
	cmd.AddCommand(&cobra.Command{
		Use:   "ls",
		Short: "list snapshots",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := a.c.Sandboxes.ListSnapshots(cmd.Context(), connect.NewRequest(&dsecv1.ListSnapshotsRequest{}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(resp.Msg)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tSIZE\tFROM\tFROZEN\tCREATED\tENVIRONMENT\tPROJECT\tSHARED WITH")
			for _, s := range resp.Msg.GetSnapshots() {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", s.GetName(), humanBytes(s.GetSize()), s.GetSourceSandbox(),
					(time.Duration(s.GetFrozenUs()) * time.Microsecond).Round(time.Millisecond),
					time.UnixMilli(s.GetCreatedUnixMs()).Format(time.DateTime), s.GetEnvironment(),
					displayProject(s.GetProject()), strings.Join(s.GetSharedWith(), ","))
			}
			return tw.Flush()
		},
	}, &cobra.Command{
		Use:   "rm NAME...",
		Short: "remove snapshots (sandboxes running on one keep it until they go)",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.each(cmd.Context(), "remove snapshot", args, func(ctx context.Context, name string) (proto.Message, string, error) {
				resp, err := a.c.Sandboxes.DeleteSnapshot(ctx, connect.NewRequest(&dsecv1.DeleteSnapshotRequest{Name: name}))
				if err != nil {
					return nil, "", err
				}
				return resp.Msg, name, nil
			})
		},
	})
	return cmd
}

func (a *app) forkCommand() *cobra.Command {
	var exclude []string
	var n int
	var name, key string
	cmd := &cobra.Command{
		Use:   "fork [-n N] [--exclude PATH]... [--name NAME] [--idempotency-key KEY] ID",
		Short: "snapshot a sandbox once and start N new sandboxes from it (fresh processes on its file system; a microVM's children copy its memory)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := a.c.Sandboxes.Fork(cmd.Context(), connect.NewRequest(&dsecv1.ForkRequest{SandboxId: args[0], Count: int32(n), Exclude: exclude, Name: name, IdempotencyKey: key}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(resp.Msg)
			}
			failed := 0
			for i, c := range resp.Msg.GetChildren() {
				if c.GetError() != "" {
					fmt.Fprintf(a.stderr, "dsec: fork child %d: %s\n", i, c.GetError())
					failed++
					continue
				}
				fmt.Fprintln(a.stdout, c.GetSandbox().GetId())
			}
			if failed > 0 {
				return &exitCode{code: 1}
			}
			return nil
		},
	}
	cmd.Flags().IntVarP(&n, "count", "n", 1, "children (at most 16)")
	cmd.Flags().StringArrayVar(&exclude, "exclude", nil, "leave out the source's changes under PATH (repeatable)")
	cmd.Flags().StringVar(&name, "name", "", "the snapshot's name (default fork-ID-TIME)")
	cmd.Flags().StringVar(&key, "idempotency-key", "", "a microVM's fork: a repeat with the same key gets the children the first made, and makes no more")
	return cmd
}
