package bench

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/edge/lazyd"
	"dsec.dev/dsec/internal/errdefs"
	dsec "dsec.dev/dsec/sdk/go"
)

// stepTimeout bounds one sandbox's step.
const stepTimeout = 15 * time.Minute

// benchImage is one image layout of --images.
type benchImage struct {
	name string // directory name, e.g. go
	dir  string
	env  string // environment it is imported as
	// ociBytes is the uncompressed size of its OCI layers.
	ociBytes int64
}

// RunStorage runs the storage benchmark: per mode a fresh dsecd on its own
// root, the images imported, page cache dropped, the burst, the figures,
// then teardown; then the mount-versus-extract figure.
func RunStorage(ctx context.Context, log *slog.Logger, o StorageOptions) (*StorageReport, error) {
	if os.Geteuid() != 0 {
		return nil, fmt.Errorf("run storage bench: needs root (dsecd, mounts, drop_caches): %w", errdefs.ErrPermissionDenied)
	}
	images, err := findImages(o.Images)
	if err != nil {
		return nil, err
	}
	if o.Sandboxes <= 0 {
		o.Sandboxes = 64
	}
	if o.Concurrency <= 0 {
		o.Concurrency = 16
	}
	if o.PortBase == 0 {
		o.PortBase = 17600
	}
	if len(o.Modes) == 0 {
		o.Modes = AllStorageModes
	}
	if err := os.MkdirAll(o.Root, 0o755); err != nil {
		return nil, fmt.Errorf("run storage bench: %w", err)
	}
	rep := &StorageReport{Sandboxes: o.Sandboxes, Concurrency: o.Concurrency, Bandwidth: o.Bandwidth}
	for _, im := range images {
		rep.Images = append(rep.Images, ImageInfo{Name: im.name, Env: im.env, FractionRead: -1, OCIBytes: im.ociBytes})
	}
	capText := "no bandwidth cap"
	if o.Bandwidth > 0 {
		capText = fmt.Sprintf("reads capped at %d B/s (%.2f Gbit/s)", o.Bandwidth, float64(o.Bandwidth)*8/1e9)
	}
	switch {
	case o.S3 != "":
		prefix := "blobs"
		if o.ChunkSize > 0 {
			// A layer keeps the chunking it was first published with.
			prefix = fmt.Sprintf("blobs-%d", o.ChunkSize)
		}
		rep.BlobStore = "s3://dsec-bench/" + prefix + "?endpoint=" + o.S3 + "&insecure=1"
		rep.RemoteModel = "S3 server at " + o.S3 + ", " + capText
	default:
		if o.BlobDir == "" {
			o.BlobDir = filepath.Join(o.Root, "blobs")
		}
		if err := os.MkdirAll(o.BlobDir, 0o755); err != nil {
			return nil, fmt.Errorf("run storage bench: %w", err)
		}
		rep.BlobStore = o.BlobDir
		rep.RemoteModel = "directory blob store (no S3 server given), " + capText
		rep.Notes = append(rep.Notes, "no --s3 given: the remote store is modelled by a directory blob store with dsecd's --blob-bandwidth cap")
	}

	if o.NoPagePush {
		rep.Notes = append(rep.Notes, "--no-page-push: lazyfs hands the kernel only the pages it asks for, so IMAGE READ is what the tasks read")
	}
	rep.Rounds = max(o.Rounds, 1)
	bursts := make([][]ModeResult, len(o.Modes))
	infos := make([]map[string]*dsecv1.EnvironmentUsage, len(o.Modes))
	for round := range rep.Rounds {
		for i, mode := range o.Modes {
			progress(o.Progress, "== mode %s (round %d of %d)", mode, round+1, rep.Rounds)
			noteTraces := prepareTraces(ctx, rep.BlobStore, mode)
			res, info := runMode(ctx, log, o, rep.BlobStore, mode, o.PortBase+i, images)
			noteTraces(&res)
			bursts[i] = append(bursts[i], res)
			if infos[i] == nil && res.Skipped == "" {
				infos[i] = info
			}
			if res.Skipped == "" {
				progress(o.Progress, "   %s: wall %.1f s, fetched %s, disk written %s, root growth %s, read %s, errors %d",
					mode, res.BurstWallS, HumanBytes(res.BytesFetched), HumanBytes(res.DiskWritten), HumanBytes(res.RootGrowth), percent(res.FractionRead), res.Errors)
			}
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
		}
	}
	for i, mode := range o.Modes {
		res, info := MergeRounds(bursts[i]), infos[i]
		rep.Modes = append(rep.Modes, res)
		if mode == ModeOnDemand && res.Skipped == "" {
			for j := range rep.Images {
				if e, ok := info[rep.Images[j].Env]; ok {
					rep.Images[j].Layers = len(e.GetLayerDigests())
					rep.Images[j].Size = e.GetSize()
					if e.GetSize() > 0 {
						rep.Images[j].FractionRead = float64(e.GetBytesRead()) / float64(e.GetSize())
					}
				}
			}
		} else if rep.Images[0].Size == 0 {
			for j := range rep.Images {
				if e, ok := info[rep.Images[j].Env]; ok {
					rep.Images[j].Layers = len(e.GetLayerDigests())
					rep.Images[j].Size = e.GetSize()
				}
			}
		}
	}

	progress(o.Progress, "== mount vs extract")
	rep.Mount = mountVsExtract(ctx, o, images)
	rep.ComputeTargets()
	rep.Notes = append(rep.Notes,
		"bytes fetched: dsecd's layer stats (bytes_fetched) over the burst; where the mode reports none, the bytes of the layer files it pulled into its root (see bytes_fetched_method)",
		"disk written: write sectors of the block device holding --root (/sys/dev/block), over the burst plus a final sync; other processes on the machine add to it",
		"image read: the kernel's reads through the on-demand layer files (on-demand only), over the sum of the images' distinct layer sizes")
	return rep, nil
}

