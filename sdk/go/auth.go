package dsec

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
)

// DefaultTokenFile is where the all-in-one dsecd writes the local node's
// admin token.
const DefaultTokenFile = "/var/lib/dsec/admin.token"

// defaultTokenFile is DefaultTokenFile, elsewhere in tests.
var defaultTokenFile = DefaultTokenFile

// credential is the bearer token a client sends and where it came from.
// The token itself never goes into an error or a log line: only source and
// note do.
type credential struct {
	token  string
	source string // "$DSEC_TOKEN", "token file /x ($DSEC_TOKEN_FILE)", ...; "" with no token
	note   string // with no token: why the node's token file was not used, if it was not absent
	// hint is how to give a token explicitly ("use WithToken", "give
	// --token"), for the message of a call sent with none.
	hint string
	// nodeDefault says the token is the default root's, read because
	// nothing else named one: refused, it is most likely another dsecd's.
	nodeDefault bool
}

// Token returns the token Dial would send with explicit as
// DialOptions.Token (optionName names it in messages), and where it came
// from; "" when there is none, with why the node's token file was not
// used, if known. The CLI's `dsec e2b env` prints it in E2B's form.
func Token(explicit, optionName string) (token, source string, err error) {
	c, err := loadCredential(explicit, optionName, "")
	if err != nil {
		return "", "", dialError(err)
	}
	if c.token == "" {
		return "", c.note, nil
	}
	return c.token, c.source, nil
}

// loadCredential finds the token: explicit (from the option called
// optionName), else $DSEC_TOKEN, else the file named by $DSEC_TOKEN_FILE,
// else DefaultTokenFile when it exists and is readable, else none. A token
// file named on purpose must be readable; the node's default one may be
// missing or unreadable (this user is not its admin). hint is how to give
// one explicitly, for messages.
func loadCredential(explicit, optionName, hint string) (credential, error) {
	c, err := findCredential(explicit, optionName)
	c.hint = hint
	return c, err
}

func findCredential(explicit, optionName string) (credential, error) {
	if explicit != "" {
		return checkToken(explicit, optionName)
	}
	if env := os.Getenv("DSEC_TOKEN"); env != "" {
		return checkToken(env, "$DSEC_TOKEN")
	}
	if path := os.Getenv("DSEC_TOKEN_FILE"); path != "" {
		source := "token file " + path + " ($DSEC_TOKEN_FILE)"
		b, err := os.ReadFile(path)
		if err != nil {
			return credential{}, invalid("read %s: %v", source, cause(err))
		}
		return checkToken(string(b), source)
	}
	b, err := os.ReadFile(defaultTokenFile)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return credential{}, nil
	case err != nil:
		return credential{note: defaultTokenFile + " is not readable: " + cause(err).Error()}, nil
	case strings.TrimSpace(string(b)) == "":
		return credential{note: defaultTokenFile + " is empty"}, nil
	}
	c, err := checkToken(string(b), "token file "+defaultTokenFile)
	c.nodeDefault = true
	return c, err
}

func checkToken(token, source string) (credential, error) {
	token = strings.TrimSpace(token)
	if token == "" {
		return credential{}, invalid("the token from %s is empty", source)
	}
	for _, r := range token {
		if r <= ' ' || r == 0x7f {
			return credential{}, invalid("the token from %s holds a space or control character", source)
		}
	}
	return credential{token: token, source: source}, nil
}

// describe says where the token came from, for an Unauthenticated answer.
func (c credential) describe() string {
	if c.nodeDefault {
		return "token from " + c.source + ", the default root's: a dsecd started with --root DIR keeps its own in DIR/admin.token, so export DSEC_TOKEN_FILE=DIR/admin.token"
	}
	if c.token != "" {
		return "token from " + c.source
	}
	s := "no token sent: set $DSEC_TOKEN or $DSEC_TOKEN_FILE, or " + c.hint
	if c.note != "" {
		s += "; " + c.note
	}
	return s
}

// redact removes the token from a message a server sent back.
func (c credential) redact(msg string) string {
	if c.token == "" {
		return msg
	}
	return strings.ReplaceAll(msg, c.token, "[token]")
}

// tlsConfig verifies https:// apiservers with caFile, else $DSEC_CA_FILE,
// else the system roots (nil).
func tlsConfig(caFile string) (*tls.Config, error) {
	source := caFile
	if caFile == "" {
		caFile = os.Getenv("DSEC_CA_FILE")
		source = caFile + " ($DSEC_CA_FILE)"
	}
	if caFile == "" {
		return nil, nil
	}
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, invalid("read CA file %s: %v", source, cause(err))
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		return nil, invalid("CA file %s holds no PEM certificate", source)
	}
	return &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}, nil
}

func (c credential) String() string { return fmt.Sprintf("credential(%s)", c.describe()) }

// cause is a file error without the path, which the message names already.
func cause(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}
