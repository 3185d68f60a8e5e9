package sandbox

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/eventlog"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// The lifecycle of a sandbox, one state machine:
//
//	creating → running ⇄ pausing → paused ⇄ resuming → running
//	   any live state → stopping → stopped | failed(reason)
//
// A sandbox in a warm pool lives the same life with the pooled mark: it is
// created pooled, runs pooled until a create claims it (the one change of
// the mark: pooled running → running), or is stopped pooled when its pool
// lets it go. Stopped and failed sandboxes are tombstones, ended states
// the table answers for like any other. A phase is a state and the mark.
//
// The table below is the one place that says which call is legal in which
// phase, and next the one list of the phase changes there are; transition
// is the one function that changes a sandbox's phase. Transitions (create,
// pause, resume, snapshot, claim, stop) of one sandbox run one at a time
// under its op lock; the intermediate states (pausing, resuming, stopping)
// are what other callers see meanwhile.

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

// ended says whether state st is an ended one, a tombstone's: stopped or
// failed.
func ended(st dsecv1.State) bool {
	return st == dsecv1.State_STATE_STOPPED || st == dsecv1.State_STATE_FAILED
}

// phase is where a sandbox is in its life, as the table sees it: its
// record's state, and whether it waits in a warm pool (nobody's sandbox
// yet: Get, List and every caller's call miss it).
type phase struct {
	state  dsecv1.State
	pooled bool
}

func (p phase) String() string {
	if p.pooled {
		return "pooled " + stateWord(p.state)
	}
	return stateWord(p.state)
}

// call is what a caller, or the edge itself, asks of a sandbox, as the
// table sees it.
type call int

const (
	// callUse runs in the sandbox: exec, files, shell, network rules,
	// snapshot.
	callUse call = iota
	callPause
	callResume
	// callDelete stops the sandbox: a caller's delete, or the edge's stop
	// (TTL, idle, a dead agent, paused too long).
	callDelete
	// callClaim takes a pooled sandbox out of its warm pool for a create.
	callClaim
	// callDrop stops a pooled sandbox its pool lets go of; one claimed
	// meanwhile is the caller's and stays.
	callDrop
	numCalls
)

var callNames = [numCalls]string{"use", "pause", "resume", "delete", "claim", "drop"}

func (c call) String() string { return callNames[c] }

// verdict is the table's answer to a call in a phase.
type verdict int

const (
	allow       verdict = iota // go ahead
	noop                       // it is so already: nothing to do, and say so
	resumeFirst                // paused: resume it, then go ahead (unless auto_resume is false)
	waitFor                    // a transition is under way: wait for it to end, then ask again
	refuseNew                  // still being created: FailedPrecondition
	refuseGone                 // stopping or ended: FailedPrecondition naming why
	hidden                     // waiting in a warm pool, nobody's yet: NotFound
	illegal                    // the edge never makes this call here: Internal
)

var verdictNames = map[verdict]string{allow: "allow", noop: "noop", resumeFirst: "resume first",
	waitFor: "wait", refuseNew: "refuse (creating)", refuseGone: "refuse (gone)", hidden: "hidden (pooled)",
	illegal: "illegal"}

func (v verdict) String() string { return verdictNames[v] }

var (
	creating = phase{state: dsecv1.State_STATE_CREATING}
	running  = phase{state: dsecv1.State_STATE_RUNNING}
	pausing  = phase{state: dsecv1.State_STATE_PAUSING}
	paused   = phase{state: dsecv1.State_STATE_PAUSED}
	resuming = phase{state: dsecv1.State_STATE_RESUMING}
	stopping = phase{state: dsecv1.State_STATE_STOPPING}
	stopped  = phase{state: dsecv1.State_STATE_STOPPED}
	failed   = phase{state: dsecv1.State_STATE_FAILED}

	poolCreating = phase{dsecv1.State_STATE_CREATING, true}
	poolRunning  = phase{dsecv1.State_STATE_RUNNING, true}
	poolStopping = phase{dsecv1.State_STATE_STOPPING, true}
	poolStopped  = phase{dsecv1.State_STATE_STOPPED, true}
	poolFailed   = phase{dsecv1.State_STATE_FAILED, true}
)

