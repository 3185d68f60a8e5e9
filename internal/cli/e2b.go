package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"os"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/e2b/apikey"
	dsec "dsec.dev/dsec/sdk/go"
)

func (a *app) e2bCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "e2b",
		Short: "use dsec through E2B's SDKs",
	}
	cmd.AddCommand(a.e2bEnvCommand())
	return cmd
}

func (a *app) e2bEnvCommand() *cobra.Command {
	var addr string
	cmd := &cobra.Command{
		Use:   "env",
		Short: "print the environment that points E2B's SDKs at dsecd",
		Long: `Env prints shell exports that point E2B's SDKs (npm e2b, PyPI e2b,
e2b-code-interpreter) at the E2B API a dsecd serves (dsecd --e2b-listen):
E2B_API_URL and E2B_SANDBOX_URL are both that address, and E2B_API_KEY is
this CLI's token (--token, $DSEC_TOKEN, ...) in E2B's form. Use it as

    eval "$(dsec e2b env)"

The address is --e2b-addr, else $DSEC_E2B_ADDR, else the one the dsecd
(or apiserver) this CLI talks to says it serves E2B's API on.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if addr == "" {
				addr = os.Getenv("DSEC_E2B_ADDR")
			}
			if addr == "" {
				served, err := a.servedE2BAddr(cmd.Context())
				if err != nil {
					return err
				}
				addr = served
			}
			base, err := e2bBaseURL(addr)
			if err != nil {
				return err
			}
			tok, source, err := dsec.Token(a.token, "--token")
			if err != nil {
				return err
			}
			if tok == "" {
				why := ""
				if source != "" {
					why = " (" + source + ")"
				}
				return fmt.Errorf("no dsec API token to make an E2B API key of%s: pass --token, or set $DSEC_TOKEN or $DSEC_TOKEN_FILE", why)
			}
			key, err := apikey.Of(tok)
			if err != nil {
				return fmt.Errorf("the token from %s: %w", source, err)
			}
			if a.json {
				enc := json.NewEncoder(a.stdout)
				enc.SetIndent("", "  ")
				return enc.Encode(map[string]string{"E2B_API_URL": base, "E2B_SANDBOX_URL": base, "E2B_API_KEY": key})
			}
			fmt.Fprintf(a.stdout, "export E2B_API_URL=%s E2B_SANDBOX_URL=%s E2B_API_KEY=%s\n", base, base, key)
			return nil
		},
	}
	cmd.Flags().StringVar(&addr, "e2b-addr", "", "where dsecd serves E2B's API (host:port or http://host:port; default $DSEC_E2B_ADDR, else where the server says it serves it)")
	return cmd
}

// servedE2BAddr asks the server where it serves E2B's API. An address it
// listens on for every host (0.0.0.0:P) is reached at the host this CLI
// reaches the API at, or loopback over a Unix socket.
func (a *app) servedE2BAddr(ctx context.Context) (string, error) {
	info, err := a.c.Sandboxes.GetServerInfo(ctx, connect.NewRequest(&dsecv1.GetServerInfoRequest{}))
	if err != nil {
		return "", fmt.Errorf("ask the server where it serves E2B's API (or pass --e2b-addr): %s", describe(err))
	}
	served := info.Msg.GetE2BAddr()
	if served == "" {
		return "", fmt.Errorf("%s serves no E2B API: start dsecd with --e2b-listen 127.0.0.1:49982 (an apiserver likewise), or pass --e2b-addr", serverName(info.Msg))
	}
	host, port, err := net.SplitHostPort(served)
	if err != nil {
		return "", fmt.Errorf("the server's E2B address %q: %w", served, err)
	}
	if ip, err := netip.ParseAddr(host); err == nil && ip.IsUnspecified() {
		host = "127.0.0.1"
		first, _, _ := strings.Cut(dsec.Addr(a.addr), ",")
		if u, err := url.Parse(first); err == nil && (u.Scheme == "http" || u.Scheme == "https") {
			host = u.Hostname()
		} else if h, _, err := net.SplitHostPort(first); err == nil && !strings.Contains(first, "://") {
			host = h
		}
	}
	return net.JoinHostPort(host, port), nil
}

func serverName(info *dsecv1.ServerInfo) string {
	if info.GetName() == "" {
		return "the server"
	}
	return "the server " + info.GetName()
}

// e2bBaseURL is the E2B API's base URL from addr (host:port or an http(s)
// URL without a path: E2B's SDKs drop a sandbox URL's path).
func e2bBaseURL(addr string) (string, error) {
	if !strings.Contains(addr, "://") {
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return "", fmt.Errorf("--e2b-addr %q: host:port or http://host:port: %v", addr, err)
		}
		addr = "http://" + addr
	}
	u, err := url.Parse(addr)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return "", fmt.Errorf("--e2b-addr %q: host:port or http://host:port", addr)
	}
	if strings.Trim(u.Path, "/") != "" || u.RawQuery != "" {
		return "", fmt.Errorf("--e2b-addr %q: no path (E2B's SDKs drop it from file URLs)", addr)
	}
	return u.Scheme + "://" + u.Host, nil
}
