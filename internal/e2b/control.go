package e2b

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// The control plane is E2B's REST API (e2b-dev/infra spec/openapi.yml),
// the calls the SDKs make, each mapped onto dsec's SandboxService:
//
//	POST /sandboxes, /v2/sandboxes           Create (answers once the agent does)
//	GET /sandboxes, /v2/sandboxes            List, filtered by metadata and state, paged
//	GET /sandboxes/{id}                      Get
//	DELETE /sandboxes/{id}                   Delete
//	POST /sandboxes/{id}/timeout             SetTimeout
//	POST /sandboxes/{id}/refreshes           SetTimeout, extend only
//	POST /sandboxes/{id}/connect, /v2/...    Resume if paused, SetTimeout extend only
//	POST /sandboxes/{id}/resume              Resume (E2B's deprecated call)
//	POST /sandboxes/{id}/pause               Pause
//	POST /sandboxes/{id}/fork                Fork (then SetTimeout of each child)
//	POST /sandboxes/{id}/snapshots           Snapshot
//	GET /snapshots, DELETE /templates/{id}   ListSnapshots, DeleteSnapshot
//	GET /sandboxes/{id}/metrics              Metrics (one sample: now)
//	PUT /sandboxes/{id}/network              SetNetworkRules
//	GET /sandboxes/metrics?sandbox_ids=      Metrics of each
//
// What E2B keeps of a sandbox that dsec has no field for lives in its
// labels: the template it was asked for under templateLabel, each metadata
// pair under metadataPrefix and its key, values as they are.
const (
	templateLabel  = "e2b.dev.template"
	metadataPrefix = "e2b.dev.metadata/"
)

const (
	// maxBody bounds a control-plane request body.
	maxBody = 1 << 20
	// defaultTimeout is a sandbox's lifetime when a create names none, as
	// E2B's v2 SDKs default it.
	defaultTimeout = 300
	// defaultPageSize and maxPageSize bound a list's page, as E2B's API.
	defaultPageSize = 100
	maxPageSize     = 100
	// maxFork is the most children one dsec Fork makes.
	maxFork = 16
	// snapshotPrefix starts a snapshot's E2B ID: its dsec layer ref.
	snapshotPrefix = "snap:"
)

// controlPlane is E2B's REST API. Every call checks the API key first.
func (h *Handler) controlPlane() http.Handler {
	mux := http.NewServeMux()
	handle := func(pattern string, f func(http.ResponseWriter, *http.Request) error) {
		mux.Handle(pattern, h.rest(f))
	}
	handle("POST /sandboxes", h.create)
	handle("POST /v2/sandboxes", h.create)
	handle("GET /sandboxes", h.listV1)
	handle("GET /v2/sandboxes", h.listV2)
	handle("GET /sandboxes/metrics", h.metricsMany)
	handle("GET /sandboxes/{id}", h.info)
	handle("DELETE /sandboxes/{id}", h.kill)
	handle("POST /sandboxes/{id}/timeout", h.setTimeout)
	handle("POST /sandboxes/{id}/refreshes", h.refresh)
	handle("POST /sandboxes/{id}/connect", h.connect)
	handle("POST /v2/sandboxes/{id}/connect", h.connect)
	handle("POST /sandboxes/{id}/resume", h.resume)
	handle("POST /sandboxes/{id}/pause", h.pause)
	handle("POST /sandboxes/{id}/fork", h.fork)
	handle("POST /sandboxes/{id}/snapshots", h.snapshot)
	handle("GET /sandboxes/{id}/metrics", h.metrics)
	handle("PUT /sandboxes/{id}/network", h.updateNetwork)
	handle("GET /snapshots", h.listSnapshots)
	handle("DELETE /templates/{id}", h.deleteSnapshot)
	// E2B's health check, open as E2B's is.
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) })
	handle("/", func(w http.ResponseWriter, r *http.Request) error {
		return fmt.Errorf("%s %s is not part of the E2B API this server answers (docs/e2b.md lists what is): %w", r.Method, r.URL.Path, errdefs.ErrNotFound)
	})
	return mux
}

// rest checks the API key, runs f and answers its error in E2B's shape.
func (h *Handler) rest(f func(http.ResponseWriter, *http.Request) error) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tok, err := h.checkKey(r)
		if err == nil {
			err = f(w, r.WithContext(withCaller(r.Context(), tok, r.RemoteAddr)))
		}
		if err == nil {
			return
		}
		status := statusOf(err)
		if status >= 500 {
			h.log.Warn("E2B call failed", "method", r.Method, "path", r.URL.Path, "status", status, "err", err)
		}
		writeError(w, status, messageOf(err))
	})
}