// findImages lists the OCI layouts under dir.
func findImages(dir string) ([]benchImage, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("find images: %w", err)
	}
	var out []benchImage
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), ".") {
			continue
		}
		d := filepath.Join(dir, e.Name())
		if _, err := os.Stat(filepath.Join(d, "index.json")); err != nil {
			continue
		}
		out = append(out, benchImage{name: e.Name(), dir: d, env: "bench-" + e.Name() + ":latest", ociBytes: ociUncompressed(d)})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("find images: no OCI layout under %s (run scripts/build-bench-images.sh): %w", dir, errdefs.ErrNotFound)
	}
	return out, nil
}

// runMode runs one burst; errors land in the result's Skipped.
func runMode(ctx context.Context, log *slog.Logger, o StorageOptions, store, mode string, port int, images []benchImage) (ModeResult, map[string]*dsecv1.EnvironmentUsage) {
	res := ModeResult{Mode: mode, Sandboxes: o.Sandboxes, BytesRead: -1, FractionRead: -1, CacheDiskWritten: -1, FetchedBeforeBurst: -1, BytesPushed: -1}
	onDemand := layerMode(mode) == ModeOnDemand
	root := filepath.Join(o.Root, "root-"+mode)
	skip := func(err error) (ModeResult, map[string]*dsecv1.EnvironmentUsage) {
		res.Skipped = err.Error()
		log.Warn("storage bench mode skipped", "mode", mode, "err", err)
		return res, nil
	}
	teardown(ctx, o.Dsecd, root)
	if err := os.RemoveAll(root); err != nil {
		return skip(fmt.Errorf("clean root: %w", err))
	}
	if err := os.MkdirAll(root, 0o755); err != nil {
		return skip(fmt.Errorf("make root: %w", err))
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	args := []string{"--root", root, "--listen", addr, "--node", "bench-" + mode, "--no-network",
		"--blob-store", store, "--layer-mode", layerMode(mode)}
	if o.Bandwidth > 0 {
		args = append(args, "--blob-bandwidth", strconv.FormatInt(o.Bandwidth, 10))
	}
	if o.ChunkSize > 0 {
		args = append(args, "--chunk-size", strconv.FormatInt(o.ChunkSize, 10))
	}
	if mode == ModeTar {
		args = append(args, "--layer-tars")
	}
	if o.NoPagePush {
		args = append(args, "--no-page-push")
	}
	logFile, err := os.Create(filepath.Join(o.Root, mode+".dsecd.log"))
	if err != nil {
		return skip(fmt.Errorf("open daemon log: %w", err))
	}
	defer logFile.Close()
	d := exec.Command(o.Dsecd, args...)
	d.Stdout, d.Stderr = logFile, logFile
	d.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := d.Start(); err != nil {
		return skip(fmt.Errorf("start dsecd: %w", err))
	}
	exited := make(chan error, 1)
	go func() { exited <- d.Wait() }()
	defer func() {
		stopDaemon(d, exited)
		teardown(context.WithoutCancel(ctx), o.Dsecd, root)
		if !o.KeepRoots {
			os.RemoveAll(root)
		}
	}()

	// The Unix socket needs no token (the TCP port would).
	c, err := dsec.Dial("unix://"+filepath.Join(root, "dsecd.sock"), dsec.DialOptions{})
	if err != nil {
		return skip(err)
	}
	if err := waitReady(ctx, c, exited); err != nil {
		return skip(fmt.Errorf("start dsecd (log %s): %w", logFile.Name(), err))
	}

	t0 := time.Now()
	envLayers := map[string][]string{}
	for _, im := range images {
		progress(o.Progress, "   import %s", im.env)
		digests, err := importImage(ctx, c, im)
		if err != nil {
			return skip(err)
		}
		envLayers[im.env] = digests
	}
	res.ImportS = time.Since(t0).Seconds()
	// What the imports started in the background (an on-demand node
	// prefetching what the layers' traces name) ends before the burst, as
	// a pre-cached node's import has its layer files written by then.
	settle, err := waitSettled(ctx, c)
	if err != nil {
		return skip(err)
	}
	res.SettleS = settle.Seconds()

	before, err := layerStats(ctx, c)
	if err != nil {
		return skip(err)
	}
	if onDemand {
		// The daemon is fresh: what it fetched so far, it fetched importing.
		res.FetchedBeforeBurst = statsDelta(&dsecv1.LayerStatsResponse{}, before, images).fetched
	}
	rootBefore := treeBytes(root)
	dev, devErr := blockDevice(root)
	if err := dropCaches(); err != nil {
		return skip(err)
	}
	var sectorsBefore int64
	if devErr == nil {
		sectorsBefore, devErr = writeSectors(dev)
	}

	// A tar burst extracts every image once per sandbox; when the disk
	// cannot hold them all, each sandbox is deleted right after its step.
	deleteEach := false
	if mode == ModeTar {
		need := int64(0)
		layerSize := map[string]int64{}
		for _, l := range before.GetLayers() {
			layerSize[l.GetDigest()] = l.GetSize()
		}
		for i := 0; i < o.Sandboxes; i++ {
			digests := envLayers[images[i%len(images)].env]
			if len(digests) == 0 {
				need += images[i%len(images)].ociBytes // not told: the OCI layers' uncompressed size
			}
			for _, d := range digests {
				need += layerSize[d]
			}
		}
		var fs unix.Statfs_t
		if unix.Statfs(root, &fs) == nil {
			avail := int64(fs.Bavail) * fs.Bsize
			// Leave at least half the free space to everything else.
			if need > avail/2-5e9 {
				deleteEach = true
				res.Note = fmt.Sprintf("each sandbox deleted right after its step: %s free, the extractions need %s", HumanBytes(avail), HumanBytes(need))
			}
		}
	}

	progress(o.Progress, "   burst of %d sandboxes, %d at a time", o.Sandboxes, o.Concurrency)
	lazyDir := filepath.Join(root, "lazy")
	cpuBefore, cpuErr := lazyd.CPUTime(lazyDir)
	ids, steps, errs, wall := burst(ctx, c, o, images, deleteEach)
	res.BurstWallS = wall.Seconds()
	res.LazyfsCPUS = -1
	if cpuAfter, err := lazyd.CPUTime(lazyDir); onDemand && cpuErr == nil && err == nil {
		res.LazyfsCPUS = (cpuAfter - cpuBefore).Seconds()
	}

	unix.Sync()
	if devErr == nil {
		var after int64
		if after, devErr = writeSectors(dev); devErr == nil {
			res.DiskWritten = (after - sectorsBefore) * 512
			res.DiskMethod = "write sectors of " + dev
		}
	}
	if devErr != nil {
		res.DiskWritten = -1
		res.DiskMethod = "unavailable: " + devErr.Error()
	}
	res.RootGrowth = treeBytes(root) - rootBefore

	after, err := layerStats(ctx, c)
	if err != nil {
		return skip(err)
	}
	delta := statsDelta(before, after, images)
	fetched, read, imageBytes := delta.fetched, delta.read, delta.imageBytes
	res.ImageBytes = imageBytes
	res.BytesFetched = fetched
	res.FetchedMethod = "dsecd layer stats bytes_fetched"
	envs := envDelta(before, after)
	if mode == ModeTar {
		// Tar mode streams each layer's tar.gz from the blob store once
		// per sandbox; layer stats do not count that.
		if n, err := tarFetched(ctx, store, envs); err == nil {
			res.BytesFetched = n
			res.FetchedMethod = "per sandbox started, the size of the tar.gz of each of its layers in the blob store (tar mode streams them per sandbox)"
		} else {
			res.Note = strings.TrimSpace(res.Note + " tar sizes unavailable: " + err.Error())
		}
	} else if fetched == 0 && mode != ModeLocal {
		res.BytesFetched = treeBytes(filepath.Join(root, "layers-"+mode)) - treeBytes(filepath.Join(root, "layers-"+mode, "tar"))
		res.FetchedMethod = "bytes of the layer files pulled under the root's layers-" + mode + " (layer stats report none)"
	}
	if onDemand {
		res.BytesRead = read
		if imageBytes > 0 {
			res.FractionRead = float64(read) / float64(imageBytes)
		}
		res.CacheDiskWritten = delta.cacheWritten
		res.BytesPushed = delta.pushed
	}
	if imageBytes > 0 {
		res.FractionFetched = float64(res.BytesFetched) / float64(imageBytes)
	}
	slices.Sort(steps)
	if len(steps) > 0 {
		res.StepP50S = steps[len(steps)/2].Seconds()
		res.StepMaxS = steps[len(steps)-1].Seconds()
	}
	res.Errors = len(errs)
	if len(errs) > 0 {
		res.FirstError = errs[0].Error()
	}
	progress(o.Progress, "   %.1f s, %d errors; deleting sandboxes", res.BurstWallS, res.Errors)
	deleteAll(c, ids)

	return res, envs
}

// burst runs o.Sandboxes sandboxes round-robin over images, each running
// /bench/step.sh, o.Concurrency at a time.
func burst(ctx context.Context, c *dsec.Conn, o StorageOptions, images []benchImage, deleteEach bool) ([]string, []time.Duration, []error, time.Duration) {
	var mu sync.Mutex
	var ids []string
	var steps []time.Duration
	var errs []error
	sem := make(chan struct{}, o.Concurrency)
	var wg sync.WaitGroup
	start := time.Now()
	for i := 0; i < o.Sandboxes; i++ {
		im := images[i%len(images)]
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			t0 := time.Now()
			id, err := createAndStep(ctx, c, im.env)
			d := time.Since(t0)
			if deleteEach && id != "" {
				_, _ = c.Sandboxes.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: id}))
				id = ""
			}
			mu.Lock()
			defer mu.Unlock()
			if id != "" {
				ids = append(ids, id)
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", im.name, err))
				return
			}
			steps = append(steps, d)
		}()
	}
	wg.Wait()
	return ids, steps, errs, time.Since(start)
}

