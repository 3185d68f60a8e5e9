package bench

// This file holds `dsec bench storage`: a burst of sandboxes over several
// real images, run once per layer mode (pre-cached, on-demand, on-demand on a
// fresh node with the traces the on-demand run published, eager, tar), and a
// mount-versus-extract micro-benchmark. It owns the report, its
// table, JSON and SVG, and the targets; storage_linux.go runs it.

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"dsec.dev/dsec/internal/errdefs"
)

// Modes of the bench, in the order it runs them: dsecd's layer modes, and
// traced.
const (
	ModeLocal    = "local" // pre-cached: the node's own copy of each layer file
	ModeOnDemand = "ondemand"
	// ModeTraced is on demand too, on a fresh node (its own empty root and
	// chunk cache) that finds in the blob store the access traces the
	// ondemand run published, and prefetches what they name.
	ModeTraced = "traced"
	ModeEager  = "eager"
	ModeTar    = "tar"
)

// AllStorageModes is the default --modes.
var AllStorageModes = []string{ModeLocal, ModeOnDemand, ModeTraced, ModeEager, ModeTar}

// layerMode is dsecd's --layer-mode for a bench mode.
func layerMode(mode string) string {
	if mode == ModeTraced {
		return ModeOnDemand
	}
	return mode
}

// StorageOptions size and place the storage benchmark.
type StorageOptions struct {
	Images      string   // directory of OCI image layouts (scripts/build-bench-images.sh)
	Sandboxes   int      // sandboxes in each burst
	Concurrency int      // sandboxes created and run at once
	Root        string   // scratch directory: one dsecd root per mode below it
	S3          string   // HOST:PORT of an S3 server; empty = directory blob store
	BlobDir     string   // directory blob store; default Root/blobs
	Bandwidth   int64    // blob store read cap, bytes per second; 0 = none
	ChunkSize   int64    // bytes per layer chunk in the blob store; 0 = dsecd's default
	Modes       []string // layer modes to run
	Dsecd       string   // dsecd binary
	Workspace   string   // tree for the mount-versus-extract figure; default from Images
	PortBase    int      // first TCP port for the daemons
	KeepRoots   bool     // leave each mode's root for inspection
	// NoPagePush runs the daemons with --no-page-push: every page of an
	// on-demand layer is then read through lazyfs, so IMAGE READ is what
	// the tasks read.
	NoPagePush bool
	// Rounds runs every mode this many times, the modes interleaved (all
	// of them once, then again), and reports each figure's median, so that
	// other work on the machine disturbs one burst rather than one mode; 0
	// or 1 = once.
	Rounds   int
	Progress io.Writer
}

