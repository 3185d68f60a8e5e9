package sandboxfusion

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// Runner runs calls: the apiserver's FnCallService (placement over the
// cluster's edges). A failure of the program is a result; an error means
// the call could not be run (InvalidArgument for a bad request,
// ResourceExhausted when the cluster is full), as FnCallService.RunCode
// documents.
type Runner interface {
	RunCode(ctx context.Context, req *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error)
}

// Config configures a Handler. The zero value works.
type Config struct {
	// MaxInFlight is how many calls run at once through this handler
	// (each /run_code and /run_jupyter request is one call, each case
	// of a /submit another); 0 = 256.
	MaxInFlight int
	// MaxQueue is how many calls may wait for one of those slots; a call
	// beyond it is answered 504 at once. 0 = 4096, negative = no queue.
	MaxQueue int
	// MaxBodyBytes caps a request's body (413 beyond); 0 = 160 MiB, room
	// for 100 MB of files in base64.
	MaxBodyBytes int64
	// Log receives the runner's failures; nil = discard.
	Log *slog.Logger
	// Authorize, when set, decides every call but /v1/ping by its bearer
	// token (Authorization: Bearer, "" when the call has none: dsecd runs
	// such a call in the project its operator names for them, or refuses
	// it) and returns the context to run it in; an error wrapping
	// errdefs.ErrUnauthenticated answers 401, ErrPermissionDenied 403.
	Authorize func(ctx context.Context, token, peer string) (context.Context, error)
}

// Defaults of Config.
const (
	DefaultMaxInFlight  = 256
	DefaultMaxQueue     = 4096
	DefaultMaxBodyBytes = 160 << 20
)

type handler struct {
	r      Runner
	cfg    Config
	log    *slog.Logger
	gate   *gate
	routes map[string]route
}

type route struct {
	method string
	serve  func(http.ResponseWriter, *http.Request)
}

// NewHandler serves SandboxFusion's API over r. The handler holds no
// resources beyond its requests; it may be dropped at any time.
func NewHandler(r Runner, cfg Config) http.Handler {
	if cfg.MaxInFlight <= 0 {
		cfg.MaxInFlight = DefaultMaxInFlight
	}
	switch {
	case cfg.MaxQueue == 0:
		cfg.MaxQueue = DefaultMaxQueue
	case cfg.MaxQueue < 0:
		cfg.MaxQueue = 0
	}
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	h := &handler{r: r, cfg: cfg, log: cfg.Log, gate: newGate(cfg.MaxInFlight, cfg.MaxQueue)}
	h.routes = map[string]route{
		"/v1/ping":     {http.MethodGet, h.ping},
		"/run_code":    {http.MethodPost, h.runCode},
		"/submit":      {http.MethodPost, h.submit},
		"/run_jupyter": {http.MethodPost, h.runJupyter},
	}
	return h
}

func (h *handler) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	rt, ok := h.routes[req.URL.Path]
	if !ok {
		writeJSON(w, http.StatusNotFound, detail("Not Found"))
		return
	}
	if req.Method != rt.method && !(rt.method == http.MethodGet && req.Method == http.MethodHead) {
		w.Header().Set("Allow", rt.method)
		writeJSON(w, http.StatusMethodNotAllowed, detail("Method Not Allowed"))
		return
	}
	if h.cfg.Authorize != nil && req.URL.Path != "/v1/ping" {
		tok, _ := strings.CutPrefix(req.Header.Get("Authorization"), "Bearer ")
		ctx, err := h.cfg.Authorize(req.Context(), strings.TrimSpace(tok), req.RemoteAddr)
		if err != nil {
			status := http.StatusServiceUnavailable
			switch {
			case errors.Is(err, errdefs.ErrUnauthenticated):
				status = http.StatusUnauthorized
			case errors.Is(err, errdefs.ErrPermissionDenied):
				status = http.StatusForbidden
			}
			writeJSON(w, status, detail("%s", err.Error()))
			return
		}
		req = req.WithContext(ctx)
	}
	rt.serve(w, req)
}

func (h *handler) ping(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, "pong")
}

// detailBody is FastAPI's body for an HTTPException.
type detailBody struct {
	Detail string `json:"detail"`
}

func detail(format string, a ...any) detailBody { return detailBody{fmt.Sprintf(format, a...)} }

// writeJSON answers v as Starlette's JSONResponse does: compact, UTF-8
// as is, no HTML escaping.
func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(v) // the client may be gone; nothing to do about it
}

// errOverloaded is the gate's refusal: every slot busy and the queue full.
var errOverloaded = errors.New("overloaded")

// gate admits calls: up to inFlight at once, up to maxQueue waiting for a
// slot in arrival order. A waiter whose context ends leaves the queue.
type gate struct {
	slots    chan struct{}
	maxQueue int64
	waiting  atomic.Int64
}

func newGate(inFlight, maxQueue int) *gate {
	return &gate{slots: make(chan struct{}, inFlight), maxQueue: int64(maxQueue)}
}

// enter takes a slot, waiting in the queue if there is room in it; it
// returns errOverloaded when there is none, or ctx's error.
func (g *gate) enter(ctx context.Context) error {
	select {
	case g.slots <- struct{}{}:
		return nil
	default:
	}
	if g.waiting.Add(1) > g.maxQueue {
		g.waiting.Add(-1)
		return errOverloaded
	}
	defer g.waiting.Add(-1)
	select {
	case g.slots <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (g *gate) leave() { <-g.slots }

// overloadedDetail is the 504's body: the gate's count, or the reason a
// node gave (no container could take the call in time, say).
func (h *handler) overloadedDetail(err error) detailBody {
	if errors.Is(err, errOverloaded) {
		return detail("dsec is at capacity: %d calls running and %d waiting; retry later", h.cfg.MaxInFlight, h.cfg.MaxQueue)
	}
	msg := err.Error()
	if ce := new(connect.Error); errors.As(err, &ce) {
		msg = ce.Message()
	}
	return detail("dsec is at capacity: %s; retry later", strings.TrimSuffix(msg, ": "+errdefs.ErrResourceExhausted.Error()))
}
