package dsec

import (
	"context"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// Usage is the cost ledger's figures (docs/usage.md) of one group of
// sandboxes: what they used over their lives.
type Usage struct {
	Sandboxes     int64   `json:"sandboxes"`
	CPUSeconds    float64 `json:"cpu_seconds"`        // CPU time, from each sandbox's cgroup
	MemoryGiBSec  float64 `json:"memory_gib_seconds"` // memory in use integrated over time
	DiskGiBHours  float64 `json:"disk_gib_hours"`     // the writable layer's size integrated over time
	DiskPeakBytes int64   `json:"disk_peak_bytes"`    // the largest writable layer seen
	SnapshotBytes int64   `json:"snapshot_bytes"`     // snapshots produced, packed
	EgressBytes   int64   `json:"egress_bytes"`       // sent out of the sandboxes' network namespaces
	FnCallCalls   int64   `json:"fncall_calls"`
}

// UsageGroup is one group of a UsageReport: its key (a project's path, a
// sandbox's ID, a node's name or a label's value; "" for sandboxes
// without the label) and its figures.
type UsageGroup struct {
	Key string `json:"key"`
	Usage
}

// UsageReport is what Usage returns: the groups by key, and their total.
type UsageReport struct {
	By     string       `json:"by"`
	Groups []UsageGroup `json:"groups"`
	Total  Usage        `json:"total"`
}

// UsageQuery selects what Usage adds up; zero fields select everything
// the token may see, by project.
type UsageQuery struct {
	// Project, when set, adds up that project's sandboxes and those of
	// the projects under it; unset, the token's project's.
	Project string
	// By groups: "project" (the default), "sandbox", "node" or
	// "label:KEY" ("label:run", "label:task"…).
	By string
	// Since and Until select the sandboxes alive in [Since, Until), each
	// counting whole; zero is open.
	Since, Until time.Time
}

func usageOf(u *dsecv1.UsageFigures) Usage {
	return Usage{Sandboxes: u.GetSandboxes(), CPUSeconds: float64(u.GetCpuUsec()) / 1e6, MemoryGiBSec: u.GetMemoryGibSeconds(),
		DiskGiBHours: u.GetDiskGibHours(), DiskPeakBytes: u.GetDiskPeakBytes(), SnapshotBytes: u.GetSnapshotBytes(),
		EgressBytes: u.GetEgressBytes(), FnCallCalls: u.GetFncallCalls()}
}

// Usage adds up the cost ledger: what the sandboxes q selects used,
// deleted ones included, grouped as q.By says.
func (c *Client) Usage(ctx context.Context, q UsageQuery) (*UsageReport, error) {
	m := &dsecv1.UsageRequest{Project: optPath(q.Project), By: q.By}
	if !q.Since.IsZero() {
		m.SinceUnixMs = q.Since.UnixMilli()
	}
	if !q.Until.IsZero() {
		m.UntilUnixMs = q.Until.UnixMilli()
	}
	r, err := iamCall(ctx, c, true, "usage", c.sb.Usage, m)
	if err != nil {
		return nil, err
	}
	out := &UsageReport{By: r.GetBy(), Groups: make([]UsageGroup, 0, len(r.GetGroups())), Total: usageOf(r.GetTotal())}
	for _, g := range r.GetGroups() {
		out.Groups = append(out.Groups, UsageGroup{Key: g.GetKey(), Usage: usageOf(g.GetUsage())})
	}
	return out, nil
}