// ModeResult is one burst.
type ModeResult struct {
	Mode            string  `json:"mode"`
	Sandboxes       int     `json:"sandboxes"`
	Errors          int     `json:"errors"`
	FirstError      string  `json:"first_error,omitempty"`
	BurstWallS      float64 `json:"burst_wall_s"`
	StepP50S        float64 `json:"step_p50_s"`
	StepMaxS        float64 `json:"step_max_s"`
	BytesFetched    int64   `json:"bytes_fetched"`
	FetchedMethod   string  `json:"bytes_fetched_method"`
	DiskWritten     int64   `json:"disk_written_bytes"`
	DiskMethod      string  `json:"disk_written_method"`
	RootGrowth      int64   `json:"root_growth_bytes"`
	ImageBytes      int64   `json:"image_bytes"`
	BytesRead       int64   `json:"bytes_read"`       // -1 when the mode cannot tell
	FractionRead    float64 `json:"fraction_read"`    // BytesRead / ImageBytes; -1 when unknown
	FractionFetched float64 `json:"fraction_fetched"` // BytesFetched / ImageBytes
	ImportS         float64 `json:"import_s"`         // importing the images (not part of the burst)
	// SettleS is how long the node took, after the imports, to stop
	// fetching (an on-demand node prefetching traces); the burst starts
	// then. About a second (the quiet time it waits for) when idle.
	SettleS float64 `json:"settle_s"`
	// CacheDiskWritten is the bytes the on-demand chunk cache wrote to its
	// disk tier over the burst (layer stats bytes_written_disk; part of
	// DiskWritten). -1 outside the on-demand modes.
	CacheDiskWritten int64 `json:"cache_disk_written_bytes"`
	// FetchedBeforeBurst is the bytes an on-demand node fetched while the
	// images were imported, before the burst: the chunks their traces
	// name, prefetched as it learnt of each layer. -1 outside those modes.
	FetchedBeforeBurst int64 `json:"bytes_fetched_before_burst"`
	// BytesPushed is the bytes lazyfs handed the kernel's page cache over
	// the burst unasked: the rest of each chunk a read took some of
	// (layer stats bytes_pushed). Reads of those pages never reach lazyfs,
	// so they are not in BytesRead. -1 outside the on-demand modes.
	BytesPushed int64 `json:"bytes_pushed"`
	// LazyfsCPUS is the CPU time (user and system) `dsecd lazyfs` used over
	// the burst: what serving the on-demand layer files cost the node's
	// cores. -1 outside the on-demand modes or when unknown.
	LazyfsCPUS float64 `json:"lazyfs_cpu_s"`
	// Traces counts the layers' access traces in the blob store: at the
	// start of a traced burst, or published by the end of an ondemand run.
	Traces int `json:"traces"`
	// TraceChunks is how many chunks those traces named, summed over the
	// layers; TraceChunksAdded, for a traced burst, how many more they
	// named once its node had published its own reads (0 when they only
	// repeat what the traces held).
	TraceChunks      int `json:"trace_chunks"`
	TraceChunksAdded int `json:"trace_chunks_added"`
	// Rounds lists each burst's own figures when the mode ran more than
	// once; the other figures are then medians (errors and sandboxes sums).
	Rounds  []RoundResult `json:"rounds,omitempty"`
	Skipped string        `json:"skipped,omitempty"` // why the mode did not run
	Note    string        `json:"note,omitempty"`
}

// RoundResult is one burst of a mode run several times.
type RoundResult struct {
	BurstWallS  float64 `json:"burst_wall_s"`
	DiskWritten int64   `json:"disk_written_bytes"`
	Errors      int     `json:"errors"`
	LazyfsCPUS  float64 `json:"lazyfs_cpu_s"`
	// TraceChunksAdded is the burst's ModeResult.TraceChunksAdded.
	TraceChunksAdded int `json:"trace_chunks_added,omitempty"`
}

