package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

func (a *app) layerCommand() *cobra.Command {
	cmd := &cobra.Command{Use: "layer", Short: "manage the node's layers"}
	var kind, project string
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
			var layer *dsecv1.Layer
			if upload {
				layer, err = a.uploadLayer(cmd.Context(), &dsecv1.UploadLayerHeader{Ref: args[0], Kind: dsecv1.LayerKind(k), AllowSetuid: allowSetuid, Project: project}, p)
			} else {
				var resp *connect.Response[dsecv1.Layer]
				resp, err = a.c.Layers.ImportLayer(cmd.Context(), connect.NewRequest(&dsecv1.ImportLayerRequest{
					Ref: args[0], Kind: dsecv1.LayerKind(k), Path: p, AllowSetuid: allowSetuid, Project: project,
				}))
				if err == nil {
					layer = resp.Msg
				}
			}
			if err != nil {
				return err
			}
			a.warn(layer.GetWarnings())
			if a.json {
				return a.printProto(layer)
			}
			fmt.Fprintf(a.stdout, "%s %s %s\n", args[0], layer.GetDigest(), humanBytes(layer.GetSize()))
			return nil
		},
	}
	imp.Flags().StringVar(&kind, "kind", "base", "layer kind: base, workspace or toolkit")
	imp.Flags().BoolVar(&allowSetuid, "allow-setuid", false, "keep setuid and setgid files")
	imp.Flags().StringVarP(&project, "project", "p", "", "the project the layer belongs to (builder there; default the token's), charged its bytes")
	imp.Flags().BoolVar(&upload, "upload", false, "stream PATH (a tree, packed as it is sent, or a tar archive) from this machine, rather than name a path on the daemon's")

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
			fmt.Fprintln(tw, "REFS\tKIND\tDIGEST\tSIZE\tCREATED\tPROJECT\tSHARED WITH")
			for _, l := range resp.Msg.GetLayers() {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", strings.Join(l.GetRefs(), ","),
					strings.ToLower(strings.TrimPrefix(l.GetKind().String(), "LAYER_KIND_")),
					shortDigest(l.GetDigest()), humanBytes(l.GetSize()),
					time.UnixMilli(l.GetCreatedUnixMs()).Format(time.DateTime),
					displayProject(l.GetProject()), strings.Join(l.GetSharedWith(), ","))
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
	share, unshare := a.shareCommands("layer", "NAME:TAG", "")
	cmd.AddCommand(imp, ls, rm, share, unshare, a.layerStatsCommand())
	return cmd
}

// shareCommands are `share` and `unshare` of a layer, an image or (with
// prefix "snap:") a snapshot: read-only for another project.
func (a *app) shareCommands(what, arg, prefix string) (share, unshare *cobra.Command) {
	mk := func(verb string, un bool) *cobra.Command {
		var with string
		short := fmt.Sprintf("share a %s of your project with project --with, read-only: it may list it, make sandboxes from it and fork them, not remove, overwrite or share it", what)
		if un {
			short = fmt.Sprintf("take a share of a %s away", what)
		}
		c := &cobra.Command{
			Use:   verb + " " + arg + " --with PROJECT",
			Short: short,
			Args:  cobra.ExactArgs(1),
			RunE: func(cmd *cobra.Command, args []string) error {
				if with == "" {
					return fmt.Errorf("--with PROJECT is required")
				}
				resp, err := a.c.Layers.ShareLayer(cmd.Context(), connect.NewRequest(&dsecv1.ShareLayerRequest{Ref: prefix + args[0], Project: with, Unshare: un}))
				if err != nil {
					return err
				}
				if a.json {
					return a.printProto(resp.Msg)
				}
				fmt.Fprintf(a.stdout, "%s shared with: %s\n", args[0], strings.Join(resp.Msg.GetSharedWith(), ","))
				return nil
			},
		}
		c.Flags().StringVar(&with, "with", "", "the project (a path; / the root)")
		return c
	}
	return mk("share", false), mk("unshare", true)
}

// displayProject is a project's path as ls shows it: the root as /.
func displayProject(p string) string {
	if p == "" {
		return "/"
	}
	return p
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

// uploadPiece is how much of an archive one message of an upload carries.
const uploadPiece = 1 << 20

// uploadLayer streams p to the apiserver as an upload: a tar archive file
// as it is, or a tree packed as it is sent; nothing is held whole. A bar on
// a terminal shows what has gone. A source that fails midway abandons the
// upload (the call is cancelled), so no truncated archive is taken for a
// whole one.
func (a *app) uploadLayer(ctx context.Context, h *dsecv1.UploadLayerHeader, p string) (*dsecv1.Layer, error) {
	info, err := os.Stat(p)
	if err != nil {
		return nil, err
	}
	var src io.Reader
	if info.IsDir() {
		pr, pw := io.Pipe()
		go func() { pw.CloseWithError(writeTree(pw, p, "")) }()
		defer pr.Close() // stops the packer if the upload ends first
		src = pr
	} else {
		f, err := os.Open(p)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		src, h.Size = f, info.Size()
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream := a.c.Layers.UploadLayer(ctx)
	var bar *progressbar.ProgressBar
	if !a.json && term.IsTerminal(int(os.Stderr.Fd())) {
		total := h.GetSize()
		if total == 0 {
			total = -1 // a tree: the size is known at the end
		}
		bar = progressbar.NewOptions64(total, progressbar.OptionSetWriter(a.stderr),
			progressbar.OptionSetDescription("upload "+h.GetRef()), progressbar.OptionShowBytes(true),
			progressbar.OptionSetWidth(30), progressbar.OptionThrottle(100*time.Millisecond), progressbar.OptionSetPredictTime(false))
		defer func() { bar.Finish(); fmt.Fprintln(a.stderr) }()
	}
	sent := stream.Send(&dsecv1.UploadLayerRequest{Part: &dsecv1.UploadLayerRequest_Header{Header: h}})
	buf := make([]byte, uploadPiece)
	for sent == nil {
		n, rerr := io.ReadFull(src, buf)
		if n > 0 {
			if sent = stream.Send(&dsecv1.UploadLayerRequest{Part: &dsecv1.UploadLayerRequest_Data{Data: buf[:n]}}); bar != nil {
				bar.Add(n)
			}
		}
		if rerr == io.EOF || rerr == io.ErrUnexpectedEOF {
			if sent == nil {
				sent = stream.Send(&dsecv1.UploadLayerRequest{Part: &dsecv1.UploadLayerRequest_End{End: true}})
			}
			break
		}
		if rerr != nil {
			cancel()
			stream.CloseAndReceive()
			return nil, fmt.Errorf("upload %s: read %s: %w", h.GetRef(), p, rerr)
		}
	}
	// A send that failed with io.EOF means the server ended the call: its
	// answer says why. A source that failed has cancelled the call, and
	// sent no end: no hop takes what came for a whole archive.
	if sent != nil && !errors.Is(sent, io.EOF) {
		return nil, sent
	}
	resp, err := stream.CloseAndReceive()
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}
