package e2b

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"

	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// Authenticator checks a dsec token; the metadata store is one.
type Authenticator interface {
	Authenticate(ctx context.Context, token string) (iam.Authority, error)
}

// Config configures a Handler.
type Config struct {
	// API is dsec's SandboxService, called with the caller's rights
	// already checked here (dsecd passes an in-process client of its own
	// apiserver). Required.
	API dsecv1connect.SandboxServiceClient
	// Auth checks the dsec token behind an E2B API key. Required.
	Auth Authenticator
	// Signer makes and checks the sandboxes' envd access tokens. Required.
	Signer Signer
	// Templates maps E2B template names to dsec environments, on top of
	// DefaultTemplates; a template not named in either is taken as an
	// environment itself.
	Templates map[string]string
	// Domain is answered as the sandboxes' domain; "" = the request's host.
	Domain string
	// Log receives what went wrong on the server's side; nil = discard.
	Log *slog.Logger
}

// DefaultTemplates are the E2B template names known without configuration:
// E2B's base template and its code interpreter, both served by the
// environment scripts/build-e2b-base.sh builds.
var DefaultTemplates = map[string]string{
	"base":                "e2b-base",
	"code-interpreter-v1": "e2b-base",
	"code-interpreter":    "e2b-base",
}

// E2B's data-plane ports, named in E2b-Sandbox-Port.
const (
	EnvdPort        = "49983"
	InterpreterPort = "49999"
)

// EnvdVersion is the envd version sandboxes report: 0.5.7 and later gets
// octet-stream uploads and per-user paths from the SDKs.
const EnvdVersion = "0.5.8"

// Handler serves E2B's control and data planes on one port.
type Handler struct {
	cfg     Config
	api     dsecv1connect.SandboxServiceClient
	log     *slog.Logger
	keys    *keyCache
	alive   *liveCache
	control http.Handler // E2B's REST API
	envd    http.Handler // envd: process, filesystem, /files, /health
	interp  http.Handler // the code interpreter
	procs   *procTable   // what envd's process service keeps between calls
	watches *watchTable  // the filesystem watchers of CreateWatcher
}

// NewHandler returns a handler of E2B's API over cfg.API.
func NewHandler(cfg Config) (*Handler, error) {
	if cfg.API == nil || cfg.Auth == nil || len(cfg.Signer.secret) == 0 {
		return nil, errors.New("e2b: a SandboxService client, an authenticator and a signer are required")
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	t := map[string]string{}
	for k, v := range DefaultTemplates {
		t[k] = v
	}
	for k, v := range cfg.Templates {
		t[k] = v
	}
	cfg.Templates = t
	h := &Handler{cfg: cfg, api: cfg.API, log: cfg.Log, keys: &keyCache{m: map[[32]byte]time.Time{}},
		alive: &liveCache{m: map[string]time.Time{}},
		procs: newProcTable(), watches: newWatchTable()}
	h.control = h.controlPlane()
	h.envd = h.envdPlane()
	h.interp = h.interpreterPlane()
	return h, nil
}

// ServeHTTP dispatches on E2b-Sandbox-Id: present, the data plane of that
// sandbox; absent, the control plane (or a signed /files URL, which
// carries no header).
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if id := r.Header.Get("E2b-Sandbox-Id"); id != "" {
		h.serveSandbox(w, r, id)
		return
	}
	if r.URL.Path == "/files" && r.URL.Query().Get("signature") != "" {
		h.serveSignedFiles(w, r)
		return
	}
	h.control.ServeHTTP(w, r)
}

// target is the sandbox a data-plane request is for, and who asks.
type target struct {
	ID    string // dsec's sandbox ID
	E2BID string
	User  string // the user of Authorization: Basic; "" = the default
}

type targetKey struct{}

func withTarget(ctx context.Context, t target) context.Context {
	return context.WithValue(ctx, targetKey{}, t)
}

// targetOf is the sandbox of a data-plane request.
func targetOf(ctx context.Context) target {
	t, _ := ctx.Value(targetKey{}).(target)
	return t
}