// transitions is the table: per phase, the verdict on each call.
var transitions = map[phase][numCalls]verdict{
	//            use          pause        resume       delete   claim       drop
	creating: {refuseNew, refuseNew, refuseNew, allow, waitFor, waitFor},
	running:  {allow, allow, noop, allow, illegal, noop},
	pausing:  {waitFor, waitFor, waitFor, waitFor, waitFor, waitFor},
	paused:   {resumeFirst, noop, allow, allow, illegal, noop},
	resuming: {waitFor, waitFor, waitFor, waitFor, waitFor, waitFor},
	stopping: {refuseGone, refuseGone, refuseGone, noop, illegal, noop},
	stopped:  {refuseGone, refuseGone, refuseGone, noop, illegal, noop},
	failed:   {refuseGone, refuseGone, refuseGone, noop, illegal, noop},

	poolCreating: {hidden, hidden, hidden, allow, waitFor, allow},
	poolRunning:  {hidden, hidden, hidden, allow, allow, allow},
	poolStopping: {hidden, hidden, hidden, noop, refuseGone, noop},
	poolStopped:  {hidden, hidden, hidden, noop, refuseGone, noop},
	poolFailed:   {hidden, hidden, hidden, noop, refuseGone, noop},
}

// next is every change of phase there is: the transitions the table's
// allowed calls make, the ends of those under way, and what Recover finds
// (a pause or resume cut short by a restart ends in whichever state the
// sandbox is in: running found frozen is paused, paused found thawed is
// running).
var next = map[phase][]phase{
	creating:     {running, stopping},
	running:      {pausing, paused, stopping},
	pausing:      {paused, running, stopping},
	paused:       {resuming, running, stopping},
	resuming:     {running, paused, stopping},
	stopping:     {stopped, failed},
	poolCreating: {poolRunning, poolStopping},
	poolRunning:  {running, poolStopping},
	poolStopping: {poolStopped, poolFailed},
}

// decide looks a call up in the table.
func decide(p phase, c call) verdict {
	row, ok := transitions[p]
	if !ok {
		return illegal
	}
	return row[c]
}

// phaseOf is the sandbox's phase; sb.mu or the Manager's mu is held.
func (sb *sandbox) phaseOf() phase {
	return phase{state: sb.rec.GetState(), pooled: sb.pool != ""}
}

// refusal is the error of a refusing verdict on rec in phase p.
func refusal(rec *dsecv1.Sandbox, v verdict, c call) error {
	switch v {
	case refuseNew:
		return fmt.Errorf("sandbox %s is still being created: %w", rec.GetId(), errdefs.ErrFailedPrecondition)
	case refuseGone:
		return GoneError(rec)
	case hidden:
		return fmt.Errorf("no sandbox %s: %w", rec.GetId(), errdefs.ErrNotFound)
	}
	return fmt.Errorf("sandbox %s: %s while %s: %w", rec.GetId(), c, stateWord(rec.GetState()), errdefs.ErrInternal)
}

// transition moves sandbox sb to phase to, the one place a sandbox's phase
// changes: it refuses a change that next does not list (Internal: the
// edge's own bug), saves the record (not an ended one's: the teardown
// removed it, and a tombstone lives in memory only) and logs. The caller
// holds sb.mu, and the Manager's mu before it when the pooled mark changes
// or to is ended (sb.pool and sb.gone are read under either lock). A
// failed save is returned with the change made: the record on disk is
// what a restarted edge checks against the runtime.
func (m *Manager) transition(sb *sandbox, to phase) error {
	from := sb.phaseOf()
	if err := checkTransition(sb.rec.GetId(), from, to); err != nil {
		m.log.Error("illegal sandbox transition refused", "id", sb.rec.GetId(), "from", from.String(), "to", to.String())
		return err
	}
	sb.rec.State = to.state
	if from.pooled && !to.pooled {
		sb.pool = ""
	}
	if ended(to.state) {
		sb.gone = time.Now()
	}
	m.log.Debug("sandbox transition", "id", sb.rec.GetId(), "from", from.String(), "to", to.String())
	m.event(sb.rec, from, to)
	if ended(to.state) {
		return nil
	}
	if err := m.states.Save(sb.rec); err != nil {
		m.log.Warn("save sandbox record", "id", sb.rec.GetId(), "state", to.String(), "err", err)
		return err
	}
	return nil
}