func createAndStep(ctx context.Context, c *dsec.Conn, env string) (string, error) {
	resp, err := c.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{
		Spec:        &dsecv1.SandboxSpec{Environment: env, MemoryMb: 2048, IdleTimeoutSeconds: -1, TtlSeconds: 7200},
		WaitSeconds: 600,
	}))
	if err != nil {
		return "", fmt.Errorf("create sandbox: %w", err)
	}
	if len(resp.Msg.GetSandboxes()) == 0 {
		return "", fmt.Errorf("create sandbox: no sandbox returned")
	}
	id := resp.Msg.GetSandboxes()[0].GetId()
	stream, err := c.Sandboxes.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{
		SandboxId: id, Argv: []string{"/bin/sh", "/bench/step.sh"}, TimeoutSeconds: stepTimeout.Seconds(),
	}))
	if err != nil {
		return id, fmt.Errorf("exec step: %w", err)
	}
	defer stream.Close()
	var x *dsecv1.ExecExited
	var stderr []byte
	for stream.Receive() {
		if e := stream.Msg().GetExited(); e != nil {
			x = e
		}
		if b := stream.Msg().GetStderr(); len(b) > 0 && len(stderr) < 2048 {
			stderr = append(stderr, b...)
		}
	}
	if err := stream.Err(); err != nil {
		return id, fmt.Errorf("exec step: %w", err)
	}
	if x.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_OK {
		return id, fmt.Errorf("step in %s: %s %s: %s", id, x.GetStatus(), x.GetMessage(), lastLine(string(stderr)))
	}
	return id, nil
}

func lastLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		return s[i+1:]
	}
	return s
}

// importImage imports im and returns its layer digests, bottom first.
func importImage(ctx context.Context, c *dsec.Conn, im benchImage) ([]string, error) {
	stream, err := c.Layers.ImportImage(ctx, connect.NewRequest(&dsecv1.ImportImageRequest{
		Ref: im.env, Source: "oci:" + im.dir, CollapseBelowBytes: -1, AllowSetuid: true,
	}))
	if err != nil {
		return nil, fmt.Errorf("import %s: %w", im.env, err)
	}
	defer stream.Close()
	done := false
	var digests []string
	for stream.Receive() {
		if stream.Msg().GetDone() {
			done = true
			digests = stream.Msg().GetLayerDigests()
		}
	}
	if err := stream.Err(); err != nil {
		return nil, fmt.Errorf("import %s: %w", im.env, err)
	}
	if !done {
		return nil, fmt.Errorf("import %s: stream ended before done", im.env)
	}
	return digests, nil
}

func layerStats(ctx context.Context, c *dsec.Conn) (*dsecv1.LayerStatsResponse, error) {
	resp, err := c.Layers.LayerStats(ctx, connect.NewRequest(&dsecv1.LayerStatsRequest{}))
	if err != nil {
		return nil, fmt.Errorf("layer stats: %w", err)
	}
	return resp.Msg, nil
}

