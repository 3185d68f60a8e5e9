package bench

import (
	"bytes"
	"encoding/json"
	"encoding/xml"
	"errors"
	"io"
	"strings"
	"testing"

	"dsec.dev/dsec/internal/errdefs"
)

// sampleReport is a full run whose figures meet every target.
func sampleReport() *StorageReport {
	return &StorageReport{
		BlobStore:   "s3://dsec-bench/blobs?endpoint=127.0.0.1:8333&insecure=1",
		RemoteModel: "S3 server at 127.0.0.1:8333, reads capped at 125000000 B/s (1.00 Gbit/s)",
		Bandwidth:   125000000,
		Sandboxes:   64,
		Concurrency: 16,
		Images: []ImageInfo{
			{Name: "go", Env: "bench-go:latest", Layers: 2, Size: 1_000_000_000, FractionRead: 0.05},
			{Name: "java", Env: "bench-java:latest", Layers: 2, Size: 600_000_000, FractionRead: -1},
		},
		Modes: []ModeResult{
			{Mode: ModeLocal, Sandboxes: 64, BurstWallS: 100, DiskWritten: 1e8, ImageBytes: 8e9, BytesRead: -1, FractionRead: -1},
			{Mode: ModeOnDemand, Sandboxes: 64, BurstWallS: 105, BytesFetched: 8e8, DiskWritten: 1.1e8, CacheDiskWritten: 2e6, ImageBytes: 8e9, BytesRead: 4e8, FractionRead: 0.05, FractionFetched: 0.1},
			{Mode: ModeTraced, Sandboxes: 64, BurstWallS: 95, BytesFetched: 8.5e8, DiskWritten: 1.05e8, CacheDiskWritten: 0, ImageBytes: 8e9, BytesRead: 4e8, FractionRead: 0.05, FractionFetched: 0.106, Traces: 9, TraceChunks: 1060, TraceChunksAdded: 2, FetchedBeforeBurst: 3e8, BytesPushed: 6e8},
			{Mode: ModeEager, Sandboxes: 64, BurstWallS: 200, BytesFetched: 8e9, DiskWritten: 8e9, ImageBytes: 8e9, BytesRead: -1, FractionRead: -1, FractionFetched: 1},
			{Mode: ModeTar, Skipped: "dsecd exited"},
		},
		Mount: MountResult{Tree: "/src", TreeBytes: 1e8, Files: 8000, MountS: 0.04, ExtractS: 3, Runs: 3, Speedup: 75},
	}
}

func targetByName(t *testing.T, r *StorageReport, prefix string) Target {
	t.Helper()
	for _, tg := range r.Targets {
		if strings.HasPrefix(tg.Name, prefix) {
			return tg
		}
	}
	t.Fatalf("no target %q in %+v", prefix, r.Targets)
	return Target{}
}