// event records the lifecycle event of rec's change from phase from to
// phase to, if it is one: a sandbox made (or claimed from its warm pool),
// paused, resumed or ended. A pooled sandbox's life before its claim is
// nobody's and records none.
func (m *Manager) event(rec *dsecv1.Sandbox, from, to phase) {
	if to.pooled {
		return
	}
	m.ledgerEvent(rec, from, to)
	if m.cfg.Events == nil {
		return
	}
	kind, reason := "", ""
	switch to.state {
	case dsecv1.State_STATE_RUNNING:
		switch {
		case from.state == dsecv1.State_STATE_CREATING || from.pooled:
			kind = eventlog.Created
		case from.state == dsecv1.State_STATE_RESUMING:
			kind = eventlog.Resumed
		}
	case dsecv1.State_STATE_PAUSED:
		kind = eventlog.Paused
	case dsecv1.State_STATE_STOPPED, dsecv1.State_STATE_FAILED:
		kind, reason = EndEvent(to.state, rec.GetReason())
	}
	if kind == "" {
		return
	}
	m.cfg.Events.Add(kind, rec.GetId(), rec.GetSpec().GetLabels()[iam.ProjectLabel], reason, rec.GetMessage())
}

// EndEvent names the event of a sandbox ending in state st for reason r:
// deleted by a caller, expired (its TTL, idle timeout or paused
// retention), or failed.
func EndEvent(st dsecv1.State, r dsecv1.Reason) (kind, reason string) {
	reason = strings.ToLower(strings.TrimPrefix(r.String(), "REASON_"))
	if r == dsecv1.Reason_REASON_UNSPECIFIED {
		reason = ""
	}
	switch {
	case r == dsecv1.Reason_REASON_DELETED && st == dsecv1.State_STATE_STOPPED:
		return eventlog.Deleted, ""
	case r == dsecv1.Reason_REASON_TTL, r == dsecv1.Reason_REASON_IDLE, r == dsecv1.Reason_REASON_PAUSED_TOO_LONG:
		return eventlog.Expired, reason
	}
	return eventlog.Failed, reason
}

// checkTransition refuses a change of phase that next does not list
// (Internal: the edge's own bug).
func checkTransition(id string, from, to phase) error {
	if !slices.Contains(next[from], to) {
		return fmt.Errorf("sandbox %s: no transition from %s to %s: %w", id, from, to, errdefs.ErrInternal)
	}
	return nil
}

// Transition moves rec, the record of a sandbox an edge keeps without a
// Manager (package hollow's), to state to by the same table as the
// Manager's own sandboxes: a change next does not list is refused
// (Internal) and rec left as it was. Ending a live sandbox takes two:
// stopping, then stopped or failed. Pooled sandboxes are a Manager's alone.
func Transition(rec *dsecv1.Sandbox, to dsecv1.State) error {
	if err := checkTransition(rec.GetId(), phase{state: rec.GetState()}, phase{state: to}); err != nil {
		return err
	}
	rec.State = to
	return nil
}

// transitionLogged is transition for a change that stands even when its
// record could not be saved (transition logged that): only an illegal
// change is an error.
func (m *Manager) transitionLogged(sb *sandbox, to phase) error {
	if err := m.transition(sb, to); err != nil && sb.phaseOf() != to {
		return err
	}
	return nil
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
		release = func(ctx context.Context) error {
			// The last sample, while the cgroup and veth are there.
			m.finalUsage(ctx, id, rt)
			return rt.Delete(ctx, id)
		}
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
