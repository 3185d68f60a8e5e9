package sandboxfusion

import (
	"context"
	"encoding/base64"
	"errors"
	"net/http"
	"path"
	"strings"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/outcome"
)

// RunCodeResponse is SandboxFusion's answer to /run_code.
type RunCodeResponse struct {
	Status          string            `json:"status"` // Success, Failed or SandboxError
	Message         string            `json:"message"`
	CompileResult   *CommandRunResult `json:"compile_result"`
	RunResult       *CommandRunResult `json:"run_result"`
	ExecutorPodName *string           `json:"executor_pod_name"`
	Files           map[string]string `json:"files"` // fetched files, base64
}

// CommandRunResult is one step of a call.
type CommandRunResult struct {
	Status        string  `json:"status"` // Finished, Error or TimeLimitExceeded
	ExecutionTime float64 `json:"execution_time"`
	ReturnCode    *int32  `json:"return_code"` // null after a timeout
	Stdout        string  `json:"stdout"`
	Stderr        string  `json:"stderr"`
}

// Status names, SandboxFusion's.
const (
	statusSuccess      = "Success"
	statusFailed       = "Failed"
	statusSandboxError = "SandboxError"

	cmdFinished = "Finished"
	cmdError    = "Error"
	cmdTLE      = "TimeLimitExceeded"
)

// parseRunCode reads a RunCodeRequest object into dsec's request; errors
// go to c.
func parseRunCode(c *checker, m map[string]any) *dsecv1.RunCodeRequest {
	loc := []any{"body"}
	code, _ := c.str(m, loc, "code", true, false)
	lang, ok := c.str(m, loc, "language", true, false)
	if ok && lang == "" {
		c.add(loc, "language", "enum", "Input should name a language")
	}
	req := &dsecv1.RunCodeRequest{
		Language:              lang,
		Code:                  code,
		CompileTimeoutSeconds: c.float(m, loc, "compile_timeout", 10, false),
		RunTimeoutSeconds:     c.float(m, loc, "run_timeout", 10, false),
		FetchFiles:            c.strList(m, loc, "fetch_files"),
		Files:                 c.files(m, loc, "files", true),
	}
	if mb := c.integer(m, loc, "memory_limit_MB", -1); mb > 0 {
		req.MemoryMb = mb
	} // -1 (SandboxFusion's "none") and 0 take dsec's default, 1024 MiB
	if stdin, ok := c.str(m, loc, "stdin", false, true); ok {
		req.Stdin = []byte(stdin)
	}
	return req
}

func (h *handler) runCode(w http.ResponseWriter, req *http.Request) {
	m, ok := h.readBody(w, req)
	if !ok {
		return
	}
	var c checker
	rc := parseRunCode(&c, m)
	if c.failed() {
		h.reject(w, &c)
		return
	}
	resp, err := h.call(req.Context(), rc)
	if err != nil {
		h.callFailed(w, req.Context(), err)
		return
	}
	writeJSON(w, http.StatusOK, resp)
}

// call runs one call through the gate.
func (h *handler) call(ctx context.Context, rc *dsecv1.RunCodeRequest) (*RunCodeResponse, error) {
	if err := h.gate.enter(ctx); err != nil {
		return nil, err
	}
	defer h.gate.leave()
	resp, err := h.r.RunCode(ctx, rc)
	if err != nil {
		return nil, err
	}
	return toResponse(rc, resp), nil
}

// errKind is how an error of the runner (or the gate) reaches the client.
type errKind int

const (
	kindSandboxError errKind = iota // HTTP 200, status SandboxError
	kindInvalid                     // HTTP 422: the request is wrong
	kindOverloaded                  // HTTP 504: retry later
	kindGone                        // the client went away: no answer
)

func classify(ctx context.Context, err error) errKind {
	if errors.Is(err, errOverloaded) {
		return kindOverloaded
	}
	if ctx.Err() != nil {
		return kindGone
	}
	switch errdefs.Code(err) {
	case connect.CodeInvalidArgument, connect.CodeOutOfRange:
		return kindInvalid
	case connect.CodeResourceExhausted:
		return kindOverloaded
	}
	return kindSandboxError
}

// callFailed answers a call that could not be run.
func (h *handler) callFailed(w http.ResponseWriter, ctx context.Context, err error) {
	switch classify(ctx, err) {
	case kindGone:
	case kindOverloaded:
		writeJSON(w, http.StatusGatewayTimeout, h.overloadedDetail(err))
	case kindInvalid:
		writeJSON(w, http.StatusUnprocessableEntity, validationBody{[]FieldError{invalidField(err)}})
	default:
		h.log.Warn("sandboxfusion: run code", "err", err)
		writeJSON(w, http.StatusOK, sandboxError(faultWords(outcome.Of(err), err.Error())))
	}
}

// invalidField places the runner's InvalidArgument on the field it is
// about, by the field names fncall's messages start with.
func invalidField(err error) FieldError {
	msg := err.Error()
	if ce := new(connect.Error); errors.As(err, &ce) {
		msg = ce.Message()
	}
	msg = strings.TrimSuffix(strings.TrimPrefix(msg, "run code: "), ": "+errdefs.ErrInvalidArgument.Error())
	fe := FieldError{Loc: []any{"body"}, Msg: msg, Type: "value_error"}
	for _, f := range []struct{ prefix, field, typ string }{
		{"unknown language", "language", "enum"},
		{"compile_timeout", "compile_timeout", "value_error"},
		{"run_timeout", "run_timeout", "value_error"},
		{"memory_mb", "memory_limit_MB", "value_error"},
		{"files", "files", "value_error"},
		{"fetch_files", "fetch_files", "value_error"},
		{"the code and files", "files", "value_error"},
	} {
		if strings.HasPrefix(msg, f.prefix) {
			fe.Loc, fe.Type = []any{"body", f.field}, f.typ
			break
		}
	}
	return fe
}

