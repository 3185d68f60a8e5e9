package e2b

import (
	"context"
	"net/http"
	"strings"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/e2b/filesystem/filesystempbconnect"
	"dsec.dev/dsec/api/gen/e2b/process/processpbconnect"
)

// envdPlane is envd's API: the process and filesystem Connect services
// (JSON and binary codecs, HTTP/1.1 and 2), GET /health and /files.
func (h *Handler) envdPlane() http.Handler {
	mux := http.NewServeMux()
	mux.Handle(processpbconnect.NewProcessHandler(&processService{h: h}))
	mux.Handle(filesystempbconnect.NewFilesystemHandler(&fsService{h: h}))
	mux.HandleFunc("/health", h.serveHealth)
	mux.HandleFunc("/files", h.serveFiles)
	return mux
}

// serveHealth is envd's health check, which the SDK's isRunning asks: it
// says whether the sandbox runs now. A paused one answers 502, as on E2B
// (the other data-plane calls resume it), and the check never resumes it.
func (h *Handler) serveHealth(w http.ResponseWriter, r *http.Request) {
	t := targetOf(r.Context())
	sb, err := h.get(r.Context(), t.ID)
	if err != nil || sb.GetState() != dsecv1.State_STATE_RUNNING {
		writeError(w, http.StatusBadGateway, "sandbox "+t.E2BID+" is not running")
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// get is the dsec sandbox id.
func (h *Handler) get(ctx context.Context, id string) (*dsecv1.Sandbox, error) {
	resp, err := h.api.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: id}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

// stateName is a dsec state in dsec's own words, lower case ("paused",
// "stopped"), for messages.
func stateName(s dsecv1.State) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "STATE_"))
}