// layerDelta is what the layer stats counted over a burst.
type layerDelta struct {
	fetched, read int64
	pushed        int64 // into the kernel's page cache, unasked
	imageBytes    int64 // the sum of the distinct layer sizes of the bench images
	cacheWritten  int64 // by the chunk cache to its disk tier
}

// statsDelta returns what the layer stats counted between two readings.
func statsDelta(before, after *dsecv1.LayerStatsResponse, images []benchImage) layerDelta {
	var d layerDelta
	prev := map[string]*dsecv1.LayerUsage{}
	for _, l := range before.GetLayers() {
		prev[l.GetDigest()] = l
	}
	wanted := map[string]bool{}
	for _, im := range images {
		wanted[im.env] = true
	}
	used := map[string]bool{}
	for _, e := range after.GetEnvironments() {
		if wanted[e.GetName()] {
			for _, d := range e.GetLayerDigests() {
				used[d] = true
			}
		}
	}
	for _, l := range after.GetLayers() {
		p := prev[l.GetDigest()]
		d.fetched += l.GetBytesFetched() - p.GetBytesFetched()
		d.read += l.GetBytesRead() - p.GetBytesRead()
		d.pushed += l.GetBytesPushed() - p.GetBytesPushed()
		d.cacheWritten += l.GetBytesWrittenDisk() - p.GetBytesWrittenDisk()
		if used[l.GetDigest()] {
			d.imageBytes += l.GetSize()
		}
	}
	return d
}

