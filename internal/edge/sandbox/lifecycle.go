package sandbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"connectrpc.com/connect"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/ledger"
	"dsec.dev/dsec/internal/sandboxid"
)

// Recover re-adopts every sandbox a previous run of the edge left running
// (and watches each, see watch), reaps the ones that died or were half made
// meanwhile, and starts the background loop that enforces TTLs and idle
// timeouts.
func (m *Manager) Recover(ctx context.Context) error {
	ids, err := m.states.IDs()
	if err != nil {
		return err
	}
	owners, err := m.owners(ctx)
	if err != nil {
		m.log.Warn("list runtimes' sandboxes", "err", err)
	}
	known := make(map[string]bool, len(ids))
	for _, id := range ids {
		known[id] = true
		m.recoverOne(ctx, id, owners[id])
	}
	// Sandboxes a runtime knows but no record names were made by a create
	// that crashed before its first save.
	for id, rt := range owners {
		if known[id] {
			continue
		}
		if node, err := sandboxid.Node(id); err != nil || node != m.cfg.Node {
			continue
		}
		m.log.Info("removing orphan sandbox", "id", id)
		m.reap(ctx, id, rt)
	}
	// A watcher's marks ended with the daemon that made them.
	for _, id := range ids {
		m.recoverProvenance(ctx, id)
	}
	if m.net != nil {
		keep := map[string]map[string]bool{}
		m.mu.Lock()
		for id, sb := range m.sandboxes {
			if sb.gone.IsZero() && len(sb.rec.GetSpec().GetNetworkRules()) > 0 {
				keep[id] = sb.rec.GetSpec().GetNetworkRules()
			}
		}
		m.mu.Unlock()
		if err := m.net.Recover(ctx, keep); err != nil {
			m.log.Warn("recover sandbox networks", "err", err)
		}
	}
	m.wg.Add(2)
	go m.loop()
	go m.poolLoop()
	if m.cfg.Ledger != nil {
		every := m.cfg.LedgerInterval
		if every <= 0 {
			every = ledger.DefaultInterval
		}
		m.wg.Add(1)
		go m.ledgerLoop(every)
	}
	return nil
}

// owners maps every sandbox the node's runtimes know to the runtime that
// holds it. An error names the runtimes that could not list theirs.
func (m *Manager) owners(ctx context.Context) (map[string]backend.Runtime, error) {
	owners := map[string]backend.Runtime{}
	var errs []error
	for _, k := range m.Kinds() {
		rt := m.runtimes[k]
		ids, err := rt.List(ctx)
		if err != nil {
			errs = append(errs, fmt.Errorf("list the sandboxes of backend %s: %w", k, err))
		}
		for _, id := range ids {
			owners[id] = rt
		}
	}
	return owners, errors.Join(errs...)
}