// serveSandbox routes a data-plane request. An unknown, malformed or dead
// sandbox is answered 502, as E2B's proxy does; a wrong or missing access
// token 401.
func (h *Handler) serveSandbox(w http.ResponseWriter, r *http.Request, e2bID string) {
	id, err := DsecID(e2bID)
	if err != nil {
		writeError(w, http.StatusBadGateway, "sandbox "+e2bID+" is not found")
		return
	}
	port := r.Header.Get("E2b-Sandbox-Port")
	if port == "" {
		port = EnvdPort
	}
	if port != EnvdPort && port != InterpreterPort {
		writeError(w, http.StatusBadGateway, "sandbox "+e2bID+" serves nothing on port "+port)
		return
	}
	open := r.URL.Path == "/health" || (r.URL.Path == "/files" && r.URL.Query().Get("signature") != "")
	// The code interpreter's SDKs send the envd access token with /execute
	// only; with the /contexts calls they send the traffic access token
	// instead, which the control plane gives out beside it.
	authorized := h.cfg.Signer.CheckAccessToken(id, r.Header.Get("X-Access-Token")) ||
		(port == InterpreterPort && h.cfg.Signer.CheckTrafficToken(id, r.Header.Get("E2B-Traffic-Access-Token")))
	if !open && !authorized {
		writeError(w, http.StatusUnauthorized, "the sandbox's access token is missing or wrong (X-Access-Token, or E2B-Traffic-Access-Token for the code interpreter)")
		return
	}
	if err := h.live(r.Context(), id); err != nil {
		writeError(w, http.StatusBadGateway, "sandbox "+e2bID+" is not running: "+err.Error())
		return
	}
	ctx := withTarget(r.Context(), target{ID: id, E2BID: e2bID, User: basicUser(r)})
	r = r.WithContext(ctx)
	if port == InterpreterPort {
		h.interp.ServeHTTP(w, r)
		return
	}
	h.envd.ServeHTTP(w, r)
}

// basicUser is the user named by "Authorization: Basic base64(user:)".
func basicUser(r *http.Request) string {
	u, _, ok := r.BasicAuth()
	if !ok {
		return ""
	}
	return u
}

// DefaultUser is the user E2B's data-plane calls run as when they name none.
const DefaultUser = "user"

// homeOf is a user's home directory, against which relative paths resolve.
func homeOf(user string) string {
	switch user {
	case "", DefaultUser:
		return "/home/user"
	case "root", "0":
		return "/root"
	}
	return "/home/" + user
}

// userOf is the user a data-plane call runs as: the one asked for, else
// E2B's DefaultUser.
func userOf(t target) string {
	if t.User == "" {
		return DefaultUser
	}
	return t.User
}

// resolve makes p absolute against the user's home.
func resolve(t target, p string) string {
	if p == "" {
		return homeOf(userOf(t))
	}
	if strings.HasPrefix(p, "/") {
		return p
	}
	return strings.TrimSuffix(homeOf(userOf(t)), "/") + "/" + p
}

// errorBody is E2B's error shape, on both planes.
type errorBody struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

// writeError answers status with E2B's {code, message}.
func writeError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(errorBody{Code: status, Message: msg})
}

// writeJSON answers status with v.
func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}

// statusOf is the HTTP status of a dsec error, as E2B's API would answer it.
func statusOf(err error) int {
	switch connect.CodeOf(errdefs.ToConnect(err)) {
	case connect.CodeInvalidArgument, connect.CodeOutOfRange:
		return http.StatusBadRequest
	case connect.CodeNotFound:
		return http.StatusNotFound
	case connect.CodeAlreadyExists, connect.CodeFailedPrecondition, connect.CodeAborted:
		return http.StatusConflict
	case connect.CodeUnauthenticated:
		return http.StatusUnauthorized
	case connect.CodePermissionDenied:
		return http.StatusForbidden
	case connect.CodeResourceExhausted:
		return http.StatusTooManyRequests
	case connect.CodeUnavailable:
		return http.StatusServiceUnavailable
	case connect.CodeUnimplemented:
		return http.StatusNotImplemented
	case connect.CodeDeadlineExceeded:
		return http.StatusGatewayTimeout
	}
	return http.StatusInternalServerError
}

// messageOf is err's message without Connect's code prefix.
func messageOf(err error) string {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Message()
	}
	return err.Error()
}