func TestComputeTargets(t *testing.T) {
	tests := []struct {
		name   string
		modify func(r *StorageReport)
		target string
		ratio  float64 // -1 = missing
		pass   bool
	}{
		{"fetch fraction pass", nil, "on-demand fetches", 0.1, true},
		{"fetch fraction miss", func(r *StorageReport) { r.Modes[1].BytesFetched = 2e9 }, "on-demand fetches", 0.25, false},
		{"on-demand vs pre-cached pass", nil, "on-demand burst time", 1.05, true},
		{"on-demand vs pre-cached miss", func(r *StorageReport) { r.Modes[1].BurstWallS = 120 }, "on-demand burst time", 1.2, false},
		{"on-demand vs pre-cached at the goal", func(r *StorageReport) { r.Modes[1].BurstWallS = 110 }, "on-demand burst time", 1.1, true},
		{"traced vs pre-cached pass", nil, "traced burst time", 0.95, true},
		{"traced vs pre-cached miss", func(r *StorageReport) { r.Modes[2].BurstWallS = 101 }, "traced burst time", 1.01, false},
		{"no traced run", func(r *StorageReport) { r.Modes[2].Skipped = "x" }, "traced burst time", -1, false},
		{"eager vs on-demand pass", nil, "eager burst time", 200.0 / 105, true},
		{"eager vs on-demand miss", func(r *StorageReport) { r.Modes[3].BurstWallS = 120 }, "eager burst time", 120.0 / 105, false},
		{"disk writes vs eager pass", nil, "on-demand disk writes / eager", 1.1e8 / 8e9, true},
		{"disk writes vs eager miss", func(r *StorageReport) { r.Modes[1].DiskWritten = 5e9 }, "on-demand disk writes / eager", 5e9 / 8e9, false},
		{"disk writes vs pre-cached pass", nil, "on-demand disk writes / pre-cached", 1.1, true},
		{"disk writes vs pre-cached at the goal", func(r *StorageReport) { r.Modes[1].DiskWritten = 1.2e8 }, "on-demand disk writes / pre-cached", 1.2, true},
		{"disk writes vs pre-cached miss", func(r *StorageReport) { r.Modes[1].DiskWritten = 1.25e9 }, "on-demand disk writes / pre-cached", 12.5, false},
		{"disk writes unmeasured", func(r *StorageReport) { r.Modes[0].DiskWritten = -1 }, "on-demand disk writes / pre-cached", -1, false},
		{"mount vs extract pass", nil, "tar.gz extract", 75, true},
		{"mount vs extract miss", func(r *StorageReport) { r.Mount.ExtractS = 0.2 }, "tar.gz extract", 5, false},
		{"no pre-cached run", func(r *StorageReport) { r.Modes = r.Modes[1:] }, "on-demand burst time", -1, false},
		{"skipped eager", func(r *StorageReport) { r.Modes[3].Skipped = "x" }, "eager burst time", -1, false},
		{"skipped mount", func(r *StorageReport) { r.Mount.Skipped = "no mkfs.erofs" }, "tar.gz extract", -1, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := sampleReport()
			if tt.modify != nil {
				tt.modify(r)
			}
			r.ComputeTargets()
			if len(r.Targets) != 7 {
				t.Fatalf("got %d targets, want 7", len(r.Targets))
			}
			got := targetByName(t, r, tt.target)
			if tt.ratio < 0 {
				if got.Ratio >= 0 || got.Pass {
					t.Fatalf("target %q = %+v, want missing", tt.target, got)
				}
				return
			}
			if d := got.Ratio - tt.ratio; d > 1e-9 || d < -1e-9 {
				t.Errorf("ratio = %v, want %v", got.Ratio, tt.ratio)
			}
			if got.Pass != tt.pass {
				t.Errorf("pass = %v, want %v (%+v)", got.Pass, tt.pass, got)
			}
		})
	}
}

func TestStoragePrint(t *testing.T) {
	r := sampleReport()
	r.Modes[1].FirstError = "go: step failed"
	r.Modes[0].Note = "a note"
	r.Notes = []string{"hello note"}
	r.ComputeTargets()
	var b bytes.Buffer
	r.Print(&b)
	out := b.String()
	for _, want := range []string{
		"remote store model: S3 server at 127.0.0.1:8333, reads capped at 125000000 B/s (1.00 Gbit/s)",
		"pre-cached", "on-demand", "on-demand, traced", "eager", "tar skipped: dsecd exited",
		"100.0 s", "105.0 s", "95.0 s", "800.0 MB", "8.00 GB", "10.0 %", "5.0 %", "2.0 MB",
		"traced: 300.0 MB fetched before the burst, while importing",
		"traced: lazyfs pushed 600.0 MB into the page cache",
		"PASS", "go: step failed", "a note", "note: hello note",
		"EROFS mount+stat 0.0400 s, tar -xzf 3.000 s",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "MISS") {
		t.Errorf("sample report should meet every measured target:\n%s", out)
	}
	r.Modes[3].BurstWallS = 110
	r.Mount.Skipped = "mkfs.erofs not found"
	r.ComputeTargets()
	b.Reset()
	r.Print(&b)
	for _, want := range []string{"MISS", "n/a", "mount vs extract: skipped: mkfs.erofs not found"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, b.String())
		}
	}
}

