package sandbox

import (
	"context"
	"errors"
	"fmt"
	"strings"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/errdefs"
)

// The lifecycle of a sandbox, one state machine:
//
//	creating → running ⇄ pausing → paused ⇄ resuming → running
//	   any live state → stopping → stopped | failed(reason)
//
// The table below is the one place that says which call is legal in which
// state. Transitions (pause, resume, snapshot, stop) of one sandbox run one
// at a time under its op lock; the intermediate states (pausing, resuming,
// stopping) are what other callers see meanwhile.

// Live says whether a sandbox in state st is live: creating, running,
// pausing, paused or resuming (not stopping or ended).
func Live(st dsecv1.State) bool {
	switch st {
	case dsecv1.State_STATE_CREATING, dsecv1.State_STATE_RUNNING,
		dsecv1.State_STATE_PAUSING, dsecv1.State_STATE_PAUSED, dsecv1.State_STATE_RESUMING:
		return true
	}
	return false
}

// call is what a caller asks of a sandbox, as the table sees it.
type call int

const (
	// callUse runs in the sandbox: exec, files, shell, network rules,
	// snapshot.
	callUse call = iota
	callPause
	callResume
	callDelete
	numCalls
)

var callNames = [numCalls]string{"use", "pause", "resume", "delete"}

func (c call) String() string { return callNames[c] }

// verdict is the table's answer to a call in a state.
type verdict int

const (
	allow       verdict = iota // go ahead
	noop                       // it is so already: nothing to do, and say so
	resumeFirst                // paused: resume it, then go ahead (unless auto_resume is false)
	waitFor                    // a transition is under way: wait for it to end, then ask again
	refuseNew                  // still being created: FailedPrecondition
	refuseGone                 // stopping or ended: FailedPrecondition naming why
)

var verdictNames = map[verdict]string{allow: "allow", noop: "noop", resumeFirst: "resume first",
	waitFor: "wait", refuseNew: "refuse (creating)", refuseGone: "refuse (gone)"}

func (v verdict) String() string { return verdictNames[v] }

// transitions is the table: per state, the verdict on each call.
var transitions = map[dsecv1.State][numCalls]verdict{
	//                           use          pause        resume       delete
	dsecv1.State_STATE_CREATING: {refuseNew, refuseNew, refuseNew, allow},
	dsecv1.State_STATE_RUNNING:  {allow, allow, noop, allow},
	dsecv1.State_STATE_PAUSING:  {waitFor, waitFor, waitFor, waitFor},
	dsecv1.State_STATE_PAUSED:   {resumeFirst, noop, allow, allow},
	dsecv1.State_STATE_RESUMING: {waitFor, waitFor, waitFor, waitFor},
	dsecv1.State_STATE_STOPPING: {refuseGone, refuseGone, refuseGone, noop},
	dsecv1.State_STATE_STOPPED:  {refuseGone, refuseGone, refuseGone, noop},
	dsecv1.State_STATE_FAILED:   {refuseGone, refuseGone, refuseGone, noop},
}

// decide looks a call up in the table.
func decide(st dsecv1.State, c call) verdict {
	row, ok := transitions[st]
	if !ok {
		return refuseGone
	}
	return row[c]
}

// refusal is the error of a refusing verdict on rec.
func refusal(rec *dsecv1.Sandbox, v verdict, c call) error {
	switch v {
	case refuseNew:
		return fmt.Errorf("sandbox %s is still being created: %w", rec.GetId(), errdefs.ErrFailedPrecondition)
	case refuseGone:
		return GoneError(rec)
	}
	return fmt.Errorf("sandbox %s: %s while %s: %w", rec.GetId(), c, stateWord(rec.GetState()), errdefs.ErrInternal)
}

// teardown is what a sandbox holds, as it acquired it: each step releases
// one resource. It runs the steps last first and stops at the first that
// fails, keeping it and the ones before (a layer is not released from under
// a container that could not be removed), so running it again picks up
// there. Every step may run at any point, whether or not its resource was
// ever fully made, and more than once.
type teardown struct {
	steps []teardownStep
}

type teardownStep struct {
	name    string
	release func(ctx context.Context) error
}

// add registers a resource about to be acquired (so that a half-made one is
// released too).
func (t *teardown) add(name string, release func(ctx context.Context) error) {
	t.steps = append(t.steps, teardownStep{name, release})
}

// run releases everything, last acquired first, and returns the step that
// failed. ctx's cancellation does not stop it.
func (t *teardown) run(ctx context.Context) error {
	ctx = context.WithoutCancel(ctx)
	for len(t.steps) > 0 {
		s := t.steps[len(t.steps)-1]
		if err := s.release(ctx); err != nil {
			return fmt.Errorf("release its %s: %w", s.name, err)
		}
		t.steps = t.steps[:len(t.steps)-1]
	}
	return nil
}

// resource is one thing a sandbox holds. The constants are in the order a
// create acquires them, so a teardown releases them last first.
type resource int

const (
	resRecord    resource = iota // its record and create token on disk
	resLayers                    // the layers mounted for it
	resNetwork                   // its network namespace, veth and rules
	resContainer                 // what its backend's runtime holds
	numResources
)

var resourceNames = [numResources]string{"record", "layers", "network", "container"}

// hold registers resource r of sandbox id in t, as a create acquires it (or
// is about to): the one definition of how each resource is released, for
// a create's teardown and for teardownOf's alike. rt is the runtime that
// holds the sandbox.
func (m *Manager) hold(t *teardown, r resource, id string, rt backend.Runtime) {
	var release func(ctx context.Context) error
	switch r {
	case resRecord:
		release = func(ctx context.Context) error { return m.states.Remove(id) }
	case resLayers:
		release = func(ctx context.Context) error { m.images.Release(ctx, id); return nil }
	case resNetwork:
		release = func(ctx context.Context) error { return m.detach(ctx, id) }
	case resContainer:
		release = func(ctx context.Context) error { return rt.Delete(ctx, id) }
	default:
		panic(fmt.Sprintf("sandbox resource %d", r))
	}
	t.add(resourceNames[r], release)
}

// teardownOf is the full teardown of sandbox id, every resource a sandbox
// can hold, for one whose create this process did not see (re-adopted,
// orphaned, or emptied by Teardown). rt is the runtime that holds it; nil
// when none does (its record names a backend the node lacks, and no
// runtime lists it).
func (m *Manager) teardownOf(id string, rt backend.Runtime) teardown {
	var t teardown
	for r := range numResources {
		if (r == resNetwork && m.net == nil) || (r == resContainer && rt == nil) {
			continue
		}
		m.hold(&t, r, id, rt)
	}
	return t
}

// detach removes a sandbox's network; one it never had is not an error.
func (m *Manager) detach(ctx context.Context, id string) error {
	if err := m.net.Detach(ctx, id); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return err
	}
	return nil
}

// stateWord is a state as a word: "paused".
func stateWord(st dsecv1.State) string {
	return strings.ToLower(strings.TrimPrefix(st.String(), "STATE_"))
}
