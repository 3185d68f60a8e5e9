package vmstate

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
)

// MetaSuffix names the file beside a state file that holds what Pause
// knew of the VM beyond QEMU's state (meta): a copy of a saved VM copies
// both.
const MetaSuffix = ".json"

// meta is what Pause records for Resume beside the state file.
type meta struct {
	// ChannelConnected: the host was connected to the agent's port when
	// the VM was saved, so the restored guest sees it leave (the new QEMU
	// has no client yet) and starts a new session of the channel.
	ChannelConnected bool `json:"channel_connected"`
	// Resident are the RAM file's ranges in the page cache at the pause:
	// the hot set a resume with Prefetch reads ahead.
	Resident []span `json:"resident,omitempty"`
}

// span is a byte range of a file.
type span struct {
	Off int64 `json:"off"`
	Len int64 `json:"len"`
}

func writeMeta(stateFile string, m meta) error {
	b, err := json.Marshal(m)
	if err != nil {
		return fmt.Errorf("write vm state's meta: %w", err)
	}
	if err := os.WriteFile(stateFile+MetaSuffix, b, 0o600); err != nil {
		return fmt.Errorf("write vm state's meta: %w", err)
	}
	return nil
}

// readMeta reads what writeMeta wrote; a state without it (not saved by
// Pause) has the zero meta.
func readMeta(stateFile string) (meta, error) {
	var m meta
	b, err := os.ReadFile(stateFile + MetaSuffix)
	if os.IsNotExist(err) {
		return m, nil
	}
	if err != nil {
		return m, fmt.Errorf("read vm state's meta: %w", err)
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, fmt.Errorf("read vm state's meta %s: %w", stateFile+MetaSuffix, err)
	}
	return m, nil
}

// Saved reports whether stateFile holds a whole saved VM: Pause writes
// its meta last, once QEMU is gone and the RAM on disk, so a pause cut
// short (the edge killed midway) is not taken for one.
func Saved(stateFile string) bool {
	_, err := os.Stat(stateFile + MetaSuffix)
	return err == nil
}

// Discard removes a saved VM's state (not its RAM file or disks): once
// the VM is resumed and runs on, the state no longer matches its RAM.
func Discard(stateFile string) error {
	var errs []error
	for _, f := range []string{stateFile + MetaSuffix, stateFile} {
		if err := os.Remove(f); err != nil && !os.IsNotExist(err) {
			errs = append(errs, fmt.Errorf("discard vm state: %w", err))
		}
	}
	return errors.Join(errs...)
}