func TestStorageJSON(t *testing.T) {
	r := sampleReport()
	r.ComputeTargets()
	var b bytes.Buffer
	if err := r.JSON(&b); err != nil {
		t.Fatal(err)
	}
	var back StorageReport
	if err := json.Unmarshal(b.Bytes(), &back); err != nil {
		t.Fatalf("round trip: %v", err)
	}
	if back.Mode(ModeOnDemand).BytesFetched != 8e8 || back.Mode(ModeTraced).Traces != 9 || back.Mode(ModeTraced).TraceChunksAdded != 2 || len(back.Targets) != 7 {
		t.Errorf("round trip lost figures: %+v", back)
	}
	dec := json.NewDecoder(&b)
	var got map[string]any
	if err := dec.Decode(&got); err != nil {
		t.Fatalf("decode: %v", err)
	}
	if err := dec.Decode(new(any)); !errors.Is(err, io.EOF) {
		t.Fatalf("want exactly one JSON object, second decode: %v", err)
	}
	for _, k := range []string{"blob_store", "remote_model", "bandwidth_bytes_per_s", "images", "modes", "mount_vs_extract", "targets"} {
		if _, ok := got[k]; !ok {
			t.Errorf("JSON lacks %q", k)
		}
	}
	modes := got["modes"].([]any)
	od := modes[1].(map[string]any)
	for _, k := range []string{"burst_wall_s", "bytes_fetched", "disk_written_bytes", "cache_disk_written_bytes", "fraction_read", "fraction_fetched", "traces"} {
		if _, ok := od[k]; !ok {
			t.Errorf("mode JSON lacks %q", k)
		}
	}
}

func TestStorageSVG(t *testing.T) {
	r := sampleReport()
	r.ComputeTargets()
	var b bytes.Buffer
	if err := r.SVG(&b); err != nil {
		t.Fatal(err)
	}
	// Well-formed XML with an svg root.
	dec := xml.NewDecoder(bytes.NewReader(b.Bytes()))
	rects, root := 0, ""
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("SVG is not well-formed XML: %v\n%s", err, b.String())
		}
		if se, ok := tok.(xml.StartElement); ok {
			if root == "" {
				root = se.Name.Local
			}
			if se.Name.Local == "rect" {
				rects++
			}
		}
	}
	if root != "svg" {
		t.Fatalf("root element %q, want svg", root)
	}
	// Background, four legend boxes, four panels of four bars (tar skipped).
	if want := 1 + 4 + 4*4; rects != want {
		t.Errorf("got %d rects, want %d", rects, want)
	}
	for _, want := range []string{"burst wall time", "fetched from blob store", "written to local disk", "image bytes read", "1.00 Gbit/s", "n/a", "PASS", "tar.gz extract time / EROFS mount"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("SVG lacks %q", want)
		}
	}
}

func TestParseModes(t *testing.T) {
	tests := []struct {
		in      string
		want    []string
		wantErr bool
	}{
		{"local,ondemand,traced,eager,tar", []string{"local", "ondemand", "traced", "eager", "tar"}, false},
		{" on-demand , pre-cached", []string{"ondemand", "local"}, false},
		{"eager", []string{"eager"}, false},
		{"", nil, true},
		{"lazy", nil, true},
	}
	for _, tt := range tests {
		got, err := ParseModes(tt.in)
		if tt.wantErr {
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("ParseModes(%q) err = %v, want invalid argument", tt.in, err)
			}
			continue
		}
		if err != nil || strings.Join(got, ",") != strings.Join(tt.want, ",") {
			t.Errorf("ParseModes(%q) = %v, %v; want %v", tt.in, got, err, tt.want)
		}
	}
}