// prepareTraces readies the blob store's access traces for a burst of mode
// (an ondemand burst starts with none: traces left by an earlier run would
// make it a traced one) and returns what notes in the mode's result how
// many traces there were, and how many chunks they named: published by the
// end of an ondemand run, found at the start of a traced one (with what
// the traced node added to them). dsecd publishes traces as its sandboxes
// are deleted and waits for that before it exits, so runMode's end is
// theirs.
func prepareTraces(ctx context.Context, store, mode string) func(*ModeResult) {
	var found traceCount
	var err error
	switch mode {
	case ModeOnDemand:
		_, err = traceObjects(ctx, store, true)
	case ModeTraced:
		found, err = traceObjects(ctx, store, false)
	default:
		return func(*ModeResult) {}
	}
	return func(res *ModeResult) {
		var end traceCount
		if err == nil && res.Skipped == "" {
			end, err = traceObjects(ctx, store, false)
		}
		switch {
		case err != nil:
			res.Note = strings.TrimSpace(res.Note + " access traces in the blob store: " + err.Error())
		case mode == ModeOnDemand:
			res.Traces, res.TraceChunks = end.traces, end.chunks
			res.Note = strings.TrimSpace(fmt.Sprintf("%s %d access traces published, naming %d chunks (earlier ones deleted before the burst)", res.Note, end.traces, end.chunks))
		default:
			res.Traces, res.TraceChunks = found.traces, found.chunks
			res.TraceChunksAdded = end.chunks - found.chunks
			res.Note = strings.TrimSpace(fmt.Sprintf("%s %d access traces in the blob store at the start, naming %d chunks; the burst's node added %d", res.Note, found.traces, found.chunks, res.TraceChunksAdded))
			if found.traces == 0 {
				res.Note += " (run ondemand before traced in the same run)"
			}
		}
	}
}

// traceCount is what the blob store's access traces hold.
type traceCount struct {
	traces int // trace objects
	chunks int // chunks they name, summed over the layers
}

// traceObjects counts the layers' access traces in the blob store (keys
// under traces/) and the chunks they name, deleting them all first when
// clear is set.
func traceObjects(ctx context.Context, store string, clear bool) (traceCount, error) {
	var n traceCount
	st, err := blob.Open(ctx, store)
	if err != nil {
		return n, err
	}
	var keys []string
	if err := st.List(ctx, "traces/", func(key string, _ int64) error {
		keys = append(keys, key)
		return nil
	}); err != nil {
		return n, fmt.Errorf("list access traces: %w", err)
	}
	for _, k := range keys {
		if clear {
			if err := st.Delete(ctx, k); err != nil {
				return n, fmt.Errorf("delete access trace: %w", err)
			}
			continue
		}
		t, err := blob.ReadTrace(ctx, st, k)
		if err != nil {
			return n, fmt.Errorf("read access trace %s: %w", k, err)
		}
		n.traces++
		n.chunks += len(t.Chunks)
	}
	return n, nil
}

// tarFetched sums, over the sandboxes started from each environment, the
// sizes of its layers' tar.gz objects in the blob store.
func tarFetched(ctx context.Context, store string, envs map[string]*dsecv1.EnvironmentUsage) (int64, error) {
	st, err := blob.Open(ctx, store)
	if err != nil {
		return 0, err
	}
	var n int64
	for _, e := range envs {
		if e.GetSandboxes() == 0 {
			continue
		}
		for _, d := range e.GetLayerDigests() {
			size, err := st.Stat(ctx, "tars/sha256/"+strings.TrimPrefix(d, "sha256:")+".tar.gz")
			if err != nil {
				return 0, fmt.Errorf("stat tar of %s: %w", d, err)
			}
			n += size * e.GetSandboxes()
		}
	}
	return n, nil
}

// envDelta returns each environment's usage with bytes_read and sandboxes
// counted between two layer stats.
func envDelta(before, after *dsecv1.LayerStatsResponse) map[string]*dsecv1.EnvironmentUsage {
	prev := map[string]*dsecv1.EnvironmentUsage{}
	for _, e := range before.GetEnvironments() {
		prev[e.GetName()] = e
	}
	out := map[string]*dsecv1.EnvironmentUsage{}
	for _, e := range after.GetEnvironments() {
		p := prev[e.GetName()]
		out[e.GetName()] = &dsecv1.EnvironmentUsage{
			Name: e.GetName(), LayerDigests: e.GetLayerDigests(), Size: e.GetSize(),
			BytesRead: e.GetBytesRead() - p.GetBytesRead(), Sandboxes: e.GetSandboxes() - p.GetSandboxes(),
		}
	}
	return out
}

