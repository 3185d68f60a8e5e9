package cli

import (
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"dsec.dev/dsec/internal/bench"
)

// benchStorageCommand is `dsec bench storage`: a burst of sandboxes over
// several real images, once per layer mode, against a blob store modelled
// as remote. It starts its own daemons; --addr is not used.
func (a *app) benchStorageCommand() *cobra.Command {
	o := bench.StorageOptions{Sandboxes: 64, Concurrency: 16, Bandwidth: 125000000, PortBase: 17600}
	var modes, svg string
	cmd := &cobra.Command{
		Use:   "storage",
		Short: "compare pre-cached, on-demand (cold and traced), eager and tar layers in a burst over real images",
		Long: `Runs, for each layer mode (local = pre-cached, ondemand, traced, eager, tar), a fresh dsecd
on its own root under --root, imports the images of --images (OCI layouts built by
scripts/build-bench-images.sh), drops the page cache and runs a burst of --sandboxes
sandboxes round-robin over the images, each running its /bench/step.sh. traced is
ondemand again on a fresh root, prefetching what the access traces the ondemand run
published to the blob store name (ondemand starts with the store's traces deleted).
Prints per mode the burst wall time, bytes fetched from the blob store, bytes written
to local disk and the fraction of image bytes read; then the time to mount a workspace's
EROFS file against extracting it from tar.gz, and the issue's targets as ratios
against the baselines of the same run. The blob store is an S3 server (--s3) or a
directory (--blob-dir), its reads capped at --bandwidth to model a remote store.
Needs root; see docs/storage-bench.md.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var err error
			if o.Modes, err = bench.ParseModes(modes); err != nil {
				return err
			}
			if o.Images == "" {
				return fmt.Errorf("--images DIR is required (build it with scripts/build-bench-images.sh DIR)")
			}
			if o.Dsecd == "" {
				o.Dsecd = findDsecd()
			}
			if !a.json {
				o.Progress = a.stderr
			}
			log := slog.New(slog.NewTextHandler(a.stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
			rep, err := bench.RunStorage(cmd.Context(), log, o)
			if err != nil {
				return err
			}
			if svg != "" {
				f, err := os.Create(svg)
				if err != nil {
					return err
				}
				if err := rep.SVG(f); err != nil {
					f.Close()
					return err
				}
				if err := f.Close(); err != nil {
					return err
				}
			}
			if a.json {
				return rep.JSON(a.stdout)
			}
			rep.Print(a.stdout)
			if svg != "" {
				fmt.Fprintln(a.stdout, "chart:", svg)
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.Images, "images", "", "directory of OCI image layouts (scripts/build-bench-images.sh)")
	f.IntVar(&o.Sandboxes, "sandboxes", o.Sandboxes, "sandboxes in each burst")
	f.IntVar(&o.Concurrency, "concurrency", o.Concurrency, "sandboxes created and running at once")
	f.StringVar(&o.Root, "root", "/var/lib/dsec-bench-storage", "scratch directory: a daemon root per mode, logs, the blob store by default")
	f.StringVar(&o.S3, "s3", "", "HOST:PORT of an S3 server for the blob store (e.g. scripts/seaweedfs.sh start)")
	f.StringVar(&o.BlobDir, "blob-dir", "", "directory blob store when no --s3 (default ROOT/blobs)")
	f.Int64Var(&o.Bandwidth, "bandwidth", o.Bandwidth, "blob store read cap in bytes per second, modelling a remote store (0 = none)")
	f.Int64Var(&o.ChunkSize, "chunk-size", 0, "bytes per layer chunk (default: dsecd's, 1 MiB); a layer keeps the chunking it was first published with, so each size gets its own S3 prefix (give a fresh --blob-dir yourself)")
	f.StringVar(&modes, "modes", strings.Join(bench.AllStorageModes, ","), "layer modes to run, in order")
	f.StringVar(&svg, "svg", "", "write a bar chart to this SVG file")
	f.StringVar(&o.Dsecd, "dsecd", "", "dsecd binary (default: beside dsec, else on PATH)")
	f.StringVar(&o.Workspace, "workspace", "", "tree for the mount-vs-extract figure (default: the Go image's standard library sources)")
	f.IntVar(&o.PortBase, "port-base", o.PortBase, "first loopback TCP port for the daemons (one per mode)")
	f.BoolVar(&o.KeepRoots, "keep-roots", false, "keep each mode's daemon root after its burst")
	f.BoolVar(&o.NoPagePush, "no-page-push", false, "run the daemons with --no-page-push: every page of an on-demand layer read through lazyfs, so IMAGE READ is what the tasks read")
	f.IntVar(&o.Rounds, "rounds", 1, "bursts per mode, the modes interleaved; figures are medians (for a machine other work disturbs)")
	cmd.AddCommand(a.benchBuildOCICommand())
	return cmd
}

// benchBuildOCICommand is the hidden `dsec bench storage build-oci` that
// scripts/build-bench-images.sh calls to write an OCI image layout.
func (a *app) benchBuildOCICommand() *cobra.Command {
	var o bench.OCIBuildOptions
	cmd := &cobra.Command{
		Use:    "build-oci",
		Short:  "write a two-layer OCI image layout from a base tree and an overlay upper directory",
		Hidden: true,
		Args:   cobra.NoArgs,
		// Works offline: no daemon to dial.
		PersistentPreRunE: func(cmd *cobra.Command, args []string) error { return nil },
		RunE: func(cmd *cobra.Command, args []string) error {
			return bench.BuildOCI(cmd.Context(), o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.Base, "base", "", "base root file system")
	f.StringVar(&o.BaseCache, "base-cache", "", "file keeping the base layer's tar.gz between images")
	f.StringVar(&o.Layer, "layer", "", "the image's own layer (an overlayfs upper directory)")
	f.StringVar(&o.Out, "out", "", "OCI image layout directory to write")
	f.StringVar(&o.Name, "name", "", "image name for index.json, e.g. bench-go:latest")
	return cmd
}

// findDsecd returns the dsecd beside this executable, else the one on PATH.
func findDsecd() string {
	if exe, err := os.Executable(); err == nil {
		p := filepath.Join(filepath.Dir(exe), "dsecd")
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	if p, err := exec.LookPath("dsecd"); err == nil {
		return p
	}
	return "dsecd"
}
