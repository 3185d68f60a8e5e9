package cli

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/spf13/cobra"

	"dsec.dev/dsec/sdk/go/receipt"
)

func (a *app) receiptCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "receipt",
		Short: "check signed grade receipts offline",
	}
	cmd.AddCommand(a.receiptVerifyCommand())
	return cmd
}

func (a *app) receiptVerifyCommand() *cobra.Command {
	var trust string
	cmd := &cobra.Command{
		Use:   "verify FILE...",
		Short: "verify signed grade receipts offline against the cluster's CA or a node's certificate (--ca)",
		Long: `verify checks each signed receipt: its signature over the exact payload, its
certificate (issued by the CA --ca names, or the node certificate --ca names
itself, valid when the receipt was signed) and that it names the node its
certificate names. It needs no dsecd. Any edited field fails, saying why; the
exit is 1 if any receipt fails. --json prints the verified receipts.`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if trust == "" {
				return errors.New("receipt verify: --ca is required: the cluster's CA bundle (ca.crt), or the all-in-one node's certificate (ROOT/receipt/node.crt)")
			}
			v, err := receipt.NewVerifierFile(trust)
			if err != nil {
				return err
			}
			var verified []*receipt.Receipt
			var failed []string
			for _, path := range args {
				r, err := v.VerifyFile(path)
				if err != nil {
					failed = append(failed, fmt.Sprintf("%s: %v", path, err))
					continue
				}
				verified = append(verified, r)
				if !a.json {
					fmt.Fprintf(a.stdout, "%s: verified: %s\n", path, receiptText(r))
				}
			}
			if a.json {
				if err := a.printJSON(verified); err != nil {
					return err
				}
			}
			if len(failed) > 0 {
				return errors.New(strings.Join(failed, "\n"))
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&trust, "ca", "", "PEM file of the certificates to trust: the cluster's CA bundle, or a node's own certificate")
	// Verifying is offline: no dsecd to dial.
	cmd.PersistentPreRunE = func(*cobra.Command, []string) error { return nil }
	return cmd
}

// receiptText is a receipt in one line: what was graded where, and what it
// found.
func receiptText(r *receipt.Receipt) string {
	result := fmt.Sprintf("reward %g (exit %d)", r.Reward, r.Exit)
	if r.Outcome == "fault" {
		result = "fault " + r.Fault + ", no reward"
	}
	line := fmt.Sprintf("sandbox %s graded on node %s, %s, signed %s", r.Sandbox, r.Node, result, r.SignedAt.Format("2006-01-02T15:04:05Z07:00"))
	// The graded sandbox's evidence and the tests: which the node checked
	// itself, and which it signed as the apiserver gave them.
	var unchecked []string
	for _, f := range []string{"grader_digest", "trajectory_hash", "provenance_flags"} {
		if !slices.Contains(r.Vouched, f) {
			unchecked = append(unchecked, f)
		}
	}
	if len(unchecked) > 0 {
		line += "; not checked by the node: " + strings.Join(unchecked, ", ")
	}
	return line
}
