package e2b

import (
	"bytes"
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"path"
	"regexp"
	"strings"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// The code interpreter, E2B's code-interpreter-v1 server on port 49999:
// POST /execute streams a cell's output as newline-delimited JSON, and
// /contexts makes, lists, restarts and removes the contexts cells run in.
//
// E2B runs a Jupyter server with a kernel per context. dsec runs, per
// context, one Python process of its own in the sandbox (interp_driver.py,
// sent in on the process's stdin): a background process started through
// SandboxService.Exec and found again by its tag, so the adapter keeps
// nothing between requests and any apiserver serves any request. A cell
// goes in through a short-lived foreground process (interp_client.py),
// which connects to the driver's abstract unix socket, hands it the cell
// and copies the driver's events out; when the HTTP request goes away that
// process is killed with it, which interrupts the cell. Only Python: no
// kernel, so no IPython magics beyond `!cmd`, `%pip`, `%cd` and `%env`.

//go:embed interp_driver.py
var interpDriver string

//go:embed interp_client.py
var interpClient string

const (
	// interpTagPrefix + a context ID tags the context's driver process.
	interpTagPrefix = "e2b-interp:"
	// defaultContextID is the Python context an execution without a
	// context_id runs in, made on first use.
	defaultContextID = "default-python"
	// interpCwd is a context's working directory unless asked otherwise,
	// as in E2B.
	interpCwd = "/home/user"
	// interpUser runs the drivers: root, as E2B's Jupyter server does.
	interpUser = "root"
	// interpBoot is the driver process's program: it runs its stdin.
	interpBoot = "import sys;exec(compile(sys.stdin.read(),'<dsec-e2b-driver>','exec'))"
	// interpStartTimeout bounds a driver's start, to its "ready".
	interpStartTimeout = 30 * time.Second
	// interpConnectWait is how long a cell's client waits for the
	// driver's socket (a driver another request is starting).
	interpConnectWait = "30"
	// interpKeepalive is how often a quiet execution sends a keepalive
	// line, as E2B's server does, so that a proxy keeps the stream open.
	interpKeepalive = 5 * time.Second
	// maxExecuteBody bounds POST /execute's body.
	maxExecuteBody = 16 << 20
	// maxInterpLine bounds one event line of the driver (a large image).
	maxInterpLine = 64 << 20
	// interpOutputLimit is the output a cell's client process may give
	// (the agent keeps it until the process ends); the driver stops
	// streaming stdout and stderr at 48 MiB so that results, errors and
	// the end still fit.
	interpOutputLimit = 64 << 20
)

// contextIDPattern is what a context ID may be: ours are UUIDs or
// defaultContextID.
var contextIDPattern = regexp.MustCompile(`^[A-Za-z0-9-]{1,64}$`)

// interpContext is E2B's Context.
type interpContext struct {
	ID       string `json:"id"`
	Language string `json:"language"`
	Cwd      string `json:"cwd"`
}

// interpreterPlane serves the code interpreter's HTTP API.
func (h *Handler) interpreterPlane() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) { writeJSON(w, http.StatusOK, "OK") })
	mux.HandleFunc("POST /execute", h.interpExecute)
	mux.HandleFunc("GET /contexts", h.interpListContexts)
	mux.HandleFunc("POST /contexts", h.interpCreateContext)
	mux.HandleFunc("DELETE /contexts/{id}", h.interpRemoveContext)
	mux.HandleFunc("POST /contexts/{id}/restart", h.interpRestartContext)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "the code interpreter has no "+r.Method+" "+r.URL.Path)
	})
	return mux
}

// executeRequest is POST /execute's body; unknown fields are ignored.
// Timeout (seconds) is dsec's own: a cell still running after it is
// interrupted and the execution's error says so. E2B's SDKs time out on
// their side instead, by closing the request, which interrupts the cell
// too.
type executeRequest struct {
	Code      *string           `json:"code"`
	ContextID string            `json:"context_id"`
	Language  string            `json:"language"`
	EnvVars   map[string]string `json:"env_vars"`
	Timeout   float64           `json:"timeout"`
}

// interpLanguage is E2B's language naming: "" is Python, js and ts
// stand for javascript and typescript.
func interpLanguage(l string) string {
	l = strings.ToLower(strings.TrimSpace(l))
	switch l {
	case "", "python3", "py":
		return "python"
	case "js":
		return "javascript"
	case "ts":
		return "typescript"
	}
	return l
}

