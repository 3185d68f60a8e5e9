package vmnet

import (
	"os"
	"testing"

	"dsec.dev/dsec/internal/testutil"
)

// TestMain removes the binaries the tests built, once they ended.
func TestMain(m *testing.M) {
	code := m.Run()
	testutil.RemoveBinaries()
	os.Exit(code)
}
