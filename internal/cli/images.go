package cli

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
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
	var project string
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
				Ref: args[0], Source: src, Insecure: insecure, CollapseBelowBytes: collapse, AllowSetuid: allowSetuid, Project: project,
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
	imp.Flags().StringVarP(&project, "project", "p", "", "the project the image belongs to (builder there; default the token's), charged its layers' bytes")
	share, unshare := a.shareCommands("image", "NAME:TAG", "")
	cmd.AddCommand(imp, a.imageLsCommand(), share, unshare)
	return cmd
}

// imageInfo is one imported image as image ls prints it.
type imageInfo struct {
	Name   string `json:"name"`
	Layers int    `json:"layers"`
	Size   int64  `json:"size"`
}

// imageLsCommand lists the imported images, from the layers that make
// them up (a layer names the images it is part of).
func (a *app) imageLsCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "ls",
		Short: "list the imported images: name, layers, size (layer rm NAME:TAG removes one)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := a.c.Layers.ListLayers(cmd.Context(), connect.NewRequest(&dsecv1.ListLayersRequest{}))
			if err != nil {
				return err
			}
			byName := map[string]*imageInfo{}
			for _, l := range resp.Msg.GetLayers() {
				for _, name := range l.GetImages() {
					img := byName[name]
					if img == nil {
						img = &imageInfo{Name: name}
						byName[name] = img
					}
					img.Layers++
					img.Size += l.GetSize()
				}
			}
			images := make([]imageInfo, 0, len(byName))
			for _, img := range byName {
				images = append(images, *img)
			}
			slices.SortFunc(images, func(x, y imageInfo) int { return strings.Compare(x.Name, y.Name) })
			if a.json {
				return a.printJSON(map[string]any{"images": images})
			}
			tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "IMAGE\tLAYERS\tSIZE")
			for _, img := range images {
				fmt.Fprintf(tw, "%s\t%d\t%s\n", img.Name, img.Layers, humanBytes(img.Size))
			}
			return tw.Flush()
		},
	}
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
				return a.printProto(m)
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

func percent(part, whole int64) string {
	if whole <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f%%", 100*float64(part)/float64(whole))
}
