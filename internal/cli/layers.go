package cli

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

func (a *app) layerCommand() *cobra.Command {
	cmd := &cobra.Command{Use: "layer", Short: "manage the node's layers"}
	var kind string
	var allowSetuid, upload bool
	imp := &cobra.Command{
		Use:   "import --kind base|workspace|toolkit NAME:TAG PATH",
		Short: "build an EROFS layer from a directory or tar archive on the daemon's host",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			k, ok := dsecv1.LayerKind_value["LAYER_KIND_"+strings.ToUpper(kind)]
			if !ok || k == 0 {
				return fmt.Errorf("--kind %q: want base, workspace or toolkit", kind)
			}
			p, err := filepath.Abs(args[1])
			if err != nil {
				return err
			}
			req := &dsecv1.ImportLayerRequest{Ref: args[0], Kind: dsecv1.LayerKind(k), Path: p, AllowSetuid: allowSetuid}
			if upload {
				if req.Archive, err = archiveOf(p); err != nil {
					return err
				}
				req.Path = ""
			}
			resp, err := a.c.Layers.ImportLayer(cmd.Context(), connect.NewRequest(req))
			if err != nil {
				return err
			}
			a.warn(resp.Msg.GetWarnings())
			if a.json {
				return a.printProto(resp.Msg)
			}
			fmt.Fprintf(a.stdout, "%s %s %s\n", args[0], resp.Msg.GetDigest(), humanBytes(resp.Msg.GetSize()))
			return nil
		},
	}
	imp.Flags().StringVar(&kind, "kind", "base", "layer kind: base, workspace or toolkit")
	imp.Flags().BoolVar(&allowSetuid, "allow-setuid", false, "keep setuid and setgid files")
	imp.Flags().BoolVar(&upload, "upload", false, "send PATH (a tree, or a tar archive) from this machine, rather than name a path on the daemon's (at most 1 GiB)")

	ls := &cobra.Command{
		Use:   "ls",
		Short: "list layers",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := a.c.Layers.ListLayers(cmd.Context(), connect.NewRequest(&dsecv1.ListLayersRequest{}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(resp.Msg)
			}
			tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "REFS\tKIND\tDIGEST\tSIZE\tCREATED")
			for _, l := range resp.Msg.GetLayers() {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", strings.Join(l.GetRefs(), ","),
					strings.ToLower(strings.TrimPrefix(l.GetKind().String(), "LAYER_KIND_")),
					shortDigest(l.GetDigest()), humanBytes(l.GetSize()),
					time.UnixMilli(l.GetCreatedUnixMs()).Format(time.DateTime))
			}
			return tw.Flush()
		},
	}
	rm := &cobra.Command{
		Use:   "rm NAME:TAG|DIGEST...",
		Short: "remove layer refs (a layer goes with its last ref)",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			for _, ref := range args {
				if _, err := a.c.Layers.RemoveLayer(cmd.Context(), connect.NewRequest(&dsecv1.RemoveLayerRequest{Ref: ref})); err != nil {
					return err
				}
			}
			return nil
		},
	}
	cmd.AddCommand(imp, ls, rm, a.layerStatsCommand())
	return cmd
}

func (a *app) envCommand() *cobra.Command {
	cmd := &cobra.Command{Use: "env", Short: "environments (BASE[+LAYER...]) this node has run"}
	cmd.AddCommand(&cobra.Command{
		Use:   "ls",
		Short: "list environments with their layers and how many sandboxes used them",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := a.c.Layers.ListEnvironments(cmd.Context(), connect.NewRequest(&dsecv1.ListEnvironmentsRequest{}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(resp.Msg)
			}
			tw := tabwriter.NewWriter(a.stdout, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ENVIRONMENT\tLAYERS\tSANDBOXES\tLAST USED")
			for _, e := range resp.Msg.GetEnvironments() {
				var ds []string
				for _, d := range e.GetLayerDigests() {
					ds = append(ds, shortDigest(d))
				}
				fmt.Fprintf(tw, "%s\t%s\t%d\t%s\n", e.GetName(), strings.Join(ds, ","), e.GetSandboxes(),
					time.UnixMilli(e.GetLastUsedUnixMs()).Format(time.DateTime))
			}
			return tw.Flush()
		},
	})
	return cmd
}

func shortDigest(d string) string {
	if len(d) > 19 {
		return d[:19]
	}
	return d
}

func humanBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// maxUpload is the most an import sends in its request.
const maxUpload = 1 << 30

// archiveOf is what `layer import --upload` sends: a tar archive file as it
// is, or a directory tree packed as one.
func archiveOf(p string) ([]byte, error) {
	info, err := os.Stat(p)
	if err != nil {
		return nil, err
	}
	var data []byte
	if info.IsDir() {
		data, err = packTree(p, "")
	} else {
		data, err = os.ReadFile(p)
	}
	if err != nil {
		return nil, err
	}
	if len(data) > maxUpload {
		return nil, fmt.Errorf("%s packs to %d MiB, over the %d MiB an import may send; name a path on the daemon's host or import an OCI image", p, len(data)>>20, maxUpload>>20)
	}
	return data, nil
}
