// Temporary driver (deleted before the report).
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"dsec.dev/dsec/internal/bench"
)

func main() {
	if len(os.Args) > 3 && os.Args[1] == "bench" && os.Args[3] == "build-oci" {
		fs := flag.NewFlagSet("b", flag.ExitOnError)
		var o bench.OCIBuildOptions
		fs.StringVar(&o.Base, "base", "", "")
		fs.StringVar(&o.BaseCache, "base-cache", "", "")
		fs.StringVar(&o.Layer, "layer", "", "")
		fs.StringVar(&o.Out, "out", "", "")
		fs.StringVar(&o.Name, "name", "", "")
		fs.Parse(os.Args[4:])
		if err := bench.BuildOCI(context.Background(), o); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		return
	}
	if os.Args[1] == "render" {
		var rep bench.StorageReport
		data, _ := os.ReadFile(os.Args[2])
		if err := json.Unmarshal(data, &rep); err != nil {
			panic(err)
		}
		rep.ComputeTargets()
		f, _ := os.Create(os.Args[3])
		rep.SVG(f)
		f.Close()
		rep.Print(os.Stdout)
		return
	}
	fs := flag.NewFlagSet("s", flag.ExitOnError)
	o := bench.StorageOptions{}
	var modes, svg string
	var js bool
	fs.StringVar(&o.Images, "images", "", "")
	fs.IntVar(&o.Sandboxes, "sandboxes", 64, "")
	fs.IntVar(&o.Concurrency, "concurrency", 16, "")
	fs.StringVar(&o.Root, "root", "/var/lib/dsec-bench-storage", "")
	fs.StringVar(&o.S3, "s3", "", "")
	fs.Int64Var(&o.Bandwidth, "bandwidth", 125000000, "")
	fs.StringVar(&modes, "modes", "local,ondemand,eager,tar", "")
	fs.StringVar(&svg, "svg", "", "")
	fs.StringVar(&o.Dsecd, "dsecd", "/work/main/bin/dsecd", "")
	fs.BoolVar(&js, "json", false, "")
	fs.BoolVar(&o.KeepRoots, "keep-roots", false, "")
	fs.Parse(os.Args[1:])
	o.Modes, _ = bench.ParseModes(modes)
	o.Progress = os.Stderr
	_ = strings.TrimSpace
	rep, err := bench.RunStorage(context.Background(), slog.Default(), o)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if svg != "" {
		f, _ := os.Create(svg)
		rep.SVG(f)
		f.Close()
	}
	if js {
		rep.JSON(os.Stdout)
	} else {
		rep.Print(os.Stdout)
	}
}
