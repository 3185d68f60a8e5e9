package sandbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/eventlog"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// forkSource is where a fork's child starts from: its parent's save in the
// parent's runtime, and the parent's layers.
type forkSource struct {
	forker  backend.Forker
	save    string
	digests []string
}

// ForkResult is one child of a Fork: its record, or why it was not made.
type ForkResult struct {
	Sandbox *dsecv1.Sandbox
	Err     error
}

// forkParallel is how many children of a fork start at once.
const forkParallel = 4

// Fork makes one sandbox per token (as Create's token) from one save of
// running sandbox id's whole state (Forker.SaveFork: id stands still for
// it, then runs on), each started from the save with id's spec, a new ID,
// its own network namespace with id's rules, and its own identity (the
// runtime's StartFork). A paused sandbox is saved as it is, and stays
// paused, where the runtime can (a microVM paused to disk is saved
// already); else it is resumed first, as for any call that runs in it.
// It answers each child on its own: a child that fails
// leaves nothing and has its error, the others live. It returns how long
// id stood still; the call fails as a whole only when id cannot be saved.
func (m *Manager) Fork(ctx context.Context, id string, tokens []string) ([]ForkResult, time.Duration, error) {
	sb, err := m.lookup(id)
	if err != nil {
		return nil, 0, err
	}
	f, ok := sb.rt.(backend.Forker)
	if !ok {
		sb.mu.Lock()
		kind := KindOf(sb.rec.GetSpec())
		sb.mu.Unlock()
		return nil, 0, fmt.Errorf("fork %s: its runtime (%s) cannot copy a sandbox's memory: %w", id, kind, errdefs.ErrFailedPrecondition)
	}
	save := forkSaveName(id)
	rec, frozen, err := m.saveFork(ctx, sb, f, save, true)
	if errors.Is(err, errResumeFirst) {
		if err := m.use(ctx, id, func(*sandbox) error { return nil }); err != nil {
			return nil, 0, err
		}
		rec, frozen, err = m.saveFork(ctx, sb, f, save, false)
	}
	if err != nil {
		return nil, 0, err
	}
	defer func() {
		if err := f.DropFork(context.WithoutCancel(ctx), save); err != nil {
			m.log.Warn("drop a fork's save", "id", id, "save", save, "err", err)
		}
	}()
	from := &forkSource{forker: f, save: save, digests: rec.GetLayerDigests()}
	spec := cloneSpec(rec.GetSpec())
	out := make([]ForkResult, len(tokens))
	sem := make(chan struct{}, forkParallel)
	var wg sync.WaitGroup
	for i, token := range tokens {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			rec, err := m.forkOne(ctx, spec, token, from)
			out[i] = ForkResult{Sandbox: rec, Err: err}
		}()
	}
	wg.Wait()
	var children []string
	for _, r := range out {
		if r.Err == nil {
			children = append(children, r.Sandbox.GetId())
		}
	}
	m.cfg.Events.Add(eventlog.Forked, id, spec.GetLabels()[iam.ProjectLabel], "", strings.Join(children, ","))
	return out, frozen, nil
}

// forkOne starts one child of a fork, admitted as any create.
func (m *Manager) forkOne(ctx context.Context, spec *dsecv1.SandboxSpec, token string, from *forkSource) (*dsecv1.Sandbox, error) {
	if err := m.admit(false); err != nil {
		return nil, err
	}
	// The child starts to its end even if the caller goes: a given-up one
	// is found by its token, as a create's.
	sb, err := m.start(context.WithoutCancel(ctx), m.NewID(), cloneSpec(spec), "", token, from)
	if err != nil {
		return nil, err
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return cloneRec(sb.rec), nil
}

// errResumeFirst is a fork's save that needs its paused parent resumed.
var errResumeFirst = errors.New("the sandbox must be resumed for its fork")

// saveFork saves the sandbox for its fork as one transition, as a
// snapshot's capture: a pause, resume or stop meanwhile waits. A running
// sandbox is saved; a paused one, with paused, too, if its runtime can
// save it as it is; else (or while a transition runs) it returns
// errResumeFirst.
func (m *Manager) saveFork(ctx context.Context, sb *sandbox, f backend.Forker, save string, paused bool) (*dsecv1.Sandbox, time.Duration, error) {
	ctx = context.WithoutCancel(ctx) // a frozen sandbox must run again
	sb.op.Lock()
	defer sb.op.Unlock()
	sb.mu.Lock()
	rec := cloneRec(sb.rec)
	v := decide(sb.phaseOf(), callUse)
	sb.mu.Unlock()
	switch {
	case v == allow:
	case paused && (v == resumeFirst || v == waitFor):
		if v == waitFor {
			return nil, 0, errResumeFirst // use() waits for the transition
		}
	default:
		// Paused or stopped since use() looked.
		return nil, 0, fmt.Errorf("fork %s: %w", rec.GetId(), refusal(rec, refuseGone, callUse))
	}
	frozen, err := f.SaveFork(ctx, rec.GetId(), save)
	if v == resumeFirst && errors.Is(err, errdefs.ErrFailedPrecondition) {
		return nil, 0, errResumeFirst // frozen in memory, say
	}
	if err != nil {
		return nil, 0, err
	}
	return rec, frozen, nil
}

// forkSaveName names a fork's save: the parent's ID and a random suffix,
// so forks of one sandbox at once do not meet.
func forkSaveName(id string) string {
	b := make([]byte, 4)
	rand.Read(b) // never returns an error (crypto/rand)
	return id + ".fork." + hex.EncodeToString(b)
}