func TestParseWriteSectors(t *testing.T) {
	n, err := parseWriteSectors("  123 4 5678 90 4242 7 987654 321 0 100 200 0 0 0 0 0 0\n")
	if err != nil || n != 987654 {
		t.Fatalf("parseWriteSectors = %d, %v; want 987654", n, err)
	}
	if _, err := parseWriteSectors("1 2 3"); err == nil {
		t.Fatal("short line: want an error")
	}
	if _, err := parseWriteSectors("1 2 3 4 5 6 x"); err == nil {
		t.Fatal("non-number: want an error")
	}
}

func TestMedianAndHumanBytes(t *testing.T) {
	if got := median([]float64{3, 1, 2}); got != 2 {
		t.Errorf("median odd = %v", got)
	}
	if got := median([]float64{4, 1, 2, 3}); got != 2.5 {
		t.Errorf("median even = %v", got)
	}
	if got := median(nil); got != 0 {
		t.Errorf("median empty = %v", got)
	}
	for n, want := range map[int64]string{-1: "-", 12: "12 B", 1500: "1.5 KB", 22_000_000: "22.0 MB", 1_360_000_000: "1.36 GB"} {
		if got := HumanBytes(n); got != want {
			t.Errorf("HumanBytes(%d) = %q, want %q", n, got, want)
		}
	}
}

func TestMergeRounds(t *testing.T) {
	burst := func(wall float64, disk int64, errs int) ModeResult {
		return ModeResult{Mode: ModeOnDemand, Sandboxes: 64, Errors: errs, BurstWallS: wall, DiskWritten: disk,
			BytesFetched: int64(wall * 1e7), ImageBytes: 1e9, BytesRead: 1e8, CacheDiskWritten: 0, Traces: 9,
			TraceChunks: 1000 + int(wall), TraceChunksAdded: int(wall)}
	}
	one := burst(10, 1e8, 0)
	if got := MergeRounds([]ModeResult{one}); got.BurstWallS != 10 || got.Rounds != nil {
		t.Errorf("one burst: %+v, want it as it is", got)
	}
	bad := burst(0, 0, 0)
	bad.Skipped = "dsecd exited"
	got := MergeRounds([]ModeResult{burst(30, 3e8, 1), bad, burst(10, 1e8, 0), burst(20, 5e8, 2)})
	if got.BurstWallS != 20 || got.DiskWritten != 3e8 || got.BytesFetched != 2e8 || got.FractionFetched != 0.2 || got.FractionRead != 0.1 ||
		got.TraceChunks != 1020 || got.TraceChunksAdded != 20 {
		t.Errorf("medians: %+v", got)
	}
	if got.Sandboxes != 192 || got.Errors != 3 || len(got.Rounds) != 3 || got.Rounds[1] != (RoundResult{BurstWallS: 10, DiskWritten: 1e8, TraceChunksAdded: 10}) {
		t.Errorf("sums and bursts: %+v", got)
	}
	if !strings.Contains(got.Note, "one burst skipped: dsecd exited") || got.Skipped != "" {
		t.Errorf("note %q, skipped %q", got.Note, got.Skipped)
	}
	if all := MergeRounds([]ModeResult{bad, bad}); all.Skipped == "" {
		t.Error("no burst ran, yet the mode is not skipped")
	}

	r := sampleReport()
	r.Rounds = 3
	r.Modes[1] = got
	r.ComputeTargets()
	var b bytes.Buffer
	r.Print(&b)
	for _, want := range []string{"3 bursts per mode, the modes interleaved, figures are medians", "ondemand bursts: wall 30.0, 10.0, 20.0 s; disk written 300.0 MB, 100.0 MB, 500.0 MB"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, b.String())
		}
	}
}