// waitSettled waits until the daemon's layer stats count no new fetches
// for a second (at most two minutes) and returns how long that took.
func waitSettled(ctx context.Context, c *dsec.Conn) (time.Duration, error) {
	start := time.Now()
	last, still := int64(-1), 0
	for still < 4 && time.Since(start) < 2*time.Minute {
		st, err := layerStats(ctx, c)
		if err != nil {
			return 0, err
		}
		var n int64
		for _, l := range st.GetLayers() {
			n += l.GetBytesFetched()
		}
		if n == last {
			still++
		} else {
			last, still = n, 0
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
	return time.Since(start), nil
}

func waitReady(ctx context.Context, c *dsec.Conn, exited <-chan error) error {
	deadline := time.Now().Add(90 * time.Second)
	for {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_, err := c.Layers.ListLayers(cctx, connect.NewRequest(&dsecv1.ListLayersRequest{}))
		cancel()
		if err == nil {
			return nil
		}
		select {
		case werr := <-exited:
			return fmt.Errorf("dsecd exited: %v", werr)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(300 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("dsecd not ready after 90 s: %w", err)
		}
	}
}

func stopDaemon(d *exec.Cmd, exited chan error) {
	if d.Process == nil {
		return
	}
	_ = d.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
	case <-time.After(30 * time.Second):
		_ = d.Process.Kill()
		<-exited
	}
}

func teardown(ctx context.Context, dsecd, root string) {
	if _, err := os.Stat(root); err != nil {
		return
	}
	cctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	_ = exec.CommandContext(cctx, dsecd, "teardown", "--root", root).Run()
}

// dropCaches writes dirty pages back and drops the page cache, dentries
// and inodes, so each burst starts cold.
func dropCaches() error {
	unix.Sync()
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0o200); err != nil {
		return fmt.Errorf("drop page cache: %w", err)
	}
	return nil
}

// blockDevice returns the /sys/dev/block/MAJ:MIN directory of the device
// holding path.
func blockDevice(path string) (string, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return "", fmt.Errorf("stat %s: %w", path, err)
	}
	dir := fmt.Sprintf("/sys/dev/block/%d:%d", unix.Major(st.Dev), unix.Minor(st.Dev))
	if _, err := os.Stat(filepath.Join(dir, "stat")); err != nil {
		return "", fmt.Errorf("find block device of %s: %w", path, err)
	}
	return dir, nil
}

// writeSectors reads the sectors written field (7th) of a block device's stat.
func writeSectors(dev string) (int64, error) {
	data, err := os.ReadFile(filepath.Join(dev, "stat"))
	if err != nil {
		return 0, fmt.Errorf("read %s: %w", dev, err)
	}
	return parseWriteSectors(string(data))
}

// treeBytes is the disk usage (allocated blocks) of the files under dir,
// not crossing mount points.
func treeBytes(dir string) int64 {
	var rootDev uint64
	var st unix.Stat_t
	if unix.Lstat(dir, &st) != nil {
		return 0
	}
	rootDev = st.Dev
	var n int64
	_ = filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		var s unix.Stat_t
		if unix.Lstat(path, &s) != nil {
			return nil
		}
		if s.Dev != rootDev {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		n += s.Blocks * 512
		return nil
	})
	return n
}

