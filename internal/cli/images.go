package cli

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"

	"connectrpc.com/connect"
	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

func (a *app) imageCommand() *cobra.Command {
	cmd := &cobra.Command{Use: "image", Short: "import OCI images as environments"}
	var insecure, allowSetuid bool
	var collapse int64
	imp := &cobra.Command{
		Use:   "import NAME:TAG SOURCE",
		Short: "import an image: oci:DIR[:TAG], docker-archive:FILE or docker://HOST[:PORT]/REPO:TAG",
		Long: `Import an OCI image as the environment NAME:TAG, usable as "dsec run NAME:TAG -- ...".
SOURCE is an OCI image layout directory (oci:DIR, or oci:DIR:TAG to pick one of
several images), a "docker save" archive (docker-archive:FILE), both on the
daemon's host, or a registry (docker://HOST[:PORT]/REPO:TAG; --insecure for
plain HTTP). Consecutive small layers are merged into one EROFS layer.
An interrupted import leaves nothing half-visible; running it again reuses the
layers it had finished.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			src := args[1]
			for _, p := range []string{"oci:", "docker-archive:"} {
				if rest, ok := strings.CutPrefix(src, p); ok && !filepath.IsAbs(rest) {
					abs, err := filepath.Abs(rest)
					if err != nil {
						return err
					}
					src = p + abs
				}
			}
			stream, err := a.c.Layers.ImportImage(cmd.Context(), connect.NewRequest(&dsecv1.ImportImageRequest{
				Ref: args[0], Source: src, Insecure: insecure, CollapseBelowBytes: collapse, AllowSetuid: allowSetuid,
			}))
			if err != nil {
				return err
			}
			defer stream.Close()
			show := newImportProgress(a, !a.json && term.IsTerminal(int(os.Stderr.Fd())))
			var last *dsecv1.ImportImageProgress
			for stream.Receive() {
				last = stream.Msg()
				show.update(last)
			}
			show.finish()
			if err := stream.Err(); err != nil {
				return err
			}
			if last == nil || !last.GetDone() {
				return fmt.Errorf("import of %s ended without a result", args[0])
			}
			a.warn(last.GetWarnings())
			if a.json {
				return a.printProto(last)
			}
			fmt.Fprintf(a.stdout, "%s: %d OCI layers -> %d EROFS layers\n", args[0], last.GetOciLayers(), len(last.GetLayerDigests()))
			for _, d := range last.GetLayerDigests() {
				fmt.Fprintln(a.stdout, "  "+d)
			}
			return nil
		},
	}
	imp.Flags().BoolVar(&insecure, "insecure", false, "plain HTTP to the registry (loopback test registries)")
	imp.Flags().Int64Var(&collapse, "collapse-below", 0, "merge consecutive layers while their total stays below this many bytes (0: node default, <0: never)")
	imp.Flags().BoolVar(&allowSetuid, "allow-setuid", false, "keep setuid and setgid files")
	cmd.AddCommand(imp)
	return cmd
}

// importProgress shows an import's progress: a bar on a terminal, one line
// per phase change otherwise.
type importProgress struct {
	a     *app
	tty   bool
	bar   *progressbar.ProgressBar
	key   string
	layer int32
}

func newImportProgress(a *app, tty bool) *importProgress { return &importProgress{a: a, tty: tty} }

func (p *importProgress) update(m *dsecv1.ImportImageProgress) {
	if m.GetDone() {
		return
	}
	key := fmt.Sprintf("%s/%d", m.GetPhase(), m.GetLayer())
	if !p.tty {
		if key != p.key && !p.a.json {
			fmt.Fprintf(p.a.stderr, "%s layer %d/%d (%s)\n", m.GetPhase(), m.GetLayer(), m.GetLayers(), humanBytes(m.GetTotalBytes()))
		}
		p.key = key
		return
	}
	if key != p.key {
		if p.bar != nil {
			p.bar.Finish()
			fmt.Fprintln(p.a.stderr)
		}
		p.bar = progressbar.NewOptions64(max(m.GetTotalBytes(), 1),
			progressbar.OptionSetWriter(p.a.stderr),
			progressbar.OptionSetDescription(fmt.Sprintf("%-6s layer %d/%d", m.GetPhase(), m.GetLayer(), m.GetLayers())),
			progressbar.OptionShowBytes(true), progressbar.OptionShowTotalBytes(true),
			progressbar.OptionSetWidth(30), progressbar.OptionThrottle(100_000_000),
			progressbar.OptionSetPredictTime(false))
		p.key = key
	}
	p.bar.Set64(m.GetBytes())
}

func (p *importProgress) finish() {
	if p.bar != nil {
		p.bar.Finish()
		fmt.Fprintln(p.a.stderr)
	}
}

// layerStatsCommand prints what sandboxes read of each layer.
func (a *app) layerStatsCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "stats",
		Short: "per layer and environment: bytes read vs size, chunks fetched, cache hits, fan-out",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			res, err := a.c.Layers.LayerStats(cmd.Context(), connect.NewRequest(&dsecv1.LayerStatsRequest{}))
			if err != nil {
				return err
			}
			m := res.Msg
			if a.json {
				return printLayerStatsJSON(a, m)
			}
			fmt.Fprintf(a.stdout, "mode %s, blob store %s\n\n", m.GetMode(), m.GetBlobStore())
			tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "LAYER\tREFS\tSIZE\tREAD\tREAD%\tPUSHED\tFETCHED\tCHUNKS\tHITS MEM/DISK\tMISSES\tDISK WRITTEN\tERRORS\tSANDBOXES")
			for _, l := range m.GetLayers() {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d/%d\t%d/%d\t%d\t%s\t%d\t%d\n", shortDigest(l.GetDigest()), strings.Join(l.GetRefs(), ","),
					humanBytes(l.GetSize()), humanBytes(l.GetBytesRead()), percent(l.GetBytesRead(), l.GetSize()),
					humanBytes(l.GetBytesPushed()), humanBytes(l.GetBytesFetched()), l.GetChunksFetched(), l.GetChunksTotal(), l.GetMemoryHits(), l.GetDiskHits(),
					l.GetCacheMisses(), humanBytes(l.GetBytesWrittenDisk()), l.GetFetchErrors(), l.GetSandboxes())
			}
			tw.Flush()
			fmt.Fprintln(a.stdout)
			tw = tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ENVIRONMENT\tLAYERS\tSIZE\tREAD\tREAD%\tFAN-OUT")
			for _, e := range m.GetEnvironments() {
				fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%d\n", e.GetName(), len(e.GetLayerDigests()), humanBytes(e.GetSize()),
					humanBytes(e.GetBytesRead()), percent(e.GetBytesRead(), e.GetSize()), e.GetSandboxes())
			}
			return tw.Flush()
		},
	}
}

// printLayerStatsJSON prints one JSON object with snake_case keys.
func printLayerStatsJSON(a *app, m *dsecv1.LayerStatsResponse) error {
	type layer struct {
		Digest        string   `json:"digest"`
		Refs          []string `json:"refs"`
		Size          int64    `json:"size"`
		BytesRead     int64    `json:"bytes_read"`
		BytesFetched  int64    `json:"bytes_fetched"`
		ChunksTotal   int64    `json:"chunks_total"`
		ChunksFetched int64    `json:"chunks_fetched"`
		CacheHits     int64    `json:"cache_hits"`
		CacheMisses   int64    `json:"cache_misses"`
		FetchErrors   int64    `json:"fetch_errors"`
		Sandboxes     int64    `json:"sandboxes"`
		// The chunk cache's tiers.
		BytesFetchedPlain int64 `json:"bytes_fetched_plain"`
		MemoryHits        int64 `json:"memory_hits"`
		DiskHits          int64 `json:"disk_hits"`
		BytesWrittenDisk  int64 `json:"bytes_written_disk"`
		BytesPushed       int64 `json:"bytes_pushed"`
	}
	type env struct {
		Name      string   `json:"name"`
		Layers    []string `json:"layer_digests"`
		Size      int64    `json:"size"`
		BytesRead int64    `json:"bytes_read"`
		Sandboxes int64    `json:"sandboxes"`
	}
	out := struct {
		Mode         string  `json:"mode"`
		BlobStore    string  `json:"blob_store"`
		Layers       []layer `json:"layers"`
		Environments []env   `json:"environments"`
	}{Mode: m.GetMode(), BlobStore: m.GetBlobStore(), Layers: []layer{}, Environments: []env{}}
	for _, l := range m.GetLayers() {
		out.Layers = append(out.Layers, layer{l.GetDigest(), l.GetRefs(), l.GetSize(), l.GetBytesRead(), l.GetBytesFetched(),
			l.GetChunksTotal(), l.GetChunksFetched(), l.GetCacheHits(), l.GetCacheMisses(), l.GetFetchErrors(), l.GetSandboxes(),
			l.GetBytesFetchedPlain(), l.GetMemoryHits(), l.GetDiskHits(), l.GetBytesWrittenDisk(), l.GetBytesPushed()})
	}
	for _, e := range m.GetEnvironments() {
		out.Environments = append(out.Environments, env{e.GetName(), e.GetLayerDigests(), e.GetSize(), e.GetBytesRead(), e.GetSandboxes()})
	}
	enc := json.NewEncoder(a.stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(out)
}

func percent(part, whole int64) string {
	if whole <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f%%", 100*float64(part)/float64(whole))
}