// MergeRounds makes one result of a mode's bursts: the median of each
// figure over the bursts that ran, errors and sandboxes summed, the first
// error and notes kept, each burst listed in Rounds. One burst is returned
// as it is; if none ran, the first is.
func MergeRounds(rounds []ModeResult) ModeResult {
	var ran []ModeResult
	for _, r := range rounds {
		if r.Skipped == "" {
			ran = append(ran, r)
		}
	}
	if len(rounds) == 1 || len(ran) == 0 {
		return rounds[0]
	}
	out := ran[0]
	out.Sandboxes, out.Errors, out.Rounds = 0, 0, nil
	floats := func(f func(ModeResult) float64) float64 {
		xs := make([]float64, len(ran))
		for i, r := range ran {
			xs[i] = f(r)
		}
		return median(xs)
	}
	ints := func(f func(ModeResult) int64) int64 {
		return int64(math.Round(floats(func(r ModeResult) float64 { return float64(f(r)) })))
	}
	out.BurstWallS = floats(func(r ModeResult) float64 { return r.BurstWallS })
	out.StepP50S = floats(func(r ModeResult) float64 { return r.StepP50S })
	out.StepMaxS = floats(func(r ModeResult) float64 { return r.StepMaxS })
	out.ImportS = floats(func(r ModeResult) float64 { return r.ImportS })
	out.SettleS = floats(func(r ModeResult) float64 { return r.SettleS })
	out.LazyfsCPUS = floats(func(r ModeResult) float64 { return r.LazyfsCPUS })
	out.BytesFetched = ints(func(r ModeResult) int64 { return r.BytesFetched })
	out.FetchedBeforeBurst = ints(func(r ModeResult) int64 { return r.FetchedBeforeBurst })
	out.BytesPushed = ints(func(r ModeResult) int64 { return r.BytesPushed })
	out.DiskWritten = ints(func(r ModeResult) int64 { return r.DiskWritten })
	out.CacheDiskWritten = ints(func(r ModeResult) int64 { return r.CacheDiskWritten })
	out.RootGrowth = ints(func(r ModeResult) int64 { return r.RootGrowth })
	out.BytesRead = ints(func(r ModeResult) int64 { return r.BytesRead })
	out.Traces = int(ints(func(r ModeResult) int64 { return int64(r.Traces) }))
	out.TraceChunks = int(ints(func(r ModeResult) int64 { return int64(r.TraceChunks) }))
	out.TraceChunksAdded = int(ints(func(r ModeResult) int64 { return int64(r.TraceChunksAdded) }))
	if out.ImageBytes > 0 {
		out.FractionFetched = float64(out.BytesFetched) / float64(out.ImageBytes)
		if out.BytesRead >= 0 {
			out.FractionRead = float64(out.BytesRead) / float64(out.ImageBytes)
		}
	}
	for _, r := range rounds {
		if r.Skipped != "" {
			out.Note = strings.TrimSpace(out.Note + " one burst skipped: " + r.Skipped)
			continue
		}
		out.Sandboxes += r.Sandboxes
		out.Errors += r.Errors
		if out.FirstError == "" {
			out.FirstError = r.FirstError
		}
		out.Rounds = append(out.Rounds, RoundResult{BurstWallS: r.BurstWallS, DiskWritten: r.DiskWritten, Errors: r.Errors, LazyfsCPUS: r.LazyfsCPUS, TraceChunksAdded: r.TraceChunksAdded})
	}
	return out
}

// ImageInfo is one image of the burst.
type ImageInfo struct {
	Name         string  `json:"name"`
	Env          string  `json:"env"`
	Layers       int     `json:"layers"`
	Size         int64   `json:"size"` // sum of its layer files (EROFS) as dsecd reports them
	OCIBytes     int64   `json:"oci_uncompressed_bytes"`
	FractionRead float64 `json:"fraction_read"` // on demand; -1 when unknown
}

// MountResult is the mount-versus-extract figure.
type MountResult struct {
	Tree       string  `json:"tree"`
	TreeBytes  int64   `json:"tree_bytes"`
	Files      int     `json:"files"`
	ErofsBytes int64   `json:"erofs_bytes"`
	TarGzBytes int64   `json:"tar_gz_bytes"`
	MountS     float64 `json:"mount_s"`   // mount(2) of the EROFS file plus a first stat, median
	ExtractS   float64 `json:"extract_s"` // tar -xzf of the same tree, median
	Runs       int     `json:"runs"`
	Speedup    float64 `json:"speedup"` // ExtractS / MountS
	Skipped    string  `json:"skipped,omitempty"`
}

// Target is one goal of the issue, checked against baselines of the same run.
type Target struct {
	Name   string  `json:"name"`
	Ratio  float64 `json:"ratio"` // -1 when a figure is missing
	Goal   string  `json:"goal"`  // e.g. "<= 0.15"
	Pass   bool    `json:"pass"`
	Detail string  `json:"detail"`
}

