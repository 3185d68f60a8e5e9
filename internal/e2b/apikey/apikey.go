// Package apikey converts between dsec tokens and E2B API keys. It is the
// part of package e2b that clients need (the CLI's `dsec e2b env`), kept
// apart so that they do not link the server's dependencies.
//
// A dsec token is "dsec_" and 32 bytes in unpadded base64url; an E2B API
// key is "e2b_" and the same bytes in hexadecimal, the form E2B's SDKs
// check (^e2b_[0-9a-f]+$).
package apikey

import (
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"strings"

	"dsec.dev/dsec/internal/errdefs"
)

const (
	dsecTokenPrefix = "dsec_"
	apiKeyPrefix    = "e2b_"
)

// Of is the E2B API key of a dsec token.
func Of(token string) (string, error) {
	rest, ok := strings.CutPrefix(token, dsecTokenPrefix)
	b, err := base64.RawURLEncoding.DecodeString(rest)
	if !ok || err != nil || len(b) == 0 {
		return "", fmt.Errorf("not a dsec token (dsec_ and base64url): %w", errdefs.ErrInvalidArgument)
	}
	return apiKeyPrefix + hex.EncodeToString(b), nil
}

// Token is the dsec token an E2B API key stands for. A dsec token given as
// it is (dsec_…) is accepted too, for SDKs told not to check the key's
// form (E2B_VALIDATE_API_KEY=false).
func Token(key string) (string, error) {
	if strings.HasPrefix(key, dsecTokenPrefix) {
		return key, nil
	}
	rest, ok := strings.CutPrefix(key, apiKeyPrefix)
	b, err := hex.DecodeString(rest)
	if !ok || err != nil || len(b) == 0 {
		return "", fmt.Errorf("an E2B API key is e2b_ and hexadecimal digits (dsec token --e2b prints one): %w", errdefs.ErrUnauthenticated)
	}
	return dsecTokenPrefix + base64.RawURLEncoding.EncodeToString(b), nil
}
