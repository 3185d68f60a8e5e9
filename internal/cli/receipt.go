package cli

import (
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/spf13/cobra"

	dsec "dsec.dev/dsec/sdk/go"
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
exit is 1 if any receipt fails. --json prints the verified receipts.

Without --ca it trusts the node certificate of the all-in-one dsecd on this
machine (ROOT/receipt/node.crt, and node.crt.old, the one before a renewal),
ROOT being the directory of the Unix socket --addr or $DSEC_ADDR names, else
that of $DSEC_TOKEN_FILE, else /var/lib/dsec. A cluster's receipts need --ca
with the cluster's CA bundle (ca.crt).`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var v *receipt.Verifier
			var err error
			if trust != "" {
				v, err = receipt.NewVerifierFile(trust)
			} else {
				var used []string
				v, used, err = a.localNodeTrust()
				if err == nil && !a.json {
					fmt.Fprintf(a.stderr, "trusting the all-in-one's node certificate %s (--ca names another trust)\n", strings.Join(used, " and "))
				}
			}
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

// nodeReceiptDir is where under its root an all-in-one dsecd keeps its
// receipt key and certificate (internal/receipt.Dir, which the CLI does not
// link).
const nodeReceiptDir = "receipt"

// localNodeTrust is the verifier of receipts of the all-in-one dsecd on
// this machine: its node certificate (and the one before a renewal),
// found in the first root among those the CLI's address and token file
// point at, else the default root; the files it trusts.
func (a *app) localNodeTrust() (*receipt.Verifier, []string, error) {
	var roots []string
	addr := a.addr
	if addr == "" {
		addr = os.Getenv("DSEC_ADDR")
	}
	if addr == "" {
		addr = dsec.DefaultAddr
	}
	for _, one := range strings.Split(addr, ",") {
		if socket, ok := strings.CutPrefix(strings.TrimSpace(one), "unix://"); ok {
			roots = append(roots, filepath.Dir(socket))
		}
	}
	if f := os.Getenv("DSEC_TOKEN_FILE"); f != "" {
		roots = append(roots, filepath.Dir(f))
	}
	roots = append(roots, filepath.Dir(dsec.DefaultTokenFile)) // the default root
	var tried []string
	for _, root := range slices.Compact(roots) {
		cert := filepath.Join(root, nodeReceiptDir, "node.crt")
		data, err := os.ReadFile(cert)
		if err != nil {
			tried = append(tried, fmt.Sprintf("%s (%v)", cert, errors.Unwrap(err)))
			continue
		}
		used := []string{cert}
		if old, err := os.ReadFile(cert + ".old"); err == nil {
			data = append(append(data, '\n'), old...)
			used = append(used, cert+".old")
		}
		certs, err := parseCertificates(data)
		if err != nil {
			return nil, nil, fmt.Errorf("receipt verify: %s: %w", cert, err)
		}
		v, err := receipt.NewVerifier(certs)
		return v, used, err
	}
	return nil, nil, fmt.Errorf("receipt verify: no --ca, and no all-in-one node certificate on this machine to trust instead: tried %s; "+
		"pass --ca with the cluster's CA bundle (ca.crt) or the all-in-one node's certificate (ROOT/receipt/node.crt)", strings.Join(tried, ", "))
}

// parseCertificates reads every PEM certificate of data.
func parseCertificates(data []byte) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	for {
		var b *pem.Block
		b, data = pem.Decode(data)
		if b == nil {
			break
		}
		if b.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return nil, fmt.Errorf("parse certificate: %w", err)
		}
		out = append(out, c)
	}
	if len(out) == 0 {
		return nil, errors.New("no PEM certificate in it")
	}
	return out, nil
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
