package console

import (
	"fmt"
	"html/template"
	"io"
	"net/http"
	"strings"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// maxExecOutput bounds what one command's page shows; past it the output
// is cut and the page says so.
const maxExecOutput = 4 << 20

// exec runs a command in a sandbox (Exec, under the sandbox's shell) and
// streams its output into the page as it comes, each chunk flushed, so a
// browser shows it live; the page ends with the exit. Closing the page
// cancels the call.
func (c *Console) exec(w http.ResponseWriter, r *request) {
	id := r.PathValue("id")
	cmd := strings.TrimSpace(r.PostFormValue("command"))
	if cmd == "" {
		c.fail(w, r, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("no command to run: %w", errdefs.ErrInvalidArgument)))
		return
	}
	stream, err := c.cfg.Sandboxes.Exec(r.Context(), connect.NewRequest(&dsecv1.ExecRequest{SandboxId: id, Command: cmd}))
	if err != nil {
		c.fail(w, r, err)
		return
	}
	defer stream.Close()
	// The first message says whether the call was taken: a refusal gets
	// the error page with its status, not a half-written one.
	if !stream.Receive() {
		err := stream.Err()
		if err == nil {
			err = connect.NewError(connect.CodeInternal, fmt.Errorf("the exec stream ended before the command started"))
		}
		c.fail(w, r, err)
		return
	}
	t := c.pages["exec"]
	p := c.frame(r, "exec", map[string]any{"ID": id, "Command": cmd})
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	if err := t.ExecuteTemplate(w, "exec_head", p); err != nil {
		c.cfg.Log.Warn("render the exec page", "err", err)
		return
	}
	rc := http.NewResponseController(w)
	written := 0
	out := func(b []byte, class string) {
		if written >= maxExecOutput || len(b) == 0 {
			return
		}
		b = b[:min(len(b), maxExecOutput-written)]
		written += len(b)
		fmt.Fprintf(w, `<span class="%s">`, class)
		template.HTMLEscape(w, b)
		io.WriteString(w, "</span>")
		rc.Flush()
	}
	var exited *dsecv1.ExecExited
	for ev := stream.Msg(); ; ev = stream.Msg() {
		switch e := ev.GetEvent().(type) {
		case *dsecv1.ExecEvent_Stdout:
			out(e.Stdout, "stdout")
		case *dsecv1.ExecEvent_Stderr:
			out(e.Stderr, "stderr")
		case *dsecv1.ExecEvent_Exited:
			exited = e.Exited
		}
		if exited != nil || !stream.Receive() {
			break
		}
	}
	end := map[string]any{"Truncated": written >= maxExecOutput}
	switch {
	case exited != nil:
		end["Exit"] = exited.GetExitCode()
		end["Seconds"] = fmt.Sprintf("%.3f", exited.GetDurationSeconds())
		if f := exited.GetFault(); f != dsecv1.Fault_FAULT_UNSPECIFIED {
			end["Fault"] = strings.ToLower(strings.TrimPrefix(f.String(), "FAULT_"))
		}
	case stream.Err() != nil:
		end["Error"] = stream.Err().Error()
	default:
		end["Error"] = "the stream ended without the command's exit"
	}
	p.Data = end
	if err := t.ExecuteTemplate(w, "exec_tail", p); err != nil {
		c.cfg.Log.Warn("render the exec page", "err", err)
	}
}

// frame is the page data render would pass, for pages written in parts.
func (c *Console) frame(r *request, name string, data any) page {
	p := page{Title: name, Nav: name, Data: data, Principal: r.au.Principal,
		Project: iam.Display(r.au.Project), Role: r.au.Role.String()}
	if r.au.Node {
		p.Role = "node administrator"
	}
	if r.sess != nil {
		p.CSRF = r.sess.csrf
	}
	return p
}