// StorageReport is everything `dsec bench storage` prints.
type StorageReport struct {
	BlobStore   string       `json:"blob_store"`
	RemoteModel string       `json:"remote_model"`
	Bandwidth   int64        `json:"bandwidth_bytes_per_s"`
	Sandboxes   int          `json:"sandboxes"`
	Concurrency int          `json:"concurrency"`
	Rounds      int          `json:"rounds"` // bursts per mode; figures are medians when > 1
	Images      []ImageInfo  `json:"images"`
	Modes       []ModeResult `json:"modes"`
	Mount       MountResult  `json:"mount_vs_extract"`
	Targets     []Target     `json:"targets"`
	Notes       []string     `json:"notes,omitempty"`
}

// Mode returns the result of mode, or nil.
func (r *StorageReport) Mode(mode string) *ModeResult {
	for i := range r.Modes {
		if r.Modes[i].Mode == mode && r.Modes[i].Skipped == "" {
			return &r.Modes[i]
		}
	}
	return nil
}

// ComputeTargets fills r.Targets from the figures of the same run.
func (r *StorageReport) ComputeTargets() {
	local, od, eager := r.Mode(ModeLocal), r.Mode(ModeOnDemand), r.Mode(ModeEager)
	traced := r.Mode(ModeTraced)
	var ts []Target

	t := Target{Name: "on-demand fetches of image bytes", Goal: "<= 0.15", Ratio: -1}
	if od != nil && od.ImageBytes > 0 {
		t.Ratio = float64(od.BytesFetched) / float64(od.ImageBytes)
		t.Pass = t.Ratio <= 0.15
		t.Detail = fmt.Sprintf("%s fetched of %s", HumanBytes(od.BytesFetched), HumanBytes(od.ImageBytes))
	}
	ts = append(ts, t)

	// burst compares the burst wall times of modes a and b.
	burst := func(name, goal string, a, b *ModeResult, pass func(float64) bool) Target {
		t := Target{Name: name, Goal: goal, Ratio: -1}
		if a != nil && b != nil && b.BurstWallS > 0 {
			t.Ratio = a.BurstWallS / b.BurstWallS
			t.Pass = pass(t.Ratio)
			t.Detail = fmt.Sprintf("%.1f s vs %.1f s", a.BurstWallS, b.BurstWallS)
		}
		return t
	}
	// written compares the local disk writes of modes a and b.
	written := func(name, goal string, a, b *ModeResult, most float64) Target {
		t := Target{Name: name, Goal: goal, Ratio: -1}
		if a != nil && b != nil && b.DiskWritten > 0 && a.DiskWritten >= 0 {
			t.Ratio = float64(a.DiskWritten) / float64(b.DiskWritten)
			t.Pass = t.Ratio <= most
			t.Detail = fmt.Sprintf("%s vs %s", HumanBytes(a.DiskWritten), HumanBytes(b.DiskWritten))
		}
		return t
	}
	atMost := func(most float64) func(float64) bool { return func(x float64) bool { return x <= most } }
	ts = append(ts,
		burst("on-demand burst time / pre-cached", "<= 1.10", od, local, atMost(1.1)),
		burst("traced burst time / pre-cached", "<= 1.00", traced, local, atMost(1.0)),
		burst("eager burst time / on-demand", ">= 1.50", eager, od, func(x float64) bool { return x >= 1.5 }),
		written("on-demand disk writes / pre-cached", "<= 1.20", od, local, 1.2),
		written("on-demand disk writes / eager", "<= 0.50", od, eager, 0.5),
	)

	t = Target{Name: "tar.gz extract time / EROFS mount", Goal: ">= 10", Ratio: -1}
	if r.Mount.Skipped == "" && r.Mount.MountS > 0 {
		t.Ratio = r.Mount.ExtractS / r.Mount.MountS
		t.Pass = t.Ratio >= 10
		t.Detail = fmt.Sprintf("%.3f s vs %.3f s", r.Mount.ExtractS, r.Mount.MountS)
	}
	ts = append(ts, t)
	r.Targets = ts
}

