package lazy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/errdefs"
)

// tracePublishRecheck is how long PublishTrace trusts its last merge: a
// call within it with nothing new read since does nothing; a later one
// reads the published trace again, and writes it back if another node's
// write lost this node's chunks.
const tracePublishRecheck = time.Minute

// traceFile is the JSON saved by SaveTrace.
type traceFile struct {
	Digest    string `json:"digest"`
	ChunkSize int64  `json:"chunk_size"`
	Chunks    []int  `json:"chunks"` // in the order first read
}

func (f *FS) tracePath(hex string) string {
	return filepath.Join(f.cfg.CacheDir, "traces", hex+".json")
}

// SaveTrace records the chunk numbers of the layer read so far, in the order
// first read, under CacheDir/traces/<hex>.json, for PrefetchTrace in a later
// run.
func (f *FS) SaveTrace(hex string) error {
	l, err := f.layer(hex)
	if err != nil {
		return err
	}
	data, err := json.Marshal(traceFile{Digest: l.ix.Digest, ChunkSize: l.ix.ChunkSize, Chunks: l.traced()})
	if err != nil {
		return fmt.Errorf("save trace %s: %w", hex, err)
	}
	if err := writeFileAtomic(f.tracePath(hex), data); err != nil {
		return fmt.Errorf("save trace %s: %w", hex, err)
	}
	return nil
}

// PublishTrace merges the chunks read from the layer on this node, ranked
// by the order first read, into the layer's trace in the blob store
// (blob.MergeTrace: the union of every node's reads, each chunk at its
// earliest rank), and reports whether it wrote the object. A published
// trace that is stale, foreign or damaged is replaced, with a log line.
// Nothing read yet, or nothing new since a merge less than a minute ago,
// writes nothing.
func (f *FS) PublishTrace(ctx context.Context, hex string) (bool, error) {
	l, err := f.layer(hex)
	if err != nil {
		return false, err
	}
	l.publishMu.Lock()
	defer l.publishMu.Unlock()
	order := l.traced()
	if len(order) == 0 || len(order) == l.published && time.Since(l.publishedAt) < tracePublishRecheck {
		return false, nil
	}
	res, err := blob.PublishTrace(ctx, f.cfg.Store, l.ix, blob.TraceFromOrder(order))
	if err != nil {
		return false, fmt.Errorf("publish trace %s: %w", hex, err)
	}
	if res.Replaced != "" {
		f.log.Warn("replaced unusable published trace", "layer", hex, "err", res.Replaced)
	}
	l.published, l.publishedAt = len(order), time.Now()
	return res.Wrote, nil
}

// PrefetchTrace prefetches into the memory tier the chunks of the layer's
// trace, first needed first, and returns how many it asked for: this node's
// own trace (SaveTrace) when it has one, else the one published by the
// nodes that used the layer before (PublishTrace). It asks for at most half
// the memory tier's worth of chunks. No trace is not an error, and neither
// is an unusable one (stale, foreign or damaged): it is ignored with a log
// line.
func (f *FS) PrefetchTrace(ctx context.Context, hex string) (int, error) {
	l, err := f.layer(hex)
	if err != nil {
		return 0, err
	}
	chunks, err := f.localTrace(l)
	if err != nil {
		return 0, err
	}
	if len(chunks) == 0 {
		if chunks, err = f.publishedTrace(ctx, l); err != nil {
			return 0, err
		}
	}
	var budget int64
	for n, i := range chunks {
		if budget += l.ix.ChunkLen(i); budget > f.cfg.MemoryBytes/2 {
			chunks = chunks[:n]
			break
		}
	}
	if err := f.prefetch(ctx, l, chunks, false); err != nil {
		return 0, fmt.Errorf("prefetch trace %s: %w", hex, err)
	}
	return len(chunks), nil
}

// localTrace returns the chunks of the layer's saved trace; none when
// there is none or it is stale.
func (f *FS) localTrace(l *layer) ([]int, error) {
	data, err := os.ReadFile(f.tracePath(l.hex))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read trace %s: %w", l.hex, err)
	}
	var tf traceFile
	if err := json.Unmarshal(data, &tf); err != nil {
		return nil, fmt.Errorf("read trace %s: %w", l.hex, err)
	}
	if tf.Digest != l.ix.Digest || tf.ChunkSize != l.ix.ChunkSize {
		f.log.Warn("ignore stale trace", "layer", l.hex, "chunk_size", tf.ChunkSize)
		return nil, nil
	}
	var chunks []int
	for _, i := range tf.Chunks {
		if i >= 0 && i < len(l.ix.Chunks) {
			chunks = append(chunks, i)
		}
	}
	return chunks, nil
}

// publishedTrace returns the chunks of the layer's published trace, by
// rank; none when there is no usable one.
func (f *FS) publishedTrace(ctx context.Context, l *layer) ([]int, error) {
	t, err := blob.GetTrace(ctx, f.cfg.Store, l.ix)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil, nil
	}
	if errors.Is(err, blob.ErrCorrupt) {
		f.log.Warn("ignore unusable published trace", "layer", l.hex, "err", err)
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read published trace %s: %w", l.hex, err)
	}
	chunks := make([]int, len(t.Chunks))
	for n, tc := range t.Chunks {
		chunks[n] = tc.Chunk
	}
	return chunks, nil
}