// recoverOne re-adopts or reaps sandbox id, whose record a previous run
// left; owner is the runtime that lists it (nil: none does).
func (m *Manager) recoverOne(ctx context.Context, id string, owner backend.Runtime) {
	rec, err := m.states.Load(id)
	if err != nil {
		m.log.Warn("unreadable sandbox record; removing the sandbox", "id", id, "err", err)
		m.reap(ctx, id, owner)
		return
	}
	if rec.GetSpec().GetLabels()[poolLabel] != "" {
		m.log.Info("removing sandbox left in a warm pool", "id", id)
		m.reap(ctx, id, owner)
		return
	}
	rt, err := m.runtimeOf(KindOf(rec.GetSpec()))
	if err != nil {
		// The node was restarted without the backend the sandbox runs on.
		m.log.Warn("removing sandbox of a backend the node no longer has", "id", id, "err", err)
		m.endFound(ctx, rec, owner, dsecv1.Reason_REASON_NODE_LOST, err.Error())
		return
	}
	switch rec.GetState() {
	case dsecv1.State_STATE_RUNNING, dsecv1.State_STATE_PAUSED, dsecv1.State_STATE_PAUSING, dsecv1.State_STATE_RESUMING:
	default:
		m.log.Info("removing sandbox left half made or half stopped", "id", id, "state", rec.GetState().String())
		m.endFound(ctx, rec, rt, dsecv1.Reason_REASON_NODE_LOST, "the edge restarted while it was "+stateWord(rec.GetState()))
		return
	}
	st, err := rt.Status(ctx, id)
	var dial backend.Dialer
	if err == nil && st.Running {
		dial, err = rt.Channel(id)
	}
	if err != nil || !st.Running {
		reason, msg := dsecv1.Reason_REASON_AGENT_LOST, "the sandbox died while the edge was down"
		if st.OOMKills > 0 {
			reason, msg = dsecv1.Reason_REASON_OOM, "the sandbox was OOM-killed while the edge was down"
		}
		if st.Reason != "" {
			msg += ": " + st.Reason // a VM's: how QEMU ended, the console's last lines
		}
		m.endFound(ctx, rec, rt, reason, msg)
		return
	}
	sb := &sandbox{rec: rec, rt: rt, lastActive: time.Now(), td: m.teardownOf(id, rt), token: m.tokenOf(id)}
	// A sandbox frozen by a pause (finished, or cut short by the restart)
	// stays paused: its agent cannot answer until resumed. One that was
	// thawed already is running.
	if frozen, err := m.frozen(ctx, sb); err == nil && frozen {
		if rec.GetState() != dsecv1.State_STATE_PAUSED {
			m.log.Info("sandbox was frozen when the edge stopped; it stays paused", "id", id, "state", rec.GetState().String())
			if rec.PausedUnixMs == 0 {
				rec.PausedUnixMs = time.Now().UnixMilli()
			}
			sb.mu.Lock()
			err := m.transitionLogged(sb, paused)
			sb.mu.Unlock()
			if err != nil {
				m.log.Warn("re-adopt paused sandbox", "id", id, "err", err)
			}
		}
		sb.agent = agentclient.New(dial)
		m.mu.Lock()
		m.sandboxes[id] = sb
		m.mu.Unlock()
		m.watch(sb)
		m.log.Info("re-adopted paused sandbox", "id", id)
		return
	}
	if rec.GetState() != dsecv1.State_STATE_RUNNING {
		m.log.Info("sandbox was thawed when the edge stopped; it is running", "id", id, "state", rec.GetState().String())
		Resumed(rec, time.Now())
		sb.mu.Lock()
		err := m.transitionLogged(sb, running)
		sb.mu.Unlock()
		if err != nil {
			m.log.Warn("re-adopt running sandbox", "id", id, "err", err)
		}
	}
	client := agentclient.New(dial)
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	err = m.waitReadyIn(pctx, client)
	cancel()
	if err != nil {
		client.Close()
		m.log.Warn("agent of re-adopted sandbox does not answer; removing it", "id", id, "err", err)
		m.endFound(ctx, rec, rt, dsecv1.Reason_REASON_AGENT_LOST, "its agent did not answer after the edge restarted")
		return
	}
	sb.agent = client
	m.mu.Lock()
	m.sandboxes[id] = sb
	m.mu.Unlock()
	m.watch(sb)
	m.log.Info("re-adopted sandbox", "id", id)
}

// tokenOf reads the create token a re-adopted sandbox was made for.
func (m *Manager) tokenOf(id string) string {
	token, err := m.states.Token(id)
	if err != nil {
		// The sandbox runs on; only an apiserver's reconciliation cannot find it by its token.
		m.log.Warn("read create token of re-adopted sandbox", "id", id, "err", err)
	}
	return token
}

