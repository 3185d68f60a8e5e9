package e2b

import (
	"encoding/base32"
	"fmt"
	"strings"

	"dsec.dev/dsec/internal/e2b/apikey"
	"dsec.dev/dsec/internal/errdefs"
)

// idEncoding spells a dsec sandbox ID in E2B's alphabet (a-z, 2-7).
var idEncoding = base32.NewEncoding("abcdefghijklmnopqrstuvwxyz234567").WithPadding(base32.NoPadding)

// SandboxID is the E2B ID of the dsec sandbox id.
func SandboxID(id string) string { return idEncoding.EncodeToString([]byte(id)) }

// DsecID is the dsec sandbox ID an E2B ID names.
func DsecID(e2bID string) (string, error) {
	b, err := idEncoding.DecodeString(e2bID)
	if err != nil || !strings.HasPrefix(string(b), "sb-") {
		return "", fmt.Errorf("%q is not a sandbox ID this server gave: %w", e2bID, errdefs.ErrNotFound)
	}
	return string(b), nil
}

// APIKey is the E2B API key of a dsec token: `dsec token --e2b` prints it
// (package apikey has the conversion, for clients).
func APIKey(token string) (string, error) { return apikey.Of(token) }

// TokenOf is the dsec token an E2B API key stands for; a dsec token given
// as it is (dsec_…) is accepted too, for SDKs told not to check the key's
// form (E2B_VALIDATE_API_KEY=false).
func TokenOf(key string) (string, error) { return apikey.Token(key) }
