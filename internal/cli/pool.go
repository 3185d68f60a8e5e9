package cli

import (
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

func (a *app) poolCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "pool",
		Short: "keep sandboxes of one shape started and idle, so that creates of that shape take one at once",
	}
	cmd.AddCommand(a.poolSetCommand(), a.poolLsCommand(), a.poolRmCommand())
	return cmd
}

func (a *app) poolSetCommand() *cobra.Command {
	var sf specFlags
	var size int32
	cmd := &cobra.Command{
		Use: "set [flags] ENV",
		Short: "keep --size sandboxes of this shape ready; a create with the same environment and shape flags " +
			"(labels, --ttl and --idle-timeout aside) takes one",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if size < 0 {
				return fmt.Errorf("--size %d: want 0 or more", size)
			}
			return a.setPool(cmd, &sf, args[0], size)
		},
	}
	sf.addShape(cmd)
	cmd.Flags().Int32Var(&size, "size", 1, "sandboxes kept ready on each node; 0 removes the pool")
	return cmd
}

func (a *app) poolRmCommand() *cobra.Command {
	var sf specFlags
	cmd := &cobra.Command{
		Use:   "rm [flags] ENV",
		Short: "remove the warm pool of this shape and its idle sandboxes (the same as pool set --size 0)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.setPool(cmd, &sf, args[0], 0)
		},
	}
	sf.addShape(cmd)
	return cmd
}

func (a *app) setPool(cmd *cobra.Command, sf *specFlags, env string, size int32) error {
	spec, err := sf.spec(env)
	if err != nil {
		return err
	}
	res, err := a.c.Sandboxes.SetWarmPool(cmd.Context(), connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: spec, Size: size}))
	if err != nil {
		return err
	}
	if a.json {
		return a.printProto(res.Msg)
	}
	return printPools(a.stdout, []*dsecv1.WarmPool{res.Msg})
}

func (a *app) poolLsCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "ls",
		Short: "list the warm pools of every node and how full they are",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			res, err := a.c.Sandboxes.ListWarmPools(cmd.Context(), connect.NewRequest(&dsecv1.ListWarmPoolsRequest{}))
			if err != nil {
				return err
			}
			if a.json {
				return a.printProto(res.Msg)
			}
			return printPools(a.stdout, res.Msg.GetPools())
		},
	}
}

// printPools writes pools as a table; keys are cut to 12 characters as
// they are only told apart by eye.
func printPools(w io.Writer, pools []*dsecv1.WarmPool) error {
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NODE\tENV\tKEY\tCPUS\tMEM MB\tQOS\tSIZE\tREADY\tSTARTING\tTAKEN\tMISSED\tLAST ERROR")
	for _, p := range pools {
		key := p.GetKey()
		if len(key) > 12 {
			key = key[:12]
		}
		spec := p.GetSpec()
		class := spec.GetQos()
		if class == "" {
			class = "latency" // the apiserver's default
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\t%d\t%d\t%d\t%d\t%d\t%s\n", p.GetNode(), spec.GetEnvironment(), key,
			strconv.FormatFloat(spec.GetCpus(), 'f', -1, 64), spec.GetMemoryMb(), class, p.GetSize(), p.GetReady(),
			p.GetStarting(), p.GetTaken(), p.GetMissed(), p.GetLastError())
	}
	return tw.Flush()
}