func (h *Handler) interpExecute(w http.ResponseWriter, r *http.Request) {
	var req executeRequest
	if !interpReadJSON(w, r, maxExecuteBody, &req) {
		return
	}
	if req.Code == nil {
		writeError(w, http.StatusBadRequest, "code is required")
		return
	}
	if req.ContextID != "" && req.Language != "" {
		writeError(w, http.StatusBadRequest, "Only one of context_id or language can be provided")
		return
	}
	if req.Timeout < 0 {
		writeError(w, http.StatusBadRequest, "timeout must not be negative")
		return
	}
	ctx := r.Context()
	sb := targetOf(ctx).ID
	id := req.ContextID
	if id == "" {
		if lang := interpLanguage(req.Language); lang != "python" {
			// An answer the SDK shows as the execution's error, where a
			// user reads it (an HTTP status would reach them as "400").
			s := newInterpStream(w)
			s.line(interpErrorLine("UnsupportedLanguage", "dsec's code interpreter runs Python only; language "+
				fmt.Sprintf("%q", req.Language)+" is not supported", ""))
			s.line([]byte(`{"type":"end_of_execution"}`))
			return
		}
		id = defaultContextID
	}
	if !contextIDPattern.MatchString(id) {
		writeError(w, http.StatusNotFound, "Context "+id+" not found")
		return
	}
	if err := h.ensureContext(ctx, sb, id); err != nil {
		h.interpFail(w, err)
		return
	}
	cell, _ := json.Marshal(map[string]any{"code": *req.Code, "env_vars": req.EnvVars, "timeout": req.Timeout})
	h.runCell(ctx, w, sb, id, cell)
}

// runCell runs one cell through the context's driver and streams its
// events, ended by end_of_execution.
func (h *Handler) runCell(ctx context.Context, w http.ResponseWriter, sb, id string, cell []byte) {
	stream, err := h.api.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{
		SandboxId:        sb,
		Argv:             []string{"python3", "-I", "-S", "-c", interpClient, interpSocket(id), interpConnectWait},
		User:             interpUser,
		Stdin:            cell,
		OutputLimitBytes: interpOutputLimit,
	}))
	if err != nil {
		h.interpFail(w, err)
		return
	}

	type event struct {
		ev  *dsecv1.ExecEvent
		err error
	}
	events := make(chan event, 16)
	go func() {
		// The stream ends with ctx at the latest: the request's.
		defer stream.Close()
		defer close(events)
		for stream.Receive() {
			select {
			case events <- event{ev: stream.Msg()}:
			case <-ctx.Done():
				return
			}
		}
		if err := stream.Err(); err != nil {
			select {
			case events <- event{err: err}:
			case <-ctx.Done():
			}
		}
	}()

	s := newInterpStream(w)
	var (
		pending  []byte       // stdout after its last newline
		stderr   bytes.Buffer // the client's complaints
		ended    bool         // the driver sent dsec_end
		sawError bool
		exited   *dsecv1.ExecExited
		failure  error
	)
	keepalive := time.NewTicker(interpKeepalive)
	defer keepalive.Stop()
loop:
	for {
		select {
		case <-ctx.Done():
			return // the client went: the client process dies, the cell is interrupted
		case <-keepalive.C:
			if time.Since(s.last) >= interpKeepalive {
				s.line([]byte(`{"type":"keepalive"}`))
			}
		case e, ok := <-events:
			if !ok {
				break loop
			}
			if e.err != nil {
				failure = e.err
				break loop
			}
			switch ev := e.ev.Event.(type) {
			case *dsecv1.ExecEvent_Stdout:
				pending = append(pending, ev.Stdout...)
				for {
					i := bytes.IndexByte(pending, '\n')
					if i < 0 {
						break
					}
					line := pending[:i]
					pending = pending[i+1:]
					switch interpLineType(line) {
					case "":
						h.log.Warn("e2b: the code interpreter's driver sent a line that is not an event", "sandbox", sb, "context", id, "bytes", len(line))
					case "dsec_end":
						ended = true
					case "error":
						sawError = true
						s.line(line)
					default:
						s.line(line)
					}
				}
				if len(pending) > maxInterpLine {
					h.log.Warn("e2b: the code interpreter's driver sent an over-long line; dropped", "sandbox", sb, "context", id)
					pending = nil
				}
			case *dsecv1.ExecEvent_Stderr:
				if stderr.Len() < 4096 {
					stderr.Write(ev.Stderr)
				}
			case *dsecv1.ExecEvent_Exited:
				exited = ev.Exited
			}
		}
	}
	if !ended {
		msg := "the context's process ended during the execution; it starts afresh on the context's next execution"
		switch {
		case failure != nil:
			msg = "the execution's stream broke: " + messageOf(failure)
		case strings.TrimSpace(stderr.String()) != "":
			msg = "the execution did not reach its context: " + strings.TrimSpace(stderr.String())
		case exited != nil && exited.Status == dsecv1.ExitStatus_EXIT_STATUS_START_ERROR:
			msg = "the execution did not start (is python3 installed in the sandbox?): " + exited.Message
		case exited != nil && exited.StdoutTruncated:
			msg = fmt.Sprintf("the execution's events went over %d MiB; the rest was dropped", interpOutputLimit>>20)
		}
		if !sawError || failure != nil {
			s.line(interpErrorLine("ExecutionInterrupted", msg, ""))
		}
	}
	s.line([]byte(`{"type":"end_of_execution"}`))
}