func (m *Manager) waitReadyIn(ctx context.Context, client interface {
	Ping(context.Context, *connect.Request[agentv1.PingRequest]) (*connect.Response[agentv1.PingResponse], error)
}) error {
	for {
		_, err := client.Ping(ctx, connect.NewRequest(&agentv1.PingRequest{}))
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// reap removes whatever is left of a sandbox this process did not make:
// what rt holds of it (nil: nothing), network, layers, record.
func (m *Manager) reap(ctx context.Context, id string, rt backend.Runtime) {
	td := m.teardownOf(id, rt)
	if err := td.run(ctx); err != nil {
		m.log.Warn("remove sandbox", "id", id, "err", err)
	}
}

// endFound reaps a sandbox whose record Recover found, dead, half made or
// half stopped, and keeps its tombstone, failed for reason: its record goes
// to stopping before the reap (a restart meanwhile reaps it again) and to
// failed after. rt is the runtime that holds it (nil: none does). A record
// already ended is kept as the tombstone it is. The edge started after it
// ended, so Status does not count it.
func (m *Manager) endFound(ctx context.Context, rec *dsecv1.Sandbox, rt backend.Runtime, reason dsecv1.Reason, msg string) {
	id := rec.GetId()
	sb := &sandbox{rec: rec, rt: rt, td: m.teardownOf(id, rt)}
	// Its first phase is its record's: an ended one is the tombstone it
	// says, and a record without a state the table knows starts stopping.
	switch st := rec.GetState(); {
	case ended(st):
		sb.gone = time.Now()
	case !Live(st):
		rec.State = dsecv1.State_STATE_STOPPING
	}
	sb.mu.Lock()
	if Live(rec.GetState()) {
		if err := m.transitionLogged(sb, stopping); err != nil {
			m.log.Warn("stop sandbox found at recovery", "id", id, "err", err)
		}
	}
	sb.mu.Unlock()
	if err := sb.td.run(ctx); err != nil {
		m.log.Warn("remove sandbox", "id", id, "err", err)
	}
	m.mu.Lock()
	sb.mu.Lock()
	rec.Reason, rec.Message = reason, msg
	if rec.GetState() == dsecv1.State_STATE_STOPPING {
		if err := m.transition(sb, failed); err != nil {
			m.log.Warn("end sandbox found at recovery", "id", id, "err", err)
		}
	}
	m.sandboxes[id] = sb
	sb.mu.Unlock()
	m.mu.Unlock()
}

// Shutdown stops the edge's background work and its sandboxes' watches.
// Sandboxes keep running and a later Recover re-adopts them.
func (m *Manager) Shutdown() {
	select {
	case <-m.stop:
	default:
		close(m.stop)
	}
	m.mu.Lock()
	m.shut = true
	m.mu.Unlock()
	m.endLife()
	m.wg.Wait()
	m.watchers.Wait()
}

// Teardown deletes every sandbox of this node, known or orphaned.
func (m *Manager) Teardown(ctx context.Context) error {
	m.Shutdown()
	var errs []error
	ids, err := m.states.IDs()
	if err != nil {
		errs = append(errs, err)
	}
	owners, err := m.owners(ctx)
	if err != nil {
		errs = append(errs, err)
	}
	for id := range owners {
		ids = append(ids, id)
	}
	seen := map[string]bool{}
	for _, id := range ids {
		if seen[id] {
			continue
		}
		seen[id] = true
		td := m.teardownOf(id, owners[id])
		if err := td.run(ctx); err != nil {
			errs = append(errs, fmt.Errorf("sandbox %s: %w", id, err))
		}
	}
	m.mu.Lock()
	clear(m.sandboxes)
	m.mu.Unlock()
	m.poolMu.Lock()
	clear(m.pools)
	m.poolMu.Unlock()
	return errors.Join(errs...)
}

// loop enforces lifetimes until Shutdown, and pings the agents that hold
// no watch connection.
func (m *Manager) loop() {
	defer m.wg.Done()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	lastPing := time.Time{}
	for {
		select {
		case <-m.stop:
			return
		case <-tick.C:
		}
		now := time.Now()
		ping := now.Sub(lastPing) >= m.cfg.PingInterval
		if ping {
			lastPing = now
		}
		m.sweep(now, ping)
	}
}

func (m *Manager) sweep(now time.Time, ping bool) {
	ctx := context.Background()
	m.mu.Lock()
	var live []*sandbox
	var forgotten []string
	pooled := map[*sandbox]bool{}
	for id, sb := range m.sandboxes {
		if !sb.gone.IsZero() {
			if now.Sub(sb.gone) > m.cfg.TombstoneTTL {
				delete(m.sandboxes, id)
				forgotten = append(forgotten, id)
			}
			continue
		}
		live = append(live, sb)
		if sb.pool != "" {
			pooled[sb] = true
		}
	}
	m.mu.Unlock()
	if m.net != nil {
		for _, id := range forgotten {
			m.net.Forget(id)
		}
	}

	sem := make(chan struct{}, 32)
	var wg sync.WaitGroup
	for _, sb := range live {
		sb.mu.Lock()
		rec := sb.rec
		state := rec.GetState()
		expires := time.UnixMilli(rec.GetExpiresUnixMs())
		pausedFor := now.Sub(time.UnixMilli(rec.GetPausedUnixMs()))
		idle := time.Duration(rec.GetSpec().GetIdleTimeoutSeconds()) * time.Second
		quiet := now.Sub(sb.lastActive)
		// What runs in the agent is asked below, when the idle timeout
		// would end the sandbox: the count of the last ask is old news.
		busy := sb.inflight > 0
		polled := sb.polled
		pauseOnTimeout := rec.GetSpec().GetOnTimeout() == dsecv1.OnTimeout_ON_TIMEOUT_PAUSE
		taskPhase, phaseEnds := rec.GetPhase(), rec.GetPhaseEndsUnixMs()
		sb.mu.Unlock()
		// A paused sandbox's clocks stand still but for its retention.
		if state == dsecv1.State_STATE_PAUSED && pausedFor > m.cfg.PausedRetention {
			go m.stopSandbox(ctx, sb, dsecv1.State_STATE_STOPPED, dsecv1.Reason_REASON_PAUSED_TOO_LONG,
				fmt.Sprintf("paused for %s, longer than the node keeps paused sandboxes (dsecd --paused-retention %s)", pausedFor.Round(time.Second), m.cfg.PausedRetention))
			continue
		}
		if state != dsecv1.State_STATE_RUNNING {
			continue
		}
		switch {
		case pooled[sb]:
			// No lifetime until taken; only its health is watched.
		case rec.GetExpiresUnixMs() > 0 && now.After(expires):
			go m.timeout(ctx, sb, pauseOnTimeout, dsecv1.Reason_REASON_TTL,
				fmt.Sprintf("its TTL of %ds ran out", rec.GetSpec().GetTtlSeconds()))
			continue
		case taskPhase != dsecv1.Phase_PHASE_UNSPECIFIED && phaseEnds > 0 && now.UnixMilli() >= phaseEnds:
			go m.advancePhase(ctx, sb, taskPhase, "its budget ran out")
		case idle > 0 && quiet > idle && !busy:
			// Ask the agent what runs in it and when it last ran something
			// (a process's exit counts): one round trip per idle timeout,
			// not one per sandbox every few seconds.
			go func() {
				m.check(ctx, sb)
				sb.mu.Lock()
				stillIdle := sb.running == 0 && sb.inflight == 0 && time.Since(sb.lastActive) > idle
				sb.mu.Unlock()
				if stillIdle {
					m.timeout(ctx, sb, pauseOnTimeout, dsecv1.Reason_REASON_IDLE,
						fmt.Sprintf("idle for %s with nothing running (idle timeout %s)", quiet.Round(time.Second), idle))
				}
			}()
			continue
		}
		if ping && polled {
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer wg.Done()
				defer func() { <-sem }()
				m.check(ctx, sb)
			}()
		}
	}
	wg.Wait()
}

// timeout carries out a TTL or idle timeout: a pause when the sandbox's
// spec says on_timeout pause, else a stop.
func (m *Manager) timeout(ctx context.Context, sb *sandbox, pause bool, reason dsecv1.Reason, why string) {
	if !pause {
		if err := m.stopSandbox(ctx, sb, dsecv1.State_STATE_STOPPED, reason, why); err != nil {
			m.log.Warn("stop sandbox", "id", sb.rec.GetId(), "why", why, "err", err)
		}
		return
	}
	if _, _, err := m.pause(ctx, sb, false); err != nil {
		m.log.Warn("pause sandbox on timeout", "why", why, "err", err)
		return
	}
	m.log.Info("sandbox paused on timeout", "id", sb.rec.GetId(), "why", why)
}

// check pings one agent, refreshes its activity, and fails the sandbox when
// its agent is gone. The watch calls it when the agent's watch connection
// ends, the sweep when the idle timeout would end the sandbox (and every
// PingInterval for an agent without a watch connection).
func (m *Manager) check(ctx context.Context, sb *sandbox) {
	sb.mu.Lock()
	client, id := sb.agent, sb.rec.GetId()
	sb.mu.Unlock()
	if client == nil || sb.rt == nil {
		return
	}
	pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	resp, err := client.Ping(pctx, connect.NewRequest(&agentv1.PingRequest{}))
	cancel()
	if err == nil {
		sb.mu.Lock()
		sb.pingFails = 0
		sb.running = resp.Msg.GetRunningProcesses()
		if t := time.UnixMilli(resp.Msg.GetLastActiveUnixMs()); t.After(sb.lastActive) {
			sb.lastActive = t
		}
		if sb.running > 0 {
			sb.lastActive = time.Now()
		}
		sb.rec.LastActiveUnixMs = sb.lastActive.UnixMilli()
		sb.mu.Unlock()
		return
	}
	sb.mu.Lock()
	if sb.rec.GetState() != dsecv1.State_STATE_RUNNING {
		sb.mu.Unlock()
		return // paused meanwhile: a frozen agent cannot answer
	}
	sb.pingFails++
	fails := sb.pingFails
	sb.mu.Unlock()
	st, serr := sb.rt.Status(ctx, id)
	if serr == nil && st.Running && fails < 3 {
		return
	}
	reason, msg := dsecv1.Reason_REASON_AGENT_LOST, fmt.Sprintf("its agent channel was lost: %v", err)
	if serr == nil && st.OOMKills > 0 && !st.Running {
		reason, msg = dsecv1.Reason_REASON_OOM, "its agent was OOM-killed"
	}
	if serr == nil && !st.Running && st.Reason != "" {
		// A VM says why it stopped: how QEMU ended, the console's last
		// lines (a kernel panic's message among them).
		msg = "it stopped: " + st.Reason
	}
	m.stopSandbox(ctx, sb, dsecv1.State_STATE_FAILED, reason, msg)
}
