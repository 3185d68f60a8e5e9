package dsec

import (
	"context"
	"fmt"
	"strings"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// Phase is where a sandbox made with phase budgets is in its life
// (CreateOptions.Phases): PhaseSetup, PhaseAgent, PhaseVerify; PhaseNone
// for a sandbox without budgets.
type Phase string

const (
	PhaseNone   Phase = ""
	PhaseSetup  Phase = "setup"
	PhaseAgent  Phase = "agent"
	PhaseVerify Phase = "verify"
)

func phaseOf(p dsecv1.Phase) Phase {
	if p == dsecv1.Phase_PHASE_UNSPECIFIED {
		return PhaseNone
	}
	return Phase(strings.ToLower(strings.TrimPrefix(p.String(), "PHASE_")))
}

func (p Phase) proto() (dsecv1.Phase, error) {
	v, ok := dsecv1.Phase_value["PHASE_"+strings.ToUpper(string(p))]
	if !ok || p == PhaseNone {
		return 0, invalid("phase %q is not known (setup, agent, verify)", p)
	}
	return dsecv1.Phase(v), nil
}

// PhaseBudgets split a sandbox's life into setup, agent and verify, each at
// most its budget. The hard TTL is their sum plus a margin (30 s); the
// agent phase's end (its budget, or EndPhase) kills every process running
// in the sandbox, not the sandbox, so the verify phase always has its
// budget. A zero budget skips its phase (but verify's).
type PhaseBudgets struct {
	Setup, Agent, Verify time.Duration
}

func (b *PhaseBudgets) proto() *dsecv1.PhaseBudgets {
	if b == nil {
		return nil
	}
	return &dsecv1.PhaseBudgets{SetupSeconds: b.Setup.Seconds(), AgentSeconds: b.Agent.Seconds(), VerifySeconds: b.Verify.Seconds()}
}

// Phase is the sandbox's phase as last read (Refresh reads it again).
func (s *Sandbox) Phase() Phase { return phaseOf(s.info.GetPhase()) }

// EndPhase ends the sandbox's phase p (PhaseSetup or PhaseAgent) now, as
// its budget running out would: the end of the agent phase kills every
// process running in the sandbox. A phase already over is left alone.
func (s *Sandbox) EndPhase(ctx context.Context, p Phase) error {
	n, err := s.c.EndPhase(ctx, s.ID, p)
	if err != nil {
		return err
	}
	s.info = n.info
	return nil
}

// EndPhase ends sandbox id's phase p; see Sandbox.EndPhase.
func (c *Client) EndPhase(ctx context.Context, id string, p Phase) (*Sandbox, error) {
	ph, err := p.proto()
	if err != nil {
		return nil, err
	}
	var resp *connect.Response[dsecv1.EndPhaseResponse]
	err = c.unary(ctx, true, func(ctx context.Context) (err error) {
		resp, err = c.sb.EndPhase(ctx, connect.NewRequest(&dsecv1.EndPhaseRequest{SandboxId: id, Phase: ph}))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("end the %s phase of sandbox %s: %w", p, id, err)
	}
	return c.wrap(resp.Msg.GetSandbox()), nil
}