// interpLineType is the type of one of the driver's event lines, "" when
// the line is not one.
func interpLineType(line []byte) string {
	var ev struct {
		Type string `json:"type"`
	}
	if json.Unmarshal(line, &ev) != nil {
		return ""
	}
	switch ev.Type {
	case "stdout", "stderr", "result", "error", "number_of_executions", "dsec_end":
		return ev.Type
	}
	return ""
}

func interpErrorLine(name, value, traceback string) []byte {
	b, _ := json.Marshal(map[string]string{"type": "error", "name": name, "value": value, "traceback": traceback})
	return b
}

// interpStream writes NDJSON lines, each flushed as it is written.
type interpStream struct {
	w    http.ResponseWriter
	rc   *http.ResponseController
	last time.Time
}

func newInterpStream(w http.ResponseWriter) *interpStream {
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	return &interpStream{w: w, rc: http.NewResponseController(w), last: time.Now()}
}

func (s *interpStream) line(b []byte) {
	s.w.Write(b)
	s.w.Write([]byte{'\n'})
	s.rc.Flush()
	s.last = time.Now()
}

// interpSocket is the abstract unix socket name a context's driver
// listens on (a sandbox has its own network namespace, and with it its
// own abstract socket names).
func interpSocket(id string) string { return "dsec-e2b-interp-" + id }

// contextProc is a context's driver process, as ListProcesses shows it.
type contextProc struct {
	interpContext
	proc *dsecv1.ProcessInfo
}

// running reports whether the driver runs.
func (c *contextProc) running() bool { return c.proc.GetRunning() }

// removed reports whether the context was removed (its driver killed by
// DELETE, or by anything else with SIGKILL): it is not started again.
func (c *contextProc) removed() bool {
	e := c.proc.GetExited()
	return e != nil && e.GetStatus() == dsecv1.ExitStatus_EXIT_STATUS_KILLED && e.GetSignal() == 9
}

// contexts lists the sandbox's contexts, the newest driver of each, oldest
// context first.
func (h *Handler) contexts(ctx context.Context, sb string) ([]*contextProc, error) {
	resp, err := h.api.ListProcesses(ctx, connect.NewRequest(&dsecv1.ListProcessesRequest{SandboxId: sb}))
	if err != nil {
		return nil, err
	}
	var out []*contextProc
	index := map[string]int{}
	for _, p := range resp.Msg.GetProcesses() {
		id, ok := strings.CutPrefix(p.GetTag(), interpTagPrefix)
		if !ok {
			continue
		}
		cwd := interpCwd
		if a := p.GetArgv(); len(a) >= 5 {
			cwd = a[4]
		}
		c := &contextProc{interpContext: interpContext{ID: id, Language: "python", Cwd: cwd}, proc: p}
		if i, seen := index[id]; seen {
			out[i] = c // oldest first: a later one with the tag is newer
			continue
		}
		index[id] = len(out)
		out = append(out, c)
	}
	return out, nil
}

// findContext is the context id, or nil.
func (h *Handler) findContext(ctx context.Context, sb, id string) (*contextProc, error) {
	cs, err := h.contexts(ctx, sb)
	if err != nil {
		return nil, err
	}
	for _, c := range cs {
		if c.ID == id {
			return c, nil
		}
	}
	return nil, nil
}

