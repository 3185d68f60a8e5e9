package sandbox

import (
	"context"
	"errors"
	"time"

	"dsec.dev/dsec/internal/agent/execwire"
)

// The pause between checks of a sandbox whose watch connection keeps
// ending while its agent still answers or its container still runs: it
// doubles from the first to the most, and starts over once a watch held
// for a minute.
const (
	rewatchFirst = time.Second
	rewatchMost  = 30 * time.Second
	watchSteady  = time.Minute
)

// watch starts the watcher of sandbox sb, running (or paused) with its
// agent client set: a goroutine that holds a watch connection to the agent
// (package execwire) until the connection ends, which it does at once when
// the agent exits, is killed or is OOM-killed. Then it checks the sandbox
// (check: a ping, then the runtime's status), which fails it when its agent
// is gone, and watches again while it lives. An idle sandbox so costs the
// edge and its agent no wake-up at all, where a ping every PingInterval
// cost both a round trip per sandbox. An agent older than watch
// connections is pinged every PingInterval instead (polled). The watch
// ends with the sandbox (stopSandbox) or at Shutdown.
func (m *Manager) watch(sb *sandbox) {
	m.mu.Lock()
	if m.shut {
		m.mu.Unlock()
		return
	}
	ctx, cancel := context.WithCancel(m.life)
	m.watchers.Add(1)
	m.mu.Unlock()
	sb.mu.Lock()
	client, id := sb.agent, sb.rec.GetId()
	sb.unwatch = cancel
	sb.mu.Unlock()
	go func() {
		defer m.watchers.Done()
		defer cancel()
		if client == nil {
			return
		}
		m.watchLoop(ctx, id, sb, client.Watch)
	}()
}

// watchLoop holds watch connections to the agent of sandbox id through
// hold (the client's Watch) until ctx ends.
func (m *Manager) watchLoop(ctx context.Context, id string, sb *sandbox, hold func(context.Context) error) {
	pause := rewatchFirst
	for {
		held := time.Now()
		err := hold(ctx)
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, execwire.ErrNotWatched) {
			sb.mu.Lock()
			sb.polled = true
			sb.mu.Unlock()
			m.log.Info("agent holds no watch connection; it is pinged instead", "id", id, "every", m.cfg.PingInterval)
			return
		}
		m.log.Debug("agent channel ended", "id", id, "err", err)
		// Fails the sandbox, and so ends ctx, when the agent is gone.
		m.check(ctx, sb)
		if time.Since(held) > watchSteady {
			pause = rewatchFirst
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(pause):
		}
		pause = min(2*pause, rewatchMost)
	}
}
