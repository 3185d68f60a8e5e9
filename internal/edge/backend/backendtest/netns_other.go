//go:build !linux

package backendtest

import "testing"

const testHostIP = "198.19.250.1"

type testNet struct{ netnsPath, addr, token string }

// makeTestNet: network namespaces are Linux's.
func makeTestNet(t *testing.T) *testNet {
	t.Skip("network namespaces need Linux")
	return nil
}
