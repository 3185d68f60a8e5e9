package sandboxpage

import (
	"math"
	"slices"
	"strings"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/iam"
)

// Tally sums a query's matches by project (edgev1.ListRequest's tally):
// a node answers a quota sweep with a few numbers a project instead of
// every sandbox's record.
type Tally map[string]*edgev1.ProjectTally

// Add counts sb in its project's tally.
func (t Tally) Add(sb *dsecv1.Sandbox) {
	spec := sb.GetSpec()
	project := spec.GetLabels()[iam.ProjectLabel]
	p := t[project]
	if p == nil {
		p = &edgev1.ProjectTally{Project: project}
		t[project] = p
	}
	p.Sandboxes++
	cpu, mem, disk := Asks(spec)
	if cpu > 0 {
		p.MilliCpus += cpu
	} else {
		p.CpusUnset++
	}
	if mem > 0 {
		p.MemoryMb += mem
	} else {
		p.MemoryUnset++
	}
	if disk > 0 {
		p.DiskMb += disk
	} else {
		p.DiskUnset++
	}
}

// Asks is what spec asks of a node as a quota counts it: its CPUs × 1000,
// rounded up, its memory and its disk in MiB; 0 or less where it asks
// nothing (a charge then counts its default).
func Asks(spec *dsecv1.SandboxSpec) (milliCPUs, memoryMB, diskMB int64) {
	return int64(math.Ceil(spec.GetCpus() * 1000)), spec.GetMemoryMb(), spec.GetDiskMb()
}

// List is the tallies, by project.
func (t Tally) List() []*edgev1.ProjectTally {
	out := make([]*edgev1.ProjectTally, 0, len(t))
	for _, p := range t {
		out = append(out, p)
	}
	slices.SortFunc(out, func(a, b *edgev1.ProjectTally) int { return strings.Compare(a.GetProject(), b.GetProject()) })
	return out
}
