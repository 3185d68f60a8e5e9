package sandboxfusion

import (
	_ "embed"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"slices"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// /run_jupyter runs notebook cells. SandboxFusion starts a Jupyter kernel
// per request; dsec runs one python call whose code is a driver
// (jupyter_driver.py) that executes the cells in order in one namespace
// and writes each cell's stdout, stderr, displays and errors to a file
// the call fetches back. No kernel, so no magics (%, !) and no rich
// display beyond text/plain and text/html.

//go:embed jupyter_driver.py
var jupyterDriver string

// jupyterResult is the file the driver writes, in the call's scratch dir.
const jupyterResult = ".dsec-jupyter-result.json"

// RunJupyterResponse is SandboxFusion's answer to /run_jupyter.
type RunJupyterResponse struct {
	Status          string            `json:"status"`
	Message         string            `json:"message"`
	Driver          *CommandRunResult `json:"driver"`
	Cells           []CellRunResult   `json:"cells"`
	ExecutorPodName *string           `json:"executor_pod_name"`
	Files           map[string]string `json:"files"`
}

// CellRunResult is what one cell did.
type CellRunResult struct {
	Stdout  string           `json:"stdout"`
	Stderr  string           `json:"stderr"`
	Display []map[string]any `json:"display"`
	Error   []map[string]any `json:"error"`
}

type driverInput struct {
	Cells       []string `json:"cells"`
	CellTimeout float64  `json:"cell_timeout"`
	Result      string   `json:"result"`
}

type driverOutput struct {
	Status string          `json:"status"`
	Cells  []CellRunResult `json:"cells"`
}

func (h *handler) runJupyter(w http.ResponseWriter, req *http.Request) {
	m, ok := h.readBody(w, req)
	if !ok {
		return
	}
	var c checker
	loc := []any{"body"}
	in := driverInput{Result: jupyterResult}
	if v, ok := c.get(m, loc, "cells", true); ok {
		if _, isList := v.([]any); !isList {
			c.add(loc, "cells", "list_type", "Input should be a valid list")
		} else {
			in.Cells = c.strList(m, loc, "cells")
		}
	} else if _, present := m["cells"]; present {
		c.add(loc, "cells", "list_type", "Input should be a valid list")
	}
	in.CellTimeout = c.float(m, loc, "cell_timeout", 0, false)
	total := c.float(m, loc, "total_timeout", 45, false)
	if k, ok := c.str(m, loc, "kernel", false, false); ok && k != "python3" {
		c.add(loc, "kernel", "literal_error", "Input should be 'python3'")
	}
	files := c.files(m, loc, "files", true)
	fetch := c.strList(m, loc, "fetch_files")
	if in.CellTimeout < 0 {
		c.add(loc, "cell_timeout", "greater_than_equal", "Input should be greater than or equal to 0")
	}
	if total <= 0 {
		c.add(loc, "total_timeout", "greater_than", "Input should be greater than 0")
	}
	if c.failed() {
		h.reject(w, &c)
		return
	}
	stdin, err := json.Marshal(in)
	if err != nil {
		writeJSON(w, http.StatusOK, &RunJupyterResponse{Status: statusSandboxError, Message: err.Error(), Cells: []CellRunResult{}, Files: map[string]string{}})
		return
	}
	rc := &dsecv1.RunCodeRequest{
		Language:          "python",
		Code:              jupyterDriver,
		Stdin:             stdin,
		Files:             files,
		FetchFiles:        append(slices.Clone(fetch), jupyterResult),
		RunTimeoutSeconds: total,
	}
	resp, err := h.call(req.Context(), rc)
	if err != nil {
		switch classify(req.Context(), err) {
		case kindGone:
		case kindOverloaded:
			writeJSON(w, http.StatusGatewayTimeout, h.overloadedDetail(err))
		default:
			// The request was checked above: what the runner refuses is
			// its own failure (say, no python), not the request's.
			h.log.Warn("sandboxfusion: run jupyter", "err", err)
			writeJSON(w, http.StatusOK, &RunJupyterResponse{Status: statusSandboxError, Message: err.Error(), Cells: []CellRunResult{}, Files: map[string]string{}})
		}
		return
	}
	writeJSON(w, http.StatusOK, jupyterResponse(resp))
}

// jupyterResponse maps the driver's call onto SandboxFusion's answer: a
// driver that did not finish (timed out, killed, or wrote no result) is
// Failed with no cells, as SandboxFusion's.
func jupyterResponse(resp *RunCodeResponse) *RunJupyterResponse {
	out := &RunJupyterResponse{
		Status: statusSuccess, Driver: resp.RunResult, Cells: []CellRunResult{},
		ExecutorPodName: resp.ExecutorPodName, Files: map[string]string{},
	}
	result, haveResult := resp.Files[jupyterResult]
	for k, v := range resp.Files {
		if k != jupyterResult {
			out.Files[k] = v
		}
	}
	switch {
	case resp.Status == statusSandboxError:
		out.Status, out.Message = statusSandboxError, resp.Message
		return out
	case resp.RunResult == nil || resp.RunResult.Status != cmdFinished:
		out.Status, out.Files = statusFailed, map[string]string{}
		return out
	case !haveResult:
		out.Status, out.Message = statusFailed, "the notebook's process ended before it wrote the cells' results"
		return out
	}
	data, err := base64.StdEncoding.DecodeString(result)
	var d driverOutput
	if err == nil {
		err = json.Unmarshal(data, &d)
	}
	if err != nil {
		out.Status, out.Message = statusSandboxError, "read the notebook driver's result: "+err.Error()
		return out
	}
	for i := range d.Cells {
		if d.Cells[i].Display == nil {
			d.Cells[i].Display = []map[string]any{}
		}
		if d.Cells[i].Error == nil {
			d.Cells[i].Error = []map[string]any{}
		}
	}
	out.Cells = d.Cells
	if out.Cells == nil {
		out.Cells = []CellRunResult{}
	}
	return out
}