// errContextNotFound is a context that is not there.
type errContextNotFound string

func (e errContextNotFound) Error() string { return "Context " + string(e) + " not found" }

// ensureContext makes sure the context's driver runs: the default context
// is made on first use, and a context whose driver ended by itself (a cell
// that ignored its interrupt, os._exit, the OOM killer) starts afresh, as
// a kernel restarts.
func (h *Handler) ensureContext(ctx context.Context, sb, id string) error {
	c, err := h.findContext(ctx, sb, id)
	if err != nil {
		return err
	}
	switch {
	case c != nil && c.running():
		return nil
	case c == nil && id != defaultContextID, c != nil && c.removed() && id != defaultContextID:
		return errContextNotFound(id)
	}
	cwd := interpCwd
	if c != nil {
		cwd = c.Cwd
	}
	return h.startContext(ctx, sb, id, cwd)
}

// startContext starts a context's driver and waits for its "ready". A
// driver another request started in the meantime is as good.
func (h *Handler) startContext(ctx context.Context, sb, id, cwd string) error {
	ctx, cancel := context.WithTimeout(ctx, interpStartTimeout)
	defer cancel() // ends the stream only: the driver runs on in the background
	stream, err := h.api.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{
		SandboxId:  sb,
		Argv:       []string{"python3", "-c", interpBoot, interpSocket(id), cwd},
		User:       interpUser,
		Cwd:        cwd,
		Env:        map[string]string{"MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"},
		Stdin:      []byte(interpDriver),
		Background: true,
		Tag:        interpTagPrefix + id,
	}))
	if err != nil {
		return h.startError(err)
	}
	defer stream.Close()
	var out, errOut bytes.Buffer
	for stream.Receive() {
		switch ev := stream.Msg().Event.(type) {
		case *dsecv1.ExecEvent_Stdout:
			out.Write(ev.Stdout)
			if bytes.Contains(out.Bytes(), []byte("ready\n")) {
				return nil
			}
		case *dsecv1.ExecEvent_Stderr:
			if errOut.Len() < 4096 {
				errOut.Write(ev.Stderr)
			}
		case *dsecv1.ExecEvent_Exited:
			msg := strings.TrimSpace(errOut.String())
			if msg == "" {
				msg = ev.Exited.GetMessage()
			}
			if ev.Exited.GetStatus() == dsecv1.ExitStatus_EXIT_STATUS_START_ERROR {
				msg = "is python3 installed in the sandbox? " + msg
			}
			return fmt.Errorf("start the code interpreter's context %s: %s", id, msg)
		}
	}
	if err := stream.Err(); err != nil {
		return h.startError(err)
	}
	if ctx.Err() != nil {
		return fmt.Errorf("start the code interpreter's context %s: not ready after %s", id, interpStartTimeout)
	}
	return fmt.Errorf("start the code interpreter's context %s: its stream ended before it was ready", id)
}

// startError is an Exec error of a driver's start: a tag in use is a
// driver another request started, which is fine.
func (h *Handler) startError(err error) error {
	if connect.CodeOf(err) == connect.CodeAlreadyExists {
		return nil
	}
	return err
}