// JSON writes the report as one JSON object.
func (r *StorageReport) JSON(w io.Writer) error { return writeJSON(w, r) }

// Print writes the report as tables.
func (r *StorageReport) Print(w io.Writer) {
	fmt.Fprintf(w, "blob store: %s\nremote store model: %s\n", r.BlobStore, r.RemoteModel)
	fmt.Fprintf(w, "burst: %d sandboxes over %d images, %d at a time", r.Sandboxes, len(r.Images), r.Concurrency)
	if r.Rounds > 1 {
		fmt.Fprintf(w, "; %d bursts per mode, the modes interleaved, figures are medians", r.Rounds)
	}
	fmt.Fprint(w, "\n\n")

	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "IMAGE\tENV\tLAYERS\tSIZE\tREAD ON DEMAND")
	for _, im := range r.Images {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\n", im.Name, im.Env, im.Layers, HumanBytes(im.Size), percent(im.FractionRead))
	}
	tw.Flush()
	fmt.Fprintln(w)

	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "MODE\tBURST WALL\tSTEP P50\tERRORS\tFETCHED\tFETCHED/IMAGE\tDISK WRITTEN\tBY THE CACHE\tROOT GROWTH\tIMAGE READ")
	for _, m := range r.Modes {
		if m.Skipped != "" {
			fmt.Fprintf(tw, "%s\tskipped\t-\t-\t-\t-\t-\t-\t-\t-\n", modeLabel(m.Mode))
			continue
		}
		fmt.Fprintf(tw, "%s\t%.1f s\t%.1f s\t%d/%d\t%s\t%s\t%s\t%s\t%s\t%s\n",
			modeLabel(m.Mode), m.BurstWallS, m.StepP50S, m.Errors, m.Sandboxes,
			HumanBytes(m.BytesFetched), percent(m.FractionFetched),
			HumanBytes(m.DiskWritten), HumanBytes(m.CacheDiskWritten), HumanBytes(m.RootGrowth), percent(m.FractionRead))
	}
	tw.Flush()
	for _, m := range r.Modes {
		if m.Skipped != "" {
			fmt.Fprintf(w, "  %s skipped: %s\n", m.Mode, m.Skipped)
		}
		if m.FirstError != "" {
			fmt.Fprintf(w, "  %s first error: %s\n", m.Mode, m.FirstError)
		}
		if m.Note != "" {
			fmt.Fprintf(w, "  %s: %s\n", m.Mode, m.Note)
		}
		if m.FetchedBeforeBurst > 0 {
			fmt.Fprintf(w, "  %s: %s fetched before the burst, while importing (traces prefetched, metadata found); settled %.1f s after the imports\n",
				m.Mode, HumanBytes(m.FetchedBeforeBurst), m.SettleS)
		}
		if m.LazyfsCPUS > 0 {
			fmt.Fprintf(w, "  %s: dsecd lazyfs used %.2f CPU-seconds over the burst\n", m.Mode, m.LazyfsCPUS)
		}
		if m.BytesPushed > 0 {
			fmt.Fprintf(w, "  %s: lazyfs pushed %s into the page cache (the rest of each chunk a read took some of; IMAGE READ counts only what reached lazyfs)\n",
				m.Mode, HumanBytes(m.BytesPushed))
		}
		if len(m.Rounds) > 1 {
			var walls, disks, cpus, added []string
			for _, b := range m.Rounds {
				walls = append(walls, fmt.Sprintf("%.1f", b.BurstWallS))
				disks = append(disks, HumanBytes(b.DiskWritten))
				cpus = append(cpus, fmt.Sprintf("%.2f", b.LazyfsCPUS))
				added = append(added, fmt.Sprint(b.TraceChunksAdded))
			}
			line := fmt.Sprintf("  %s bursts: wall %s s; disk written %s", m.Mode, strings.Join(walls, ", "), strings.Join(disks, ", "))
			if m.LazyfsCPUS > 0 {
				line += "; lazyfs CPU " + strings.Join(cpus, ", ") + " s"
			}
			if m.Mode == ModeTraced {
				line += "; trace chunks added " + strings.Join(added, ", ")
			}
			fmt.Fprintln(w, line)
		}
	}
	fmt.Fprintln(w)

	if r.Mount.Skipped != "" {
		fmt.Fprintf(w, "mount vs extract: skipped: %s\n\n", r.Mount.Skipped)
	} else {
		fmt.Fprintf(w, "mount vs extract (%s, %s in %d files; median of %d): EROFS mount+stat %.4f s, tar -xzf %.3f s\n\n",
			r.Mount.Tree, HumanBytes(r.Mount.TreeBytes), r.Mount.Files, r.Mount.Runs, r.Mount.MountS, r.Mount.ExtractS)
	}

	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "TARGET\tRATIO\tGOAL\tRESULT\tFIGURES")
	for _, t := range r.Targets {
		res, ratio := "MISS", "-"
		if t.Ratio >= 0 {
			ratio = fmt.Sprintf("%.3f", t.Ratio)
			if t.Pass {
				res = "PASS"
			}
		} else {
			res = "n/a"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", t.Name, ratio, t.Goal, res, t.Detail)
	}
	tw.Flush()
	if len(r.Notes) > 0 {
		fmt.Fprintln(w)
		for _, n := range r.Notes {
			fmt.Fprintln(w, "note:", n)
		}
	}
}

