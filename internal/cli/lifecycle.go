package cli

import (
	"context"
	"fmt"
	"sync"
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
is dropped, and anonymous memory goes to swap where the node has it (dsecd
--swap). A paused sandbox survives a restart of its node's dsecd; any call
that runs in it (exec, files, shell, network rules) resumes it first, unless
it was made with auto_resume false. With --label, every running sandbox with
those labels is paused: a preempted trainer pauses its whole job this way.`,
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
