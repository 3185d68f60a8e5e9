package sandbox

import (
	"errors"
	"math"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// TestPhaseTTL: the hard TTL is the budgets' sum, rounded up, plus the
// margin; budgets that are negative, not finite or all 0 are refused.
func TestPhaseTTL(t *testing.T) {
	if ttl, err := phaseTTL(nil); ttl != 0 || err != nil {
		t.Errorf("no budgets: %d %v", ttl, err)
	}
	if ttl, err := phaseTTL(&dsecv1.PhaseBudgets{SetupSeconds: 1.5, AgentSeconds: 10, VerifySeconds: 3}); ttl != 45 || err != nil {
		t.Errorf("1.5+10+3: %d %v, want 45", ttl, err)
	}
	for _, b := range []*dsecv1.PhaseBudgets{{AgentSeconds: -1}, {VerifySeconds: math.Inf(1)}, {AgentSeconds: math.NaN()}, {}} {
		if _, err := phaseTTL(b); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%v: %v, want invalid argument", b, err)
		}
	}
}

// TestEnterPhase: phases without a budget are skipped, verify never is,
// and a phase ends its budget from now.
func TestEnterPhase(t *testing.T) {
	now := time.UnixMilli(1_000_000)
	rec := &dsecv1.Sandbox{Spec: &dsecv1.SandboxSpec{Phases: &dsecv1.PhaseBudgets{AgentSeconds: 3, VerifySeconds: 10}}}
	enterPhase(rec, dsecv1.Phase_PHASE_SETUP, now)
	if rec.GetPhase() != dsecv1.Phase_PHASE_AGENT || rec.GetPhaseEndsUnixMs() != now.Add(3*time.Second).UnixMilli() {
		t.Errorf("no setup budget: %v ends %d", rec.GetPhase(), rec.GetPhaseEndsUnixMs())
	}
	enterPhase(rec, dsecv1.Phase_PHASE_VERIFY, now)
	if rec.GetPhase() != dsecv1.Phase_PHASE_VERIFY || rec.GetPhaseEndsUnixMs() != now.Add(10*time.Second).UnixMilli() {
		t.Errorf("verify: %v ends %d", rec.GetPhase(), rec.GetPhaseEndsUnixMs())
	}
	rec.Spec.Phases = &dsecv1.PhaseBudgets{SetupSeconds: 5}
	enterPhase(rec, dsecv1.Phase_PHASE_AGENT, now)
	if rec.GetPhase() != dsecv1.Phase_PHASE_VERIFY || rec.GetPhaseEndsUnixMs() != 0 {
		t.Errorf("no agent or verify budget: %v ends %d, want verify with no end of its own", rec.GetPhase(), rec.GetPhaseEndsUnixMs())
	}
}