// decode reads r's JSON body into v. An empty body leaves v as it is;
// unknown fields are ignored, so newer SDKs keep working.
func decode(r *http.Request, v any) error {
	b, err := io.ReadAll(http.MaxBytesReader(nil, r.Body, maxBody))
	if err != nil {
		var mb *http.MaxBytesError
		if errors.As(err, &mb) {
			return fmt.Errorf("the request body is over %d bytes: %w", maxBody, errdefs.ErrInvalidArgument)
		}
		return fmt.Errorf("read the request body: %w", errdefs.ErrInvalidArgument)
	}
	if len(strings.TrimSpace(string(b))) == 0 {
		return nil
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("the request body is not the JSON this call takes: %v: %w", err, errdefs.ErrInvalidArgument)
	}
	return nil
}

// sandboxOf is the live dsec sandbox the path's {id} names; an ID this
// server never gave, or a sandbox that stopped, is NotFound (E2B's 404).
func (h *Handler) sandboxOf(r *http.Request) (*dsecv1.Sandbox, error) {
	e2bID := r.PathValue("id")
	id, err := DsecID(e2bID)
	if err != nil {
		return nil, fmt.Errorf("sandbox %q not found: %w", e2bID, errdefs.ErrNotFound)
	}
	sb, err := h.get(r.Context(), id)
	if connect.CodeOf(err) == connect.CodeNotFound {
		return nil, fmt.Errorf("sandbox %s not found: %w", e2bID, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, err
	}
	if stateOf(sb.GetState()) == "" {
		return nil, fmt.Errorf("sandbox %s not found: it is %s: %w", e2bID, stateName(sb.GetState()), errdefs.ErrNotFound)
	}
	return sb, nil
}

// stateOf is a dsec state in E2B's two words, "" for a sandbox E2B would
// not know any more (stopping or ended).
func stateOf(s dsecv1.State) string {
	switch s {
	case dsecv1.State_STATE_CREATING, dsecv1.State_STATE_RUNNING, dsecv1.State_STATE_RESUMING:
		return "running"
	case dsecv1.State_STATE_PAUSING, dsecv1.State_STATE_PAUSED:
		return "paused"
	}
	return ""
}

// newSandbox is E2B's NewSandbox, the body of a create.
type newSandbox struct {
	TemplateID          string            `json:"templateID"`
	Timeout             *int64            `json:"timeout"`
	AutoPause           *bool             `json:"autoPause"`
	AutoResume          *autoResume       `json:"autoResume"`
	AllowInternetAccess *bool             `json:"allow_internet_access"`
	Network             *networkConfig    `json:"network"`
	Metadata            map[string]string `json:"metadata"`
	EnvVars             map[string]string `json:"envVars"`
	VolumeMounts        []json.RawMessage `json:"volumeMounts"`
	Mcp                 json.RawMessage   `json:"mcp"`
}

// autoResume is {"enabled": bool}; older SDKs sent the bool alone.
type autoResume struct{ Enabled bool }

func (a *autoResume) UnmarshalJSON(b []byte) error {
	var v struct {
		Enabled bool `json:"enabled"`
	}
	if err := json.Unmarshal(b, &v); err == nil {
		a.Enabled = v.Enabled
		return nil
	}
	return json.Unmarshal(b, &a.Enabled)
}

// networkConfig is the part of E2B's SandboxNetworkConfig dsec enforces:
// addresses, CIDRs or domains let out or kept in.
type networkConfig struct {
	AllowOut []string `json:"allowOut"`
	DenyOut  []string `json:"denyOut"`
}

// specOf translates a create's body into a dsec spec. env is the
// environment its template names.
func specOf(body newSandbox, env string) (*dsecv1.SandboxSpec, error) {
	if len(body.VolumeMounts) > 0 {
		return nil, fmt.Errorf("volumeMounts: dsec has no E2B volumes: %w", errdefs.ErrInvalidArgument)
	}
	if len(body.Mcp) > 0 && string(body.Mcp) != "null" {
		return nil, fmt.Errorf("mcp: dsec runs no MCP gateway in sandboxes: %w", errdefs.ErrInvalidArgument)
	}
	timeout := int64(defaultTimeout)
	if body.Timeout != nil {
		if *body.Timeout < 0 {
			return nil, fmt.Errorf("timeout %d must not be negative: %w", *body.Timeout, errdefs.ErrInvalidArgument)
		}
		if *body.Timeout > 0 {
			timeout = *body.Timeout
		}
	}
	spec := &dsecv1.SandboxSpec{
		Environment: env,
		TtlSeconds:  timeout,
		// E2B's sandboxes live until their timeout, busy or not.
		IdleTimeoutSeconds: -1,
		Env:                body.EnvVars,
		Labels:             labelsOf(body.TemplateID, body.Metadata),
		// E2B's templates give their user sudo.
		AllowPrivilegeEscalation: true,
	}
	if body.AutoPause != nil && *body.AutoPause {
		spec.OnTimeout = dsecv1.OnTimeout_ON_TIMEOUT_PAUSE
	}
	if body.AutoResume != nil {
		spec.AutoResume = &body.AutoResume.Enabled
	}
	spec.NetworkRules = networkRules(body.AllowInternetAccess, body.Network)
	return spec, nil
}

// networkRules is dsec's network rules for E2B's network settings. Without
// any a sandbox has no network (loopback only), which every dsec node can
// give, also one run with --no-network: E2B's sandboxes have the internet
// by default, dsec's only when asked (allow_internet_access true, or
// network.allowOut).
func networkRules(internet *bool, n *networkConfig) map[string]bool {
	rules := map[string]bool{}
	if internet != nil && *internet {
		rules["0.0.0.0/0"] = true
	}
	if n != nil {
		for _, a := range n.AllowOut {
			rules[a] = true
		}
		for _, d := range n.DenyOut {
			rules[d] = false
		}
	}
	if len(rules) == 0 {
		return nil
	}
	return rules
}

// labelsOf keeps a create's template and metadata in dsec labels.
func labelsOf(template string, metadata map[string]string) map[string]string {
	l := map[string]string{templateLabel: template}
	for k, v := range metadata {
		l[metadataPrefix+k] = v
	}
	return l
}

// metadataOf gives back the metadata a sandbox was made with.
func metadataOf(sb *dsecv1.Sandbox) map[string]string {
	md := map[string]string{}
	for k, v := range sb.GetSpec().GetLabels() {
		if key, ok := strings.CutPrefix(k, metadataPrefix); ok {
			md[key] = v
		}
	}
	return md
}

// templateOf is the E2B template a sandbox was made from: the name its
// create gave, else (a sandbox made through dsec's own API) its
// environment.
func templateOf(sb *dsecv1.Sandbox) string {
	if t := sb.GetSpec().GetLabels()[templateLabel]; t != "" {
		return t
	}
	return sb.GetSpec().GetEnvironment()
}

// environmentOf is the dsec environment an E2B template ID names: a name
// of the template table, a snapshot (snap:NAME, from the snapshots API),
// else an environment named as it is.
func (h *Handler) environmentOf(ctx context.Context, template string) (string, error) {
	if template == "" {
		return "", fmt.Errorf("templateID is required: %w", errdefs.ErrInvalidArgument)
	}
	if env, ok := h.cfg.Templates[template]; ok {
		return env, nil
	}
	name, ok := strings.CutPrefix(template, snapshotPrefix)
	if !ok {
		return template, nil
	}
	snaps, err := h.api.ListSnapshots(ctx, connect.NewRequest(&dsecv1.ListSnapshotsRequest{}))
	if err != nil {
		return "", err
	}
	for _, s := range snaps.Msg.GetSnapshots() {
		if s.GetName() == name {
			return s.GetEnvironment(), nil
		}
	}
	return "", fmt.Errorf("template %s: no snapshot is named %s: %w", template, name, errdefs.ErrNotFound)
}

// sandboxBody is E2B's Sandbox: what create, connect and fork answer.
type sandboxBody struct {
	TemplateID      string `json:"templateID"`
	SandboxID       string `json:"sandboxID"`
	Alias           string `json:"alias,omitempty"`
	ClientID        string `json:"clientID"`
	EnvdVersion     string `json:"envdVersion"`
	EnvdAccessToken string `json:"envdAccessToken"`
	// TrafficAccessToken is what the code interpreter's SDK sends with its
	// /contexts calls, which carry no envd access token.
	TrafficAccessToken string `json:"trafficAccessToken"`
	Domain             string `json:"domain,omitempty"`
}

func (h *Handler) sandboxBody(r *http.Request, sb *dsecv1.Sandbox) sandboxBody {
	t := templateOf(sb)
	return sandboxBody{
		TemplateID: t, SandboxID: SandboxID(sb.GetId()), Alias: t, ClientID: sb.GetNode(),
		EnvdVersion: EnvdVersion, EnvdAccessToken: h.cfg.Signer.AccessToken(sb.GetId()),
		TrafficAccessToken: h.cfg.Signer.TrafficToken(sb.GetId()), Domain: h.domain(r),
	}
}

// domain is the sandboxes' domain: the configured one, else the host the
// request came to.
func (h *Handler) domain(r *http.Request) string {
	if h.cfg.Domain != "" {
		return h.cfg.Domain
	}
	return r.Host
}

func (h *Handler) create(w http.ResponseWriter, r *http.Request) error {
	var body newSandbox
	if err := decode(r, &body); err != nil {
		return err
	}
	env, err := h.environmentOf(r.Context(), body.TemplateID)
	if err != nil {
		return err
	}
	spec, err := specOf(body, env)
	if err != nil {
		return err
	}
	// dsec's Create answers once the sandbox's agent does.
	resp, err := h.api.Create(r.Context(), connect.NewRequest(&dsecv1.CreateRequest{Spec: spec}))
	if err != nil {
		return err
	}
	sbs := resp.Msg.GetSandboxes()
	if len(sbs) != 1 {
		return fmt.Errorf("create made %d sandboxes, not 1: %w", len(sbs), errdefs.ErrInternal)
	}
	h.markLive(sbs[0].GetId(), time.Now())
	writeJSON(w, http.StatusCreated, h.sandboxBody(r, sbs[0]))
	return nil
}

// listedSandbox is E2B's ListedSandbox; detail adds SandboxDetail's fields.
type listedSandbox struct {
	TemplateID  string            `json:"templateID"`
	Alias       string            `json:"alias,omitempty"`
	SandboxID   string            `json:"sandboxID"`
	ClientID    string            `json:"clientID"`
	StartedAt   string            `json:"startedAt"`
	EndAt       string            `json:"endAt"`
	CPUCount    int64             `json:"cpuCount"`
	MemoryMB    int64             `json:"memoryMB"`
	DiskSizeMB  int64             `json:"diskSizeMB"`
	Metadata    map[string]string `json:"metadata"`
	State       string            `json:"state"`
	EnvdVersion string            `json:"envdVersion"`
}

type sandboxDetail struct {
	listedSandbox
	EnvdAccessToken     string           `json:"envdAccessToken"`
	TrafficAccessToken  string           `json:"trafficAccessToken"`
	Domain              string           `json:"domain,omitempty"`
	AllowInternetAccess *bool            `json:"allowInternetAccess,omitempty"`
	Lifecycle           *lifecycleDetail `json:"lifecycle,omitempty"`
}

type lifecycleDetail struct {
	OnTimeout  string `json:"onTimeout"`
	AutoResume bool   `json:"autoResume"`
}

func listed(sb *dsecv1.Sandbox) listedSandbox {
	spec := sb.GetSpec()
	t := templateOf(sb)
	started := sb.GetStartedUnixMs()
	if started == 0 {
		started = sb.GetCreatedUnixMs()
	}
	return listedSandbox{
		TemplateID: t, Alias: t, SandboxID: SandboxID(sb.GetId()), ClientID: sb.GetNode(),
		StartedAt:   rfc3339(started),
		EndAt:       rfc3339(sb.GetExpiresUnixMs()),
		CPUCount:    int64(max(1, math.Ceil(spec.GetCpus()))),
		MemoryMB:    spec.GetMemoryMb(),
		DiskSizeMB:  spec.GetDiskMb(),
		Metadata:    metadataOf(sb),
		State:       stateOf(sb.GetState()),
		EnvdVersion: EnvdVersion,
	}
}

func rfc3339(unixMs int64) string {
	return time.UnixMilli(unixMs).UTC().Format(time.RFC3339Nano)
}

func (h *Handler) info(w http.ResponseWriter, r *http.Request) error {
	sb, err := h.sandboxOf(r)
	if err != nil {
		return err
	}
	d := sandboxDetail{listedSandbox: listed(sb), EnvdAccessToken: h.cfg.Signer.AccessToken(sb.GetId()),
		TrafficAccessToken: h.cfg.Signer.TrafficToken(sb.GetId()), Domain: h.domain(r)}
	internet := len(sb.GetSpec().GetNetworkRules()) > 0
	d.AllowInternetAccess = &internet
	lc := &lifecycleDetail{OnTimeout: "kill", AutoResume: sb.GetSpec().AutoResume == nil || sb.GetSpec().GetAutoResume()}
	if sb.GetSpec().GetOnTimeout() == dsecv1.OnTimeout_ON_TIMEOUT_PAUSE {
		lc.OnTimeout = "pause"
	}
	d.Lifecycle = lc
	writeJSON(w, http.StatusOK, d)
	return nil
}

func (h *Handler) kill(w http.ResponseWriter, r *http.Request) error {
	sb, err := h.sandboxOf(r)
	if err != nil {
		return err
	}
	h.forget(sb.GetId())
	if _, err := h.api.Delete(r.Context(), connect.NewRequest(&dsecv1.DeleteRequest{Id: sb.GetId()})); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// timeoutBody is the body of timeout, connect and resume.
type timeoutBody struct {
	Timeout *int64 `json:"timeout"`
}

// seconds is the body's timeout, which must be there (required) and not
// negative.
func (b timeoutBody) seconds(required bool) (int64, bool, error) {
	if b.Timeout == nil {
		if required {
			return 0, false, fmt.Errorf("timeout (seconds) is required: %w", errdefs.ErrInvalidArgument)
		}
		return 0, false, nil
	}
	if *b.Timeout < 0 {
		return 0, false, fmt.Errorf("timeout %d must not be negative: %w", *b.Timeout, errdefs.ErrInvalidArgument)
	}
	return *b.Timeout, true, nil
}

func (h *Handler) setTimeout(w http.ResponseWriter, r *http.Request) error {
	var body timeoutBody
	if err := decode(r, &body); err != nil {
		return err
	}
	secs, _, err := body.seconds(true)
	if err != nil {
		return err
	}
	sb, err := h.sandboxOf(r)
	if err != nil {
		return err
	}
	if err := h.timeout(r.Context(), sb.GetId(), secs, false); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// refresh is E2B's /refreshes {duration}: the timeout only extended.
func (h *Handler) refresh(w http.ResponseWriter, r *http.Request) error {
	var body struct {
		Duration *int64 `json:"duration"`
	}
	if err := decode(r, &body); err != nil {
		return err
	}
	secs, _, err := timeoutBody{Timeout: body.Duration}.seconds(false)
	if err != nil {
		return err
	}
	sb, err := h.sandboxOf(r)
	if err != nil {
		return err
	}
	if body.Duration != nil {
		if err := h.timeout(r.Context(), sb.GetId(), secs, true); err != nil {
			return err
		}
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (h *Handler) timeout(ctx context.Context, id string, secs int64, extendOnly bool) error {
	_, err := h.api.SetTimeout(ctx, connect.NewRequest(&dsecv1.SetTimeoutRequest{SandboxId: id, TimeoutSeconds: secs, ExtendOnly: extendOnly}))
	return err
}

// connect answers 200 for a running sandbox and 201 for a paused one it
// resumed, and extends the timeout (never shortens it).
func (h *Handler) connect(w http.ResponseWriter, r *http.Request) error {
	return h.resumeOrConnect(w, r, false)
}

// resume is E2B's deprecated resume: 201, or 409 when it runs already.
func (h *Handler) resume(w http.ResponseWriter, r *http.Request) error {
	return h.resumeOrConnect(w, r, true)
}

func (h *Handler) resumeOrConnect(w http.ResponseWriter, r *http.Request, legacy bool) error {
	var body timeoutBody
	if err := decode(r, &body); err != nil {
		return err
	}
	secs, given, err := body.seconds(false)
	if err != nil {
		return err
	}
	sb, err := h.sandboxOf(r)
	if err != nil {
		return err
	}
	status := http.StatusOK
	if stateOf(sb.GetState()) == "paused" {
		resp, err := h.api.Resume(r.Context(), connect.NewRequest(&dsecv1.ResumeRequest{SandboxId: sb.GetId()}))
		if err != nil {
			return err
		}
		if !resp.Msg.GetAlreadyRunning() {
			status = http.StatusCreated
		}
		sb = resp.Msg.GetSandbox()
	}
	if legacy {
		if status != http.StatusCreated {
			return fmt.Errorf("sandbox %s is running already: %w", SandboxID(sb.GetId()), errdefs.ErrAlreadyExists)
		}
	}
	if given && secs > 0 {
		if err := h.timeout(r.Context(), sb.GetId(), secs, true); err != nil {
			return err
		}
	}
	h.markLive(sb.GetId(), time.Now())
	writeJSON(w, status, h.sandboxBody(r, sb))
	return nil
}

func (h *Handler) pause(w http.ResponseWriter, r *http.Request) error {
	// The body ({memory}) says whether E2B keeps the memory in its
	// snapshot; a dsec pause always keeps the processes.
	var body struct{}
	if err := decode(r, &body); err != nil {
		return err
	}
	sb, err := h.sandboxOf(r)
	if err != nil {
		return err
	}
	h.forget(sb.GetId())
	resp, err := h.api.Pause(r.Context(), connect.NewRequest(&dsecv1.PauseRequest{SandboxId: sb.GetId()}))
	if err != nil {
		return err
	}
	if resp.Msg.GetAlreadyPaused() {
		return fmt.Errorf("sandbox %s is paused already: %w", SandboxID(sb.GetId()), errdefs.ErrAlreadyExists)
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// updateNetwork replaces a sandbox's network rules with E2B's egress
// settings (omitted ones cleared, as E2B's API does). dsec gives a network
// only to sandboxes made with one: the node refuses the others' updates.
func (h *Handler) updateNetwork(w http.ResponseWriter, r *http.Request) error {
	var body struct {
		networkConfig
		AllowInternetAccess *bool `json:"allow_internet_access"`
	}
	if err := decode(r, &body); err != nil {
		return err
	}
	sb, err := h.sandboxOf(r)
	if err != nil {
		return err
	}
	rules := networkRules(body.AllowInternetAccess, &body.networkConfig)
	if _, err := h.api.SetNetworkRules(r.Context(), connect.NewRequest(&dsecv1.SetNetworkRulesRequest{SandboxId: sb.GetId(), Rules: rules, Cut: true})); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// forkResult is E2B's SandboxForkResult: sandbox or error.
type forkResult struct {
	Sandbox *sandboxBody `json:"sandbox,omitempty"`
	Error   *errorBody   `json:"error,omitempty"`
}

func (h *Handler) fork(w http.ResponseWriter, r *http.Request) error {
	var body struct {
		Timeout *int64 `json:"timeout"`
		Count   *int32 `json:"count"`
	}
	if err := decode(r, &body); err != nil {
		return err
	}
	count := int32(1)
	if body.Count != nil {
		count = *body.Count
	}
	if count < 1 || count > maxFork {
		return fmt.Errorf("count %d: dsec forks 1 to %d sandboxes at once: %w", count, maxFork, errdefs.ErrInvalidArgument)
	}
	secs, given, err := timeoutBody{Timeout: body.Timeout}.seconds(false)
	if err != nil {
		return err
	}
	sb, err := h.sandboxOf(r)
	if err != nil {
		return err
	}
	resp, err := h.api.Fork(r.Context(), connect.NewRequest(&dsecv1.ForkRequest{SandboxId: sb.GetId(), Count: count}))
	if err != nil {
		return err
	}
	out := make([]forkResult, 0, len(resp.Msg.GetChildren()))
	for _, c := range resp.Msg.GetChildren() {
		child := c.GetSandbox()
		if c.GetError() != "" || child == nil {
			msg := c.GetError()
			if msg == "" {
				msg = "the fork made no sandbox"
			}
			out = append(out, forkResult{Error: &errorBody{Code: http.StatusInternalServerError, Message: msg}})
			continue
		}
		if given && secs > 0 {
			if err := h.timeout(r.Context(), child.GetId(), secs, false); err != nil {
				out = append(out, forkResult{Error: &errorBody{Code: statusOf(err), Message: messageOf(err)}})
				continue
			}
		}
		b := h.sandboxBody(r, child)
		out = append(out, forkResult{Sandbox: &b})
	}
	writeJSON(w, http.StatusCreated, out)
	return nil
}

// snapshotInfo is E2B's SnapshotInfo.
type snapshotInfo struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

func snapshotOf(s *dsecv1.SnapshotInfo) snapshotInfo {
	id := snapshotPrefix + s.GetName()
	return snapshotInfo{SnapshotID: id, Names: []string{id}}
}

func (h *Handler) snapshot(w http.ResponseWriter, r *http.Request) error {
	var body struct {
		Name string `json:"name"`
	}
	if err := decode(r, &body); err != nil {
		return err
	}
	sb, err := h.sandboxOf(r)
	if err != nil {
		return err
	}
	name := strings.TrimPrefix(body.Name, snapshotPrefix)
	if name == "" {
		name = fmt.Sprintf("e2b-%s-%d", SandboxID(sb.GetId()), time.Now().UnixMilli())
	}
	info, err := h.api.Snapshot(r.Context(), connect.NewRequest(&dsecv1.SnapshotRequest{SandboxId: sb.GetId(), Name: name}))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, snapshotOf(info.Msg))
	return nil
}

func (h *Handler) listSnapshots(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	limit, err := pageLimit(q.Get("limit"))
	if err != nil {
		return err
	}
	var source string
	if s := q.Get("sandboxID"); s != "" {
		if source, err = DsecID(s); err != nil {
			// No snapshot comes from a sandbox this server never made.
			writeJSON(w, http.StatusOK, []snapshotInfo{})
			return nil
		}
	}
	name := strings.TrimPrefix(q.Get("name"), snapshotPrefix)
	resp, err := h.api.ListSnapshots(r.Context(), connect.NewRequest(&dsecv1.ListSnapshotsRequest{}))
	if err != nil {
		return err
	}
	var items []pageItem
	byKey := map[string]*dsecv1.SnapshotInfo{}
	for _, s := range resp.Msg.GetSnapshots() {
		if (source != "" && s.GetSourceSandbox() != source) || (name != "" && s.GetName() != name) {
			continue
		}
		items = append(items, pageItem{At: s.GetCreatedUnixMs(), ID: s.GetName()})
		byKey[s.GetName()] = s
	}
	return writePage(w, items, limit, q.Get("nextToken"), false, func(id string) snapshotInfo { return snapshotOf(byKey[id]) })
}

// deleteSnapshot is E2B's DELETE /templates/{id}, which its SDK's
// deleteSnapshot calls: dsec has snapshots there, not templates.
func (h *Handler) deleteSnapshot(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	name, ok := strings.CutPrefix(id, snapshotPrefix)
	if !ok {
		return fmt.Errorf("template %s: only snapshots (snap:NAME) can be deleted here: %w", id, errdefs.ErrNotFound)
	}
	resp, err := h.api.ListSnapshots(r.Context(), connect.NewRequest(&dsecv1.ListSnapshotsRequest{}))
	if err != nil {
		return err
	}
	found := false
	for _, s := range resp.Msg.GetSnapshots() {
		found = found || s.GetName() == name
	}
	if !found {
		return fmt.Errorf("snapshot %s not found: %w", id, errdefs.ErrNotFound)
	}
	if _, err := h.api.DeleteSnapshot(r.Context(), connect.NewRequest(&dsecv1.DeleteSnapshotRequest{Name: name})); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// sandboxMetric is E2B's SandboxMetric.
type sandboxMetric struct {
	Timestamp     string  `json:"timestamp"`
	TimestampUnix int64   `json:"timestampUnix"`
	CPUCount      int64   `json:"cpuCount"`
	CPUUsedPct    float64 `json:"cpuUsedPct"`
	MemUsed       int64   `json:"memUsed"`
	MemTotal      int64   `json:"memTotal"`
	MemCache      int64   `json:"memCache"`
	DiskUsed      int64   `json:"diskUsed"`
	DiskTotal     int64   `json:"diskTotal"`
}

func metricOf(m *dsecv1.SandboxMetrics) sandboxMetric {
	return sandboxMetric{
		Timestamp:     rfc3339(m.GetTimeUnixMs()),
		TimestampUnix: m.GetTimeUnixMs() / 1000,
		CPUCount:      int64(max(1, math.Ceil(m.GetCpuCount()))),
		CPUUsedPct:    math.Round(m.GetCpuUsedPct()*100) / 100,
		MemUsed:       m.GetMemoryUsedBytes(),
		MemTotal:      m.GetMemoryLimitBytes(),
		MemCache:      m.GetMemoryCacheBytes(),
		DiskUsed:      m.GetDiskUsedBytes(),
		DiskTotal:     m.GetDiskLimitBytes(),
	}
}

// metrics answers one sample, taken now: dsec keeps no history, so start
// and end are not looked at.
func (h *Handler) metrics(w http.ResponseWriter, r *http.Request) error {
	sb, err := h.sandboxOf(r)
	if err != nil {
		return err
	}
	resp, err := h.api.Metrics(r.Context(), connect.NewRequest(&dsecv1.MetricsRequest{SandboxId: sb.GetId()}))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, []sandboxMetric{metricOf(resp.Msg)})
	return nil
}

// metricsMany is GET /sandboxes/metrics?sandbox_ids=a,b: the latest
// sample of each live one, by E2B ID.
func (h *Handler) metricsMany(w http.ResponseWriter, r *http.Request) error {
	var ids []string
	for _, v := range r.URL.Query()["sandbox_ids"] {
		for _, id := range strings.Split(v, ",") {
			if id = strings.TrimSpace(id); id != "" {
				ids = append(ids, id)
			}
		}
	}
	if len(ids) == 0 || len(ids) > 100 {
		return fmt.Errorf("sandbox_ids names %d sandboxes; 1 to 100 are taken: %w", len(ids), errdefs.ErrInvalidArgument)
	}
	out := map[string]sandboxMetric{}
	for _, e2bID := range ids {
		id, err := DsecID(e2bID)
		if err != nil {
			continue
		}
		resp, err := h.api.Metrics(r.Context(), connect.NewRequest(&dsecv1.MetricsRequest{SandboxId: id}))
		if err != nil {
			continue // gone meanwhile, or never there: left out, as E2B does
		}
		out[e2bID] = metricOf(resp.Msg)
	}
	writeJSON(w, http.StatusOK, map[string]any{"sandboxes": out})
	return nil
}

func (h *Handler) listV1(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	f, err := parseListFilter(q, false)
	if err != nil {
		return err
	}
	sbs, err := h.listSandboxes(r.Context(), f)
	if err != nil {
		return err
	}
	out := make([]listedSandbox, 0, len(sbs))
	for _, sb := range sbs {
		out = append(out, listed(sb))
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

func (h *Handler) listV2(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	f, err := parseListFilter(q, true)
	if err != nil {
		return err
	}
	limit, err := pageLimit(q.Get("limit"))
	if err != nil {
		return err
	}
	sbs, err := h.listSandboxes(r.Context(), f)
	if err != nil {
		return err
	}
	items := make([]pageItem, 0, len(sbs))
	byID := map[string]*dsecv1.Sandbox{}
	for _, sb := range sbs {
		e2bID := SandboxID(sb.GetId())
		started := sb.GetStartedUnixMs()
		if started == 0 {
			started = sb.GetCreatedUnixMs()
		}
		items = append(items, pageItem{At: started, ID: e2bID})
		byID[e2bID] = sb
	}
	return writePage(w, items, limit, q.Get("nextToken"), f.ascending, func(id string) listedSandbox { return listed(byID[id]) })
}

// listSandboxes lists dsec's live sandboxes that pass f.
func (h *Handler) listSandboxes(ctx context.Context, f listFilter) ([]*dsecv1.Sandbox, error) {
	labels := map[string]string{}
	for k, v := range f.metadata {
		labels[metadataPrefix+k] = v
	}
	resp, err := h.api.List(ctx, connect.NewRequest(&dsecv1.ListRequest{Labels: labels}))
	if err != nil {
		return nil, err
	}
	var out []*dsecv1.Sandbox
	for _, sb := range resp.Msg.GetSandboxes() {
		if f.keep(sb) {
			out = append(out, sb)
		}
	}
	return out, nil
}

// listFilter is what a list asks for besides its page.
type listFilter struct {
	metadata     map[string]string
	states       map[string]bool // E2B states; never empty
	template     string
	startedAfter time.Time
	ascending    bool
}

func (f listFilter) keep(sb *dsecv1.Sandbox) bool {
	if !f.states[stateOf(sb.GetState())] {
		return false
	}
	if f.template != "" && templateOf(sb) != f.template {
		return false
	}
	if !f.startedAfter.IsZero() && time.UnixMilli(sb.GetStartedUnixMs()).Before(f.startedAfter) {
		return false
	}
	return true
}

// parseListFilter reads a list's query: metadata, and for v2 state
// (running, paused; comma-separated or repeated; default both), template,
// startedAfter and order. v1 lists running sandboxes only.
func parseListFilter(q map[string][]string, v2 bool) (listFilter, error) {
	f := listFilter{states: map[string]bool{"running": true}}
	if md := first(q, "metadata"); md != "" {
		m, err := parseMetadataQuery(md)
		if err != nil {
			return f, err
		}
		f.metadata = m
	}
	if !v2 {
		return f, nil
	}
	f.states = map[string]bool{"running": true, "paused": true}
	if vs := q["state"]; len(vs) > 0 {
		f.states = map[string]bool{}
		for _, v := range vs {
			for _, s := range strings.Split(v, ",") {
				if s != "running" && s != "paused" {
					return f, fmt.Errorf("state %q: a sandbox is running or paused: %w", s, errdefs.ErrInvalidArgument)
				}
				f.states[s] = true
			}
		}
	}
	f.template = first(q, "template")
	if s := first(q, "startedAfter"); s != "" {
		t, err := time.Parse(time.RFC3339Nano, s)
		if err != nil {
			return f, fmt.Errorf("startedAfter %q is not an RFC 3339 time: %w", s, errdefs.ErrInvalidArgument)
		}
		f.startedAfter = t
	}
	switch o := first(q, "order"); o {
	case "", "desc":
	case "asc":
		f.ascending = true
	default:
		return f, fmt.Errorf("order %q: asc or desc: %w", o, errdefs.ErrInvalidArgument)
	}
	return f, nil
}

func first(q map[string][]string, k string) string {
	if vs := q[k]; len(vs) > 0 {
		return vs[0]
	}
	return ""
}

// parseMetadataQuery reads E2B's metadata filter: the query parameter's
// value (decoded once already) is itself URL-encoded "k=v&k2=v2", and each
// key and value is URL-encoded again. It is decoded as E2B's API does:
// the whole, then each key and value.
func parseMetadataQuery(s string) (map[string]string, error) {
	bad := func(why string) error {
		return fmt.Errorf("metadata %q: %s (k=v pairs joined by &, URL-encoded): %w", s, why, errdefs.ErrInvalidArgument)
	}
	whole, err := urlUnescape(s)
	if err != nil {
		return nil, bad("not URL-encoded")
	}
	out := map[string]string{}
	for _, pair := range strings.Split(whole, "&") {
		if pair == "" {
			continue
		}
		parts := strings.Split(pair, "=")
		if len(parts) != 2 {
			return nil, bad(fmt.Sprintf("%q is not one key=value pair", pair))
		}
		k, err := urlUnescape(parts[0])
		if err != nil {
			return nil, bad("a key is not URL-encoded")
		}
		v, err := urlUnescape(parts[1])
		if err != nil {
			return nil, bad("a value is not URL-encoded")
		}
		if k == "" {
			return nil, bad("a key is empty")
		}
		out[k] = v
	}
	return out, nil
}

// pageLimit reads a page size: 1 to maxPageSize, default defaultPageSize.
func pageLimit(s string) (int, error) {
	if s == "" {
		return defaultPageSize, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > maxPageSize {
		return 0, fmt.Errorf("limit %q: a page holds 1 to %d: %w", s, maxPageSize, errdefs.ErrInvalidArgument)
	}
	return n, nil
}
