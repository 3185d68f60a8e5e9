// Package trajectory records what was done to each sandbox of a node: every
// call that acted on it (exec, session input and runs, shell input, file
// writes, uploads, removes and moves, network-rule changes, pause and
// resume, snapshots, forks), in order, with its time, arguments, exit and a
// hash of its output (the output itself up to a cap), and the sandbox's
// network events between them. The edge's service (package edgesvc) sees
// every such call, whichever surface it came through (the API, E2B,
// SandboxFusion), and records it through a Recorder; the Recorder keeps one
// file of JSON lines per sandbox on the node's disk, finishes it when the
// sandbox is gone, copies it to the blob store so that it outlives the
// node, and removes it after the configured retention.
//
// A trajectory's size is bounded: past Config.MaxBytes a call's line keeps
// only hashes and counts, and past twice that calls are only counted; its
// last line (type "end") says what was dropped. docs/trajectories.md
// describes the format.
package trajectory

import (
	"encoding/base64"
	"encoding/json"
	"time"
	"unicode/utf8"

	"dsec.dev/dsec/internal/edge/netpolicy"
)

// Line types.
const (
	TypeBegin = "begin" // the first line: the sandbox recorded
	TypeCall  = "call"  // a call that acted on the sandbox
	TypeNet   = "net"   // a network event of the sandbox
	TypeEnd   = "end"   // the last line, once the sandbox is gone
)

// Line is one line of a trajectory.
type Line struct {
	Seq  int64     `json:"seq"`
	Type string    `json:"type"`
	Time time.Time `json:"time"` // a call's start; an event's time

	Sandbox *Sandbox `json:"sandbox,omitempty"` // begin

	// call
	Call       string          `json:"call,omitempty"`
	Args       json.RawMessage `json:"args,omitempty"`        // the request, as protojson
	ArgsSHA256 string          `json:"args_sha256,omitempty"` // of the protojson, when Args was left out
	ArgsBytes  int             `json:"args_bytes,omitempty"`  // when Args was left out
	DurationMs float64         `json:"duration_ms,omitempty"`
	Exit       *int32          `json:"exit,omitempty"`
	Error      string          `json:"error,omitempty"`
	Stdout     *Output         `json:"stdout,omitempty"`
	Stderr     *Output         `json:"stderr,omitempty"`
	Stdin      *Output         `json:"stdin,omitempty"` // a shell's input
	// Degraded: written past the trajectory's MaxBytes, with hashes and
	// counts only (arguments over a KiB hashed, no output kept).
	Degraded bool `json:"degraded,omitempty"`

	Net *netpolicy.Event `json:"net,omitempty"` // net

	End *End `json:"end,omitempty"` // end

	est int64 // the size it was counted at, until written
}

// Sandbox says which sandbox a trajectory records, and what a replay needs
// to make another like it.
type Sandbox struct {
	ID           string          `json:"id"`
	Node         string          `json:"node,omitempty"`
	Project      string          `json:"project,omitempty"`
	Environment  string          `json:"environment,omitempty"`
	Isolation    string          `json:"isolation,omitempty"`
	NetworkRules map[string]bool `json:"network_rules,omitempty"`
}

// Output is what one stream of a call wrote: its size and SHA-256 always,
// its first bytes up to the cap as text (valid UTF-8) or base64.
type Output struct {
	Bytes     int64  `json:"bytes"`
	SHA256    string `json:"sha256"`
	Text      string `json:"text,omitempty"`
	Base64    string `json:"base64,omitempty"`
	Truncated bool   `json:"truncated,omitempty"` // the text holds only the first bytes
}

// End closes a trajectory: what it holds, and what was dropped to keep it
// within its bounds.
type End struct {
	Reason  string  `json:"reason"` // why it ended: the sandbox deleted, or gone
	Calls   int64   `json:"calls"`  // calls recorded, degraded ones included
	Net     int64   `json:"net"`    // network events recorded
	Dropped Dropped `json:"dropped"`
}

// Dropped counts what a trajectory left out.
type Dropped struct {
	// Calls and Net: made or seen past twice MaxBytes, counted only.
	Calls int64 `json:"calls,omitempty"`
	Net   int64 `json:"net,omitempty"`
	// Degraded: calls written with hashes and counts only.
	Degraded int64 `json:"degraded,omitempty"`
	// OutputBytes: output hashed but not kept (past a call's cap).
	OutputBytes int64 `json:"output_bytes,omitempty"`
}

// setData keeps data in o as text when it is UTF-8, else as base64.
func (o *Output) setData(data []byte) {
	if utf8.Valid(data) {
		o.Text = string(data)
		return
	}
	o.Base64 = base64.StdEncoding.EncodeToString(data)
}