// mountVsExtract times mounting a workspace tree's EROFS file against
// extracting the same tree from tar.gz, each from a cold page cache.
func mountVsExtract(ctx context.Context, o StorageOptions, images []benchImage) MountResult {
	res := MountResult{Runs: 3}
	tree := o.Workspace
	if tree == "" {
		tree = defaultWorkspace(o.Images)
	}
	if tree == "" {
		res.Skipped = "no workspace tree (give --workspace DIR)"
		return res
	}
	res.Tree = tree
	for _, tool := range []string{"mkfs.erofs", "tar", "mount", "umount"} {
		if _, err := exec.LookPath(tool); err != nil {
			res.Skipped = tool + " not found"
			return res
		}
	}
	work := filepath.Join(o.Root, "mount-vs-extract")
	os.RemoveAll(work)
	if err := os.MkdirAll(work, 0o755); err != nil {
		res.Skipped = err.Error()
		return res
	}
	defer os.RemoveAll(work)
	var probe string
	_ = filepath.WalkDir(tree, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if d.Type().IsRegular() {
			res.Files++
			if info, err := d.Info(); err == nil {
				res.TreeBytes += info.Size()
			}
			if probe == "" {
				probe, _ = filepath.Rel(tree, path)
			}
		}
		return nil
	})
	img, tgz := filepath.Join(work, "ws.erofs"), filepath.Join(work, "ws.tar.gz")
	if out, err := exec.CommandContext(ctx, "mkfs.erofs", img, tree).CombinedOutput(); err != nil {
		res.Skipped = fmt.Sprintf("mkfs.erofs: %v: %s", err, lastLine(string(out)))
		return res
	}
	if out, err := exec.CommandContext(ctx, "tar", "-C", tree, "-czf", tgz, ".").CombinedOutput(); err != nil {
		res.Skipped = fmt.Sprintf("tar -czf: %v: %s", err, lastLine(string(out)))
		return res
	}
	res.ErofsBytes, res.TarGzBytes = fileSize(img), fileSize(tgz)
	mnt := filepath.Join(work, "mnt")
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		res.Skipped = err.Error()
		return res
	}
	var mounts, extracts []float64
	for i := 0; i < res.Runs; i++ {
		if err := dropCaches(); err != nil {
			res.Skipped = err.Error()
			return res
		}
		t0 := time.Now()
		out, err := exec.CommandContext(ctx, "mount", "-t", "erofs", "-o", "loop,ro", img, mnt).CombinedOutput()
		if err == nil && probe != "" {
			_, err = os.Stat(filepath.Join(mnt, probe))
		}
		d := time.Since(t0)
		_ = exec.Command("umount", mnt).Run()
		if err != nil {
			res.Skipped = fmt.Sprintf("mount erofs: %v: %s", err, lastLine(string(out)))
			return res
		}
		mounts = append(mounts, d.Seconds())

		dst := filepath.Join(work, "x")
		if err := os.MkdirAll(dst, 0o755); err != nil {
			res.Skipped = err.Error()
			return res
		}
		if err := dropCaches(); err != nil {
			res.Skipped = err.Error()
			return res
		}
		t0 = time.Now()
		out, err = exec.CommandContext(ctx, "tar", "-C", dst, "-xzf", tgz).CombinedOutput()
		d = time.Since(t0)
		os.RemoveAll(dst)
		if err != nil {
			res.Skipped = fmt.Sprintf("tar -xzf: %v: %s", err, lastLine(string(out)))
			return res
		}
		extracts = append(extracts, d.Seconds())
	}
	res.MountS, res.ExtractS = median(mounts), median(extracts)
	if res.MountS > 0 {
		res.Speedup = res.ExtractS / res.MountS
	}
	return res
}

// defaultWorkspace picks a source tree out of the image build's work
// directory: the Go image's standard library sources, else the base's /usr/share.
func defaultWorkspace(images string) string {
	matches, _ := filepath.Glob(filepath.Join(images, ".work", "go", "upper", "usr", "share", "go-*", "src"))
	if len(matches) == 0 {
		matches, _ = filepath.Glob(filepath.Join(images, ".work", "go", "upper", "usr", "lib", "go-*", "src"))
	}
	for _, m := range matches {
		if info, err := os.Stat(m); err == nil && info.IsDir() {
			return m
		}
	}
	base := filepath.Join(images, ".work", "base", "usr", "share")
	if info, err := os.Stat(base); err == nil && info.IsDir() {
		return base
	}
	return ""
}

func fileSize(path string) int64 {
	info, err := os.Stat(path)
	if err != nil {
		return -1
	}
	return info.Size()
}

// ociUncompressed sums the uncompressed sizes of an OCI layout's layers
// (gzip's trailer holds the size modulo 4 GiB, enough for these layers).
func ociUncompressed(dir string) int64 {
	var n int64
	entries, err := os.ReadDir(filepath.Join(dir, "blobs", "sha256"))
	if err != nil {
		return -1
	}
	for _, e := range entries {
		f, err := os.Open(filepath.Join(dir, "blobs", "sha256", e.Name()))
		if err != nil {
			continue
		}
		magic := make([]byte, 2)
		if _, err := io.ReadFull(f, magic); err == nil && magic[0] == 0x1f && magic[1] == 0x8b {
			if info, err := f.Stat(); err == nil && info.Size() > 4 {
				tail := make([]byte, 4)
				if _, err := f.ReadAt(tail, info.Size()-4); err == nil {
					n += int64(uint32(tail[0]) | uint32(tail[1])<<8 | uint32(tail[2])<<16 | uint32(tail[3])<<24)
				}
			}
		}
		f.Close()
	}
	return n
}

func progress(w io.Writer, format string, args ...any) {
	if w != nil {
		fmt.Fprintf(w, format+"\n", args...)
	}
}
