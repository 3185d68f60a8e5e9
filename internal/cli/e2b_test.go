package cli

import (
	"context"
	"strings"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// serverInfoFake is a server that says where it serves E2B's API.
type serverInfoFake struct {
	fakeSandboxes
	e2b string
}

func (f *serverInfoFake) GetServerInfo(ctx context.Context, r *connect.Request[dsecv1.GetServerInfoRequest]) (*connect.Response[dsecv1.ServerInfo], error) {
	return connect.NewResponse(&dsecv1.ServerInfo{Name: "n1", E2BAddr: f.e2b}), nil
}

// TestE2BEnvAsksTheServer: with no --e2b-addr nor $DSEC_E2B_ADDR, `dsec e2b
// env` prints the address the server says it serves E2B's API on (every
// host's becomes the host the CLI reaches it at), and says so when it
// serves none instead of printing a port nobody answers on.
func TestE2BEnvAsksTheServer(t *testing.T) {
	t.Setenv("DSEC_E2B_ADDR", "")
	t.Setenv("DSEC_TOKEN", "dsec_0123456789abcdef0123456789abcdef")
	for _, tc := range []struct{ served, want string }{
		{"127.0.0.1:50123", "http://127.0.0.1:50123"},
		{"0.0.0.0:50124", "http://127.0.0.1:50124"}, // the fake is on loopback
		{"[::]:50125", "http://127.0.0.1:50125"},
	} {
		f := &serverInfoFake{e2b: tc.served}
		addr := startHandler(t, f)
		out, errOut, err := runCLIErr(t, addr, "e2b", "env")
		if err != nil || !strings.HasPrefix(out, "export E2B_API_URL="+tc.want+" E2B_SANDBOX_URL="+tc.want+" E2B_API_KEY=e2b_") {
			t.Errorf("served %s: %q %q %v", tc.served, out, errOut, err)
		}
	}
	addr := startHandler(t, &serverInfoFake{})
	if _, _, err := runCLIErr(t, addr, "e2b", "env"); err == nil || !strings.Contains(err.Error(), "serves no E2B API: start dsecd with --e2b-listen") {
		t.Errorf("a server without E2B: %v", err)
	}
	// An address given wins, and no call is needed.
	if out, _, err := runCLIErr(t, addr, "e2b", "env", "--e2b-addr", "10.1.2.3:7"); err != nil || !strings.HasPrefix(out, "export E2B_API_URL=http://10.1.2.3:7 ") {
		t.Errorf("--e2b-addr: %q %v", out, err)
	}
}
