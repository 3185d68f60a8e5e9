package qmp

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"syscall"
	"time"
)

// SendFD hands f to QEMU under name (QMP's getfd, the descriptor passed
// beside the command over the Unix socket): commands then name it as
// "fd:NAME", as migrate and migrate-incoming do. QEMU holds its own copy;
// the caller may close f once SendFD returns.
func (c *Client) SendFD(ctx context.Context, name string, f *os.File) error {
	oob := syscall.UnixRights(int(f.Fd()))
	err := c.execute(ctx, "getfd", map[string]string{"fdname": name}, nil, oob)
	runtime.KeepAlive(f) // open until the message carrying it is sent
	return err
}

// SetMigrationCapabilities turns migration capabilities on or off, by
// name (x-ignore-shared, …). The source and the destination of a
// migration need the same ones, set before it starts.
func (c *Client) SetMigrationCapabilities(ctx context.Context, caps map[string]bool) error {
	type capability struct {
		Capability string `json:"capability"`
		State      bool   `json:"state"`
	}
	var list []capability
	for name, on := range caps {
		list = append(list, capability{name, on})
	}
	return c.Execute(ctx, "migrate-set-capabilities", map[string]any{"capabilities": list}, nil)
}

// Migrate starts sending the VM's state to uri ("fd:NAME" for a
// descriptor given with SendFD). It returns once the migration started;
// WaitMigration waits for its end.
func (c *Client) Migrate(ctx context.Context, uri string) error {
	return c.Execute(ctx, "migrate", map[string]string{"uri": uri}, nil)
}

// MigrateIncoming starts loading a state from uri into a QEMU started
// with "-incoming defer". The guest stays stopped once it is loaded
// (Cont runs it).
func (c *Client) MigrateIncoming(ctx context.Context, uri string) error {
	return c.Execute(ctx, "migrate-incoming", map[string]string{"uri": uri}, nil)
}

// MigrationInfo is query-migrate's answer (the parts used here).
type MigrationInfo struct {
	// Status: "none", "setup", "active", "completed", "failed",
	// "cancelled", …
	Status    string `json:"status"`
	ErrorDesc string `json:"error-desc,omitempty"`
	TotalTime int64  `json:"total-time,omitempty"` // ms
	RAM       *struct {
		Transferred int64 `json:"transferred"`
		Total       int64 `json:"total"`
	} `json:"ram,omitempty"`
}

// QueryMigrate asks how the last migration stands, on either side.
func (c *Client) QueryMigrate(ctx context.Context) (MigrationInfo, error) {
	var info MigrationInfo
	err := c.Execute(ctx, "query-migrate", nil, &info)
	return info, err
}

// migrationPoll is how often WaitMigration asks when no event tells it.
const migrationPoll = 10 * time.Millisecond

// WaitMigration waits for the migration under way to end, on either side,
// and returns its last status: nil once it completed, an error naming
// why when it failed or was cancelled. It asks query-migrate, which
// answers on both sides (the MIGRATION events come only with the events
// capability on).
func (c *Client) WaitMigration(ctx context.Context) (MigrationInfo, error) {
	for {
		info, err := c.QueryMigrate(ctx)
		if err != nil {
			return info, err
		}
		switch info.Status {
		case "completed":
			return info, nil
		case "failed", "cancelled":
			return info, fmt.Errorf("migration %s: %s", info.Status, info.ErrorDesc)
		}
		select {
		case <-ctx.Done():
			return info, fmt.Errorf("wait for migration (status %s): %w", info.Status, ctx.Err())
		case <-time.After(migrationPoll):
		}
	}
}

// Chardev is one of query-chardev's answers.
type Chardev struct {
	Label string `json:"label"`
	// Filename is the chardev's address; a server socket's starts with
	// "disconnected:" while no client is connected.
	Filename     string `json:"filename"`
	FrontendOpen bool   `json:"frontend-open"` // the guest's side is open
}

// QueryChardevs lists QEMU's character devices.
func (c *Client) QueryChardevs(ctx context.Context) ([]Chardev, error) {
	var cs []Chardev
	err := c.Execute(ctx, "query-chardev", nil, &cs)
	return cs, err
}