func modeLabel(mode string) string {
	if mode == ModeLocal {
		return "pre-cached"
	}
	if mode == ModeOnDemand {
		return "on-demand"
	}
	if mode == ModeTraced {
		return "on-demand, traced"
	}
	return mode
}

func percent(f float64) string {
	if f < 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f %%", 100*f)
}

// HumanBytes prints n in B, KB, MB or GB (powers of 1000).
func HumanBytes(n int64) string {
	if n < 0 {
		return "-"
	}
	switch {
	case n >= 1e9:
		return fmt.Sprintf("%.2f GB", float64(n)/1e9)
	case n >= 1e6:
		return fmt.Sprintf("%.1f MB", float64(n)/1e6)
	case n >= 1e3:
		return fmt.Sprintf("%.1f KB", float64(n)/1e3)
	}
	return fmt.Sprintf("%d B", n)
}

// ParseModes splits a --modes value and checks each name.
func ParseModes(s string) ([]string, error) {
	var out []string
	for _, m := range strings.Split(s, ",") {
		m = strings.TrimSpace(m)
		if m == "" {
			continue
		}
		switch m {
		case ModeLocal, ModeOnDemand, ModeTraced, ModeEager, ModeTar:
		case "pre-cached", "precached":
			m = ModeLocal
		case "on-demand":
			m = ModeOnDemand
		default:
			return nil, fmt.Errorf("parse modes: unknown mode %q (want local, ondemand, traced, eager, tar): %w", m, errdefs.ErrInvalidArgument)
		}
		out = append(out, m)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("parse modes: none given: %w", errdefs.ErrInvalidArgument)
	}
	return out, nil
}

// parseWriteSectors reads the sectors-written field (the 7th) of a
// /sys/block/DEV/stat line.
func parseWriteSectors(stat string) (int64, error) {
	f := strings.Fields(stat)
	if len(f) < 7 {
		return 0, fmt.Errorf("parse block stat %q: want at least 7 fields: %w", stat, errdefs.ErrInvalidArgument)
	}
	n, err := strconv.ParseInt(f[6], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("parse block stat: %w", err)
	}
	return n, nil
}

// median of xs (0 for none); xs is left sorted.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	slices.Sort(xs)
	if len(xs)%2 == 1 {
		return xs[len(xs)/2]
	}
	return (xs[len(xs)/2-1] + xs[len(xs)/2]) / 2
}
