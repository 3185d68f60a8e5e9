// Package guestcfg is the agent configuration a microVM's host hands its
// guest: the sandbox's default user, working directory, host name, address,
// environment, output limit and pids limit. The host (the microvm backend) writes it as
// a JSON file, FileName, at the root of the guest's writable ext4 disk,
// beside the overlay's upper/ and work/ and so out of the sandbox's sight;
// the guest's init (package agent/guest) reads it once it has mounted the
// disk. A file rather than the kernel command line, whose 2048 bytes an
// environment would soon outgrow and whose words the kernel splits at
// spaces.
package guestcfg

import (
	"encoding/json"
	"fmt"
	"os"
)

// FileName is the configuration's name at the root of the writable disk.
const FileName = "dsec-agent.json"

// Agent is the guest agent's configuration; zero values keep the agent's
// defaults.
type Agent struct {
	User        string   `json:"user,omitempty"`
	Workdir     string   `json:"workdir,omitempty"`
	Hostname    string   `json:"hostname,omitempty"`
	Address     string   `json:"address,omitempty"`
	Env         []string `json:"env,omitempty"` // K=V
	OutputLimit int64    `json:"output_limit,omitempty"`
	// Pids caps the sandbox's processes in the guest (its commands; the
	// agent, pid 1, apart); 0 = none.
	Pids int64 `json:"pids,omitempty"`
}

// Write writes a to path.
func Write(path string, a Agent) error {
	b, err := json.Marshal(a)
	if err != nil {
		return fmt.Errorf("write guest agent config: %w", err)
	}
	if err := os.WriteFile(path, b, 0o600); err != nil {
		return fmt.Errorf("write guest agent config: %w", err)
	}
	return nil
}

// Read reads the configuration at path.
func Read(path string) (Agent, error) {
	var a Agent
	b, err := os.ReadFile(path)
	if err != nil {
		return a, fmt.Errorf("read guest agent config: %w", err)
	}
	if err := json.Unmarshal(b, &a); err != nil {
		return a, fmt.Errorf("read guest agent config %s: %w", path, err)
	}
	return a, nil
}