// stopContext kills a context's driver and waits for it to be gone.
func (h *Handler) stopContext(ctx context.Context, sb string, c *contextProc) error {
	if !c.running() {
		return nil
	}
	_, err := h.api.Signal(ctx, connect.NewRequest(&dsecv1.SignalRequest{SandboxId: sb, ProcessId: c.proc.GetProcessId(), Signal: 9}))
	if err != nil && connect.CodeOf(err) != connect.CodeFailedPrecondition {
		return err
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		now, err := h.findContext(ctx, sb, c.ID)
		if err != nil {
			return err
		}
		if now == nil || !now.running() {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("stop the code interpreter's context %s: its process is still running 10s after SIGKILL", c.ID)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func (h *Handler) interpListContexts(w http.ResponseWriter, r *http.Request) {
	cs, err := h.contexts(r.Context(), targetOf(r.Context()).ID)
	if err != nil {
		h.interpFail(w, err)
		return
	}
	out := []interpContext{}
	for _, c := range cs {
		if c.running() {
			out = append(out, c.interpContext)
		}
	}
	writeJSON(w, http.StatusOK, out)
}

// createContextRequest is POST /contexts's body.
type createContextRequest struct {
	Language string `json:"language"`
	Cwd      string `json:"cwd"`
}

func (h *Handler) interpCreateContext(w http.ResponseWriter, r *http.Request) {
	var req createContextRequest
	if !interpReadJSON(w, r, 1<<20, &req) {
		return
	}
	if lang := interpLanguage(req.Language); lang != "python" {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("dsec's code interpreter runs Python only; language %q is not supported", req.Language))
		return
	}
	ctx := r.Context()
	t := targetOf(ctx)
	cwd := interpCwd
	if req.Cwd != "" {
		cwd = path.Clean(resolve(target{User: DefaultUser}, req.Cwd))
	}
	st, err := h.api.Stat(ctx, connect.NewRequest(&dsecv1.StatRequest{SandboxId: t.ID, Path: cwd, User: interpUser}))
	if err != nil && connect.CodeOf(err) != connect.CodeNotFound {
		h.interpFail(w, err)
		return
	}
	if err != nil || st.Msg.GetInfo().GetType() != "dir" {
		writeError(w, http.StatusBadRequest, "cwd "+cwd+" is not a directory in the sandbox")
		return
	}
	id := newContextID()
	if err := h.startContext(ctx, t.ID, id, cwd); err != nil {
		h.interpFail(w, err)
		return
	}
	writeJSON(w, http.StatusOK, interpContext{ID: id, Language: "python", Cwd: cwd})
}

func (h *Handler) interpRemoveContext(w http.ResponseWriter, r *http.Request) {
	c, ok := h.interpLookup(w, r)
	if !ok {
		return
	}
	if err := h.stopContext(r.Context(), targetOf(r.Context()).ID, c); err != nil {
		h.interpFail(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (h *Handler) interpRestartContext(w http.ResponseWriter, r *http.Request) {
	c, ok := h.interpLookup(w, r)
	if !ok {
		return
	}
	sb := targetOf(r.Context()).ID
	if err := h.stopContext(r.Context(), sb, c); err != nil {
		h.interpFail(w, err)
		return
	}
	if err := h.startContext(r.Context(), sb, c.ID, c.Cwd); err != nil {
		h.interpFail(w, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// interpLookup finds the context of the request's path: a running one, or
// one whose driver ended by itself (restart brings it back); else 404.
func (h *Handler) interpLookup(w http.ResponseWriter, r *http.Request) (*contextProc, bool) {
	id := r.PathValue("id")
	if !contextIDPattern.MatchString(id) {
		writeError(w, http.StatusNotFound, errContextNotFound(id).Error())
		return nil, false
	}
	c, err := h.findContext(r.Context(), targetOf(r.Context()).ID, id)
	if err != nil {
		h.interpFail(w, err)
		return nil, false
	}
	if c == nil || (!c.running() && c.removed()) {
		writeError(w, http.StatusNotFound, errContextNotFound(id).Error())
		return nil, false
	}
	return c, true
}

// interpFail answers an error of the code interpreter's calls.
func (h *Handler) interpFail(w http.ResponseWriter, err error) {
	var nf errContextNotFound
	if errors.As(err, &nf) {
		writeError(w, http.StatusNotFound, nf.Error())
		return
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		status := statusOf(err)
		if status == http.StatusNotFound {
			status = http.StatusBadGateway // the sandbox itself is gone, as E2B's proxy answers
		}
		writeError(w, status, messageOf(err))
		return
	}
	h.log.Warn("e2b: code interpreter", "err", err)
	writeError(w, http.StatusInternalServerError, err.Error())
}

// newContextID is a fresh context ID, a UUID as Jupyter's kernel IDs are.
func newContextID() string {
	b := make([]byte, 16)
	rand.Read(b)
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	s := hex.EncodeToString(b)
	return s[:8] + "-" + s[8:12] + "-" + s[12:16] + "-" + s[16:20] + "-" + s[20:]
}

// interpReadJSON decodes r's body into v, at most limit bytes; an empty body is
// the zero value. It answers the error itself and reports false.
func interpReadJSON(w http.ResponseWriter, r *http.Request, limit int64, v any) bool {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("the request body is over %d bytes", limit))
			return false
		}
		writeError(w, http.StatusBadRequest, "read the request body: "+err.Error())
		return false
	}
	if len(bytes.TrimSpace(body)) == 0 {
		return true
	}
	if err := json.Unmarshal(body, v); err != nil {
		writeError(w, http.StatusBadRequest, "the request body is not valid JSON for this call: "+err.Error())
		return false
	}
	return true
}
