package sandbox

import (
	"context"
	"fmt"
	"math"
	"strings"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/eventlog"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// Phases: a sandbox made with phase budgets (spec.phases) lives through
// setup, agent and verify, each at most its budget. The sweep moves a
// sandbox on when a phase's budget runs out; EndPhase moves it on before.
// The agent phase's end kills every process running in the sandbox, so the
// verify phase finds none of the agent's work still running, and its budget
// is always there: the hard TTL is the budgets' sum plus phaseMargin.

// phaseMargin is what the hard TTL of a sandbox with phase budgets adds to
// their sum: room for the verify phase's last call to return.
const phaseMargin = 30 * time.Second

// phaseTTL is the hard TTL, in seconds, of phase budgets b: their sum plus
// phaseMargin; 0 without budgets.
func phaseTTL(b *dsecv1.PhaseBudgets) (int64, error) {
	if b == nil {
		return 0, nil
	}
	s, a, v := b.GetSetupSeconds(), b.GetAgentSeconds(), b.GetVerifySeconds()
	if s < 0 || a < 0 || v < 0 || math.IsNaN(s+a+v) || math.IsInf(s+a+v, 0) {
		return 0, fmt.Errorf("phase budgets must be finite and not negative (setup %v, agent %v, verify %v): %w", s, a, v, errdefs.ErrInvalidArgument)
	}
	if s+a+v == 0 {
		return 0, fmt.Errorf("phase budgets are all 0: give at least one, or none: %w", errdefs.ErrInvalidArgument)
	}
	return int64(math.Ceil(s+a+v)) + int64(phaseMargin/time.Second), nil
}

// budget is phase p's budget in b.
func budget(b *dsecv1.PhaseBudgets, p dsecv1.Phase) time.Duration {
	var s float64
	switch p {
	case dsecv1.Phase_PHASE_SETUP:
		s = b.GetSetupSeconds()
	case dsecv1.Phase_PHASE_AGENT:
		s = b.GetAgentSeconds()
	case dsecv1.Phase_PHASE_VERIFY:
		s = b.GetVerifySeconds()
	}
	return time.Duration(s * float64(time.Second))
}

// enterPhase puts rec in the first phase from p on whose budget is not 0,
// from now; verify is never skipped (its end is the TTL's business). rec's
// sandbox's mu is held, or rec is not yet shared.
func enterPhase(rec *dsecv1.Sandbox, p dsecv1.Phase, now time.Time) {
	b := rec.GetSpec().GetPhases()
	for p < dsecv1.Phase_PHASE_VERIFY && budget(b, p) == 0 {
		p++
	}
	rec.Phase = p
	rec.PhaseEndsUnixMs = now.Add(budget(b, p)).UnixMilli()
	if p == dsecv1.Phase_PHASE_VERIFY && budget(b, p) == 0 {
		rec.PhaseEndsUnixMs = 0
	}
}

// Phase is sandbox id's phase now; PHASE_UNSPECIFIED for one without phase
// budgets or not known.
func (m *Manager) Phase(id string) dsecv1.Phase {
	sb, err := m.lookup(id)
	if err != nil {
		return dsecv1.Phase_PHASE_UNSPECIFIED
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return sb.rec.GetPhase()
}

// Isolation is sandbox id's isolation as users write it ("container",
// "gvisor", "microvm"); "" for an unknown sandbox.
func (m *Manager) Isolation(id string) string {
	sb, err := m.lookup(id)
	if err != nil {
		return ""
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return IsolationName(sb.rec.GetSpec().GetIsolation())
}

// EndPhase ends sandbox id's phase p (setup or agent) now, as its budget
// running out would; a phase already over is left alone. It returns the
// record with the phase it is in now.
func (m *Manager) EndPhase(ctx context.Context, id string, p dsecv1.Phase) (*dsecv1.Sandbox, error) {
	if p != dsecv1.Phase_PHASE_SETUP && p != dsecv1.Phase_PHASE_AGENT {
		return nil, fmt.Errorf("end phase of sandbox %s: %v is not a phase that ends early (setup or agent): %w", id, p, errdefs.ErrInvalidArgument)
	}
	sb, err := m.lookup(id)
	if err != nil {
		return nil, err
	}
	sb.mu.Lock()
	rec := sb.rec
	if rec.GetSpec().GetPhases() == nil {
		sb.mu.Unlock()
		return nil, fmt.Errorf("end phase of sandbox %s: it was made without phase budgets: %w", id, errdefs.ErrFailedPrecondition)
	}
	if !sb.gone.IsZero() || !Live(rec.GetState()) {
		sb.mu.Unlock()
		return nil, GoneError(rec)
	}
	sb.mu.Unlock()
	m.advancePhase(ctx, sb, p, "ended by request")
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return cloneRec(sb.rec), nil
}

// advancePhase moves sb from phase from to the next, if it is still in
// from, and kills what runs in it when from is the agent phase.
func (m *Manager) advancePhase(ctx context.Context, sb *sandbox, from dsecv1.Phase, why string) {
	sb.mu.Lock()
	rec := sb.rec
	if rec.GetPhase() != from || from == dsecv1.Phase_PHASE_VERIFY {
		sb.mu.Unlock()
		return
	}
	enterPhase(rec, from+1, time.Now())
	m.save(rec)
	id, to, agent, project := rec.GetId(), rec.GetPhase(), sb.agent, rec.GetSpec().GetLabels()[iam.ProjectLabel]
	sb.mu.Unlock()
	m.log.Debug("sandbox phase ended", "id", id, "phase", from.String(), "why", why, "now", to.String())
	m.cfg.Events.Add(eventlog.PhaseEnded, id, project, phaseWord(from), why)
	if from == dsecv1.Phase_PHASE_SETUP {
		m.rebaseline(sb, id)
	}
	if from == dsecv1.Phase_PHASE_AGENT {
		m.killAgentWork(context.WithoutCancel(ctx), id, agent)
	}
}

// killAgentWork kills every process running in sandbox id (with all it
// started): what the agent phase left behind.
func (m *Manager) killAgentWork(ctx context.Context, id string, agent interface {
	ListProcesses(context.Context, *connect.Request[dsecv1.ListProcessesRequest]) (*connect.Response[dsecv1.ListProcessesResponse], error)
	Signal(context.Context, *connect.Request[dsecv1.SignalRequest]) (*connect.Response[dsecv1.SignalResponse], error)
}) {
	if agent == nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	list, err := agent.ListProcesses(ctx, connect.NewRequest(&dsecv1.ListProcessesRequest{SandboxId: id}))
	if err != nil {
		m.log.Warn("list the agent phase's processes", "id", id, "err", err)
		return
	}
	killed := 0
	for _, p := range list.Msg.GetProcesses() {
		if !p.GetRunning() {
			continue
		}
		if _, err := agent.Signal(ctx, connect.NewRequest(&dsecv1.SignalRequest{SandboxId: id, ProcessId: p.GetProcessId()})); err != nil {
			m.log.Warn("kill a process of the agent phase", "id", id, "process", p.GetProcessId(), "err", err)
			continue
		}
		killed++
	}
	m.log.Debug("agent phase's processes killed", "id", id, "killed", killed)
}

// phaseWord is p as the API's lower-case word: setup, agent, verify.
func phaseWord(p dsecv1.Phase) string {
	return strings.ToLower(strings.TrimPrefix(p.String(), "PHASE_"))
}
