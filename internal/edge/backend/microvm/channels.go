package microvm

import (
	"log/slog"
	"sync"

	"dsec.dev/dsec/internal/vm/channel"
)

// Channels are the host ends of VMs' agent channels, one dialer per VM. A
// VM's port carries one session at a time, so the runtime instances of one
// process share them: a daemon has one instance, and tests that play a
// daemon's restart in one process pass the same Channels to each instance
// (Config.Channels), as the new daemon finds the old one's connection gone.
type Channels struct {
	log *slog.Logger
	mu  sync.Mutex
	m   map[string]*channel.Dialer // by the VM's channel socket
}

// NewChannels returns an empty set of channels.
func NewChannels(log *slog.Logger) *Channels {
	return &Channels{log: log, m: map[string]*channel.Dialer{}}
}

// get returns the dialer of the channel at socket, made on first use.
func (c *Channels) get(socket string) *channel.Dialer {
	c.mu.Lock()
	defer c.mu.Unlock()
	d := c.m[socket]
	if d == nil {
		d = channel.NewDialer(socket, c.log)
		c.m[socket] = d
	}
	return d
}

// close ends the channel at socket: its dialer fails from then on.
func (c *Channels) close(socket string) {
	c.mu.Lock()
	d := c.m[socket]
	delete(c.m, socket)
	c.mu.Unlock()
	if d != nil {
		d.Close()
	}
}