// faultWords puts a platform fault's name before msg, as SandboxFusion's
// SandboxError carries no field of its own for it: "infrastructure fault
// (edge_unreachable): …". A message without one is the call's own.
func faultWords(f dsecv1.Fault, msg string) string {
	if w := outcome.Words(f); w != "" {
		return "infrastructure fault (" + w + "): " + msg
	}
	return msg
}

func sandboxError(msg string) *RunCodeResponse {
	return &RunCodeResponse{Status: statusSandboxError, Message: msg, Files: map[string]string{}}
}

// toResponse maps dsec's answer onto SandboxFusion's.
func toResponse(rc *dsecv1.RunCodeRequest, r *dsecv1.RunCodeResponse) *RunCodeResponse {
	out := &RunCodeResponse{
		Message:       r.GetMessage(),
		CompileResult: toCommand(r.GetCompileResult()),
		RunResult:     toCommand(r.GetRunResult()),
		Files:         fetched(rc.GetFetchFiles(), r.GetFiles()),
	}
	if n := r.GetNode(); n != "" {
		out.ExecutorPodName = &n
	}
	if r.GetFault() != dsecv1.Fault_FAULT_UNSPECIFIED && r.GetStatus() != dsecv1.RunStatus_RUN_STATUS_SANDBOX_ERROR {
		// The platform ended the call: never a result to score.
		out.Status = statusSandboxError
		out.Message = faultWords(r.GetFault(), out.Message)
		return out
	}
	switch r.GetStatus() {
	case dsecv1.RunStatus_RUN_STATUS_SUCCESS:
		out.Status = statusSuccess
	case dsecv1.RunStatus_RUN_STATUS_FAILED:
		out.Status = statusFailed
	case dsecv1.RunStatus_RUN_STATUS_SANDBOX_ERROR:
		out.Status = statusSandboxError
		out.Message = faultWords(r.GetFault(), out.Message)
	default:
		out.Status = statusSandboxError
		if out.Message == "" {
			out.Message = "the runner answered without a status"
		}
	}
	if out.Message == "" && out.Status == statusFailed {
		// SandboxFusion leaves message empty here; dsec says why, where
		// the output alone would not, without touching stdout or stderr.
		out.Message = cause(r)
	}
	return out
}

// cause names what ended a failed call when the output would not show it.
func cause(r *dsecv1.RunCodeResponse) string {
	var why []string
	for _, s := range []struct {
		name string
		c    *dsecv1.CommandResult
	}{{"compile", r.GetCompileResult()}, {"run", r.GetRunResult()}} {
		if s.c == nil {
			continue
		}
		if s.c.GetMemoryLimitExceeded() {
			why = append(why, "the "+s.name+" step was killed at the call's memory limit (memory_limit_MB)")
		}
		if s.c.GetStdoutTruncated() || s.c.GetStderrTruncated() {
			why = append(why, "the "+s.name+" step's output was cut at 1 MiB per stream")
		}
	}
	return strings.Join(why, "; ")
}

func toCommand(c *dsecv1.CommandResult) *CommandRunResult {
	if c == nil {
		return nil
	}
	out := &CommandRunResult{
		ExecutionTime: c.GetExecutionTimeSeconds(),
		Stdout:        text(c.GetStdout()),
		Stderr:        text(c.GetStderr()),
	}
	switch c.GetStatus() {
	case dsecv1.CommandStatus_COMMAND_STATUS_FINISHED:
		out.Status = cmdFinished
	case dsecv1.CommandStatus_COMMAND_STATUS_TIME_LIMIT_EXCEEDED:
		out.Status = cmdTLE
	default:
		out.Status = cmdError
	}
	if c.ReturnCode != nil && out.Status != cmdTLE {
		rc := *c.ReturnCode
		out.ReturnCode = &rc
	}
	return out
}

// fetched keys the fetched files by the paths the client asked for:
// dsec keys them by their path relative to the scratch directory
// ("./out.txt" comes back as "out.txt"), SandboxFusion by the path as
// given.
func fetched(asked []string, got map[string][]byte) map[string]string {
	out := make(map[string]string, len(got))
	left := make(map[string][]byte, len(got))
	for k, v := range got {
		left[k] = v
	}
	for _, p := range asked {
		for _, k := range candidates(p) {
			if data, ok := left[k]; ok {
				out[p] = base64.StdEncoding.EncodeToString(data)
				delete(left, k)
				break
			}
		}
	}
	for k, v := range left {
		out[k] = base64.StdEncoding.EncodeToString(v)
	}
	return out
}

// candidates are the keys dsec may have given the fetched file p.
func candidates(p string) []string {
	c := []string{p, path.Clean(p)}
	if path.IsAbs(p) {
		// /tmp/call-N/rel: the scratch dir's own absolute path.
		parts := strings.SplitN(strings.TrimPrefix(path.Clean(p), "/"), "/", 3)
		if len(parts) == 3 {
			c = append(c, parts[2])
		}
	}
	return c
}
