package daemon

import (
	"context"
	"log/slog"
	"path/filepath"
	"time"

	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edge/trajectory"
)

// TrajectoryConfig says how a node records its sandboxes' trajectories
// (package trajectory, docs/trajectories.md).
type TrajectoryConfig struct {
	// Off records none.
	Off bool
	// Retention is how long a trajectory is kept after its sandbox is
	// gone; 0 = trajectory.DefaultRetention.
	Retention time.Duration
	// MaxBytes bounds a trajectory's full lines (then hashes and counts);
	// 0 = trajectory.DefaultMaxBytes.
	MaxBytes int64
	// MaxOutput is the output of each stream a call's line keeps; 0 =
	// trajectory.DefaultMaxOutput.
	MaxOutput int
}

// startRecorder has svc record trajectories under <root>/trajectories, and
// copy finished ones to the blob store when the node names one (a
// cluster's shared store, where they outlive the node). It returns what
// stops the recorder's sweeps and waits for its copies.
func startRecorder(ctx context.Context, cfg Config, svc *edgesvc.Service, src trajectory.Source, log *slog.Logger) (func(), error) {
	tc := cfg.Trajectory
	if tc.Off || cfg.Root == "" {
		return func() {}, nil
	}
	var blobs blob.Store
	if cfg.Storage.BlobStore != "" {
		b, err := blob.Open(ctx, cfg.Storage.BlobStore)
		if err != nil {
			return nil, err
		}
		blobs = b
		if failed := cfg.metrics.BlobErrors().Of(blob.Backend(cfg.Storage.BlobStore)); failed != nil {
			blobs = blob.Observe(b, failed)
		}
	}
	rec, err := trajectory.New(trajectory.Config{
		Dir: filepath.Join(cfg.Root, "trajectories"), Retention: tc.Retention, MaxBytes: tc.MaxBytes,
		MaxOutput: tc.MaxOutput, Blobs: blobs, Log: log.With("component", "trajectory"),
	}, src)
	if err != nil {
		return nil, err
	}
	svc.SetRecorder(rec)
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		rec.Run(ctx)
	}()
	return func() { cancel(); <-done }, nil
}
