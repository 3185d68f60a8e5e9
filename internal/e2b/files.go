package e2b

import (
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"path"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// envd's /files: GET reads a file, POST writes files (multipart, or one
// raw application/octet-stream body). Both go through dsec's ReadFile and
// WriteFile, as the request's user, inside the sandbox: a path climbing
// with ".." or through a symlink stays inside the sandbox's root, which is
// the agent's "/".

// fileChunk is how much of a file one ReadFile or WriteFile carries, so a
// large file is streamed, never held whole, and stays far below the
// agent's 64 MiB read cap.
const fileChunk = 4 << 20

// maxSignedScan bounds the sandboxes a signed URL without a sandbox header
// is tried against.
const maxSignedScan = 10_000

// Signature operations, as the SDKs sign them.
const (
	opRead  = "read"
	opWrite = "write"
)

// uploaded is one entry of POST /files' answer.
type uploaded struct {
	Name string `json:"name"`
	Type string `json:"type"`
	Path string `json:"path"`
}

// serveFiles answers /files of the sandbox in the request's context. A
// request whose URL is signed (signature, signature_expiration) passed
// serveSandbox without its access token check: it is checked here, as
// envd does, by the token when one is sent, else by the signature, made
// with the sandbox's access token for this path, operation and username.
func (h *Handler) serveFiles(w http.ResponseWriter, r *http.Request) {
	t := targetOf(r.Context())
	q := r.URL.Query()
	var op string
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		op = opRead
	case http.MethodPost:
		op = opWrite
	default:
		w.Header().Set("Allow", "GET, POST")
		writeError(w, http.StatusMethodNotAllowed, "/files takes GET or POST")
		return
	}
	if q.Has("signature") {
		if tok := r.Header.Get("X-Access-Token"); tok != "" {
			if !h.cfg.Signer.CheckAccessToken(t.ID, tok) {
				writeError(w, http.StatusUnauthorized, "access token present in header but does not match")
				return
			}
		} else if err := checkSigned(q.Get("signature"), q.Get("signature_expiration"), q.Get("path"), op, q.Get("username"), h.cfg.Signer.AccessToken(t.ID), time.Now()); err != nil {
			writeError(w, http.StatusUnauthorized, err.Error())
			return
		}
	}
	if u := q.Get("username"); u != "" {
		t.User = u
	}
	if op == opRead {
		h.getFile(w, r, t, q.Get("path"))
		return
	}
	h.postFiles(w, r, t, q)
}

// checkSigned checks a signed URL's signature and expiry.
func checkSigned(sig, expiration, p, op, user, token string, now time.Time) error {
	var exp int64
	if expiration != "" {
		n, err := strconv.ParseInt(expiration, 10, 64)
		if err != nil {
			return errors.New("signature_expiration is not a number of seconds")
		}
		exp = n
	}
	// Expiry is checked after the signature, so a forged URL never learns
	// more than "invalid".
	if !CheckFileSignature(sig, p, op, user, token, exp, time.Time{}) {
		return errors.New("invalid signature")
	}
	if exp != 0 && now.Unix() > exp {
		return errors.New("signature is already expired")
	}
	return nil
}

// serveSignedFiles answers a signed /files URL that names no sandbox (a
// browser or curl given only the URL: the SDKs' downloadUrl and uploadUrl
// carry no E2b-Sandbox-Id). The signature binds the sandbox's access
// token, so the sandbox is the live one whose token makes it: each is
// tried, at most maxSignedScan of them (an HMAC and a SHA-256 apiece).
func (h *Handler) serveSignedFiles(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	op := opWrite
	if r.Method == http.MethodGet || r.Method == http.MethodHead {
		op = opRead
	}
	resp, err := h.api.List(r.Context(), connect.NewRequest(&dsecv1.ListRequest{
		States: []dsecv1.State{dsecv1.State_STATE_RUNNING, dsecv1.State_STATE_PAUSED}}))
	if err != nil {
		writeError(w, statusOf(err), "list sandboxes: "+messageOf(err))
		return
	}
	now := time.Now()
	expired := false
	for i, sb := range resp.Msg.GetSandboxes() {
		if i >= maxSignedScan {
			break
		}
		err := checkSigned(q.Get("signature"), q.Get("signature_expiration"), q.Get("path"), op, q.Get("username"), h.cfg.Signer.AccessToken(sb.GetId()), now)
		if err != nil {
			expired = expired || strings.Contains(err.Error(), "expired")
			continue
		}
		if err := h.live(r.Context(), sb.GetId()); err != nil {
			writeError(w, http.StatusBadGateway, "sandbox "+SandboxID(sb.GetId())+" is not running: "+err.Error())
			return
		}
		ctx := withTarget(r.Context(), target{ID: sb.GetId(), E2BID: SandboxID(sb.GetId())})
		h.serveFiles(w, r.WithContext(ctx))
		return
	}
	if expired {
		writeError(w, http.StatusUnauthorized, "signature is already expired")
		return
	}
	writeError(w, http.StatusUnauthorized, "invalid signature: it was made by no running sandbox's access token")
}

// getFile streams the file at p, in chunks of fileChunk.
func (h *Handler) getFile(w http.ResponseWriter, r *http.Request, t target, p string) {
	ctx := r.Context()
	p = abs(t, p)
	read := func(off int64) (*dsecv1.ReadFileResponse, error) {
		resp, err := h.api.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: t.ID, Path: p, Offset: off, Limit: fileChunk, User: userOf(t)}))
		if err != nil {
			return nil, err
		}
		return resp.Msg, nil
	}
	first, err := read(0)
	if err != nil {
		switch connect.CodeOf(err) {
		case connect.CodeNotFound:
			writeError(w, http.StatusNotFound, fmt.Sprintf("path '%s' does not exist", p))
		case connect.CodeInvalidArgument:
			writeError(w, http.StatusBadRequest, fmt.Sprintf("path '%s': %s", p, messageOf(err)))
		default:
			writeError(w, statusOf(err), messageOf(err))
		}
		return
	}
	hd := w.Header()
	hd.Set("Content-Type", "application/octet-stream")
	hd.Set("Content-Disposition", mime.FormatMediaType("inline", map[string]string{"filename": path.Base(p)}))
	if !first.GetTruncated() {
		hd.Set("Content-Length", strconv.Itoa(len(first.GetData())))
	}
	w.WriteHeader(http.StatusOK)
	if r.Method == http.MethodHead {
		return
	}
	if _, err := w.Write(first.GetData()); err != nil {
		return
	}
	off := int64(len(first.GetData()))
	for more := first.GetTruncated(); more; {
		next, err := read(off)
		if err != nil {
			// The status is sent; breaking the body is all that is left.
			h.log.Warn("E2B file read broke off", "sandbox", t.ID, "path", p, "offset", off, "err", err)
			panic(http.ErrAbortHandler)
		}
		if _, err := w.Write(next.GetData()); err != nil {
			return
		}
		off += int64(len(next.GetData()))
		more = next.GetTruncated() && len(next.GetData()) > 0
	}
}

// postFiles writes the request's files: a multipart body's "file" parts
// (each to the path query parameter, or else to its file name, a path
// relative to the user's home or absolute) or an application/octet-stream
// body (to path). Missing parents are made.
func (h *Handler) postFiles(w http.ResponseWriter, r *http.Request, t target, q map[string][]string) {
	ctx := r.Context()
	qp := ""
	if v := q["path"]; len(v) > 0 {
		qp = v[0]
	}
	body := r.Body
	if strings.EqualFold(r.Header.Get("Content-Encoding"), "gzip") {
		zr, err := gzip.NewReader(r.Body)
		if err != nil {
			writeError(w, http.StatusBadRequest, "the gzip body is malformed: "+err.Error())
			return
		}
		defer zr.Close()
		body = zr
	}
	mediaType, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	var out []uploaded
	switch {
	case mediaType == "application/octet-stream":
		if qp == "" {
			writeError(w, http.StatusBadRequest, "path query parameter is required for raw body upload")
			return
		}
		p := abs(t, qp)
		if err := h.writeStream(ctx, t, p, body); err != nil {
			writeFileError(w, p, err)
			return
		}
		out = append(out, uploaded{Name: path.Base(p), Type: "file", Path: p})
	case strings.HasPrefix(mediaType, "multipart/"):
		mr, err := multipartReader(body, params["boundary"])
		if err != nil {
			writeError(w, http.StatusBadRequest, "parse the multipart form: "+err.Error())
			return
		}
		seen := map[string]bool{}
		for {
			part, err := mr.NextPart()
			if err == io.EOF {
				break
			}
			if err != nil {
				writeError(w, http.StatusBadRequest, "read the multipart form: "+err.Error())
				return
			}
			if part.FormName() != "file" {
				part.Close()
				continue
			}
			name := qp
			if name == "" {
				name = partFileName(part.Header.Get("Content-Disposition"))
			}
			if name == "" {
				part.Close()
				writeError(w, http.StatusBadRequest, "a file part has no file name and the request no path query parameter")
				return
			}
			p := abs(t, name)
			if seen[p] {
				part.Close()
				writeError(w, http.StatusBadRequest, fmt.Sprintf("you cannot upload multiple files to the same path '%s' in one upload request", p))
				return
			}
			seen[p] = true
			err = h.writeStream(ctx, t, p, part)
			part.Close()
			if err != nil {
				writeFileError(w, p, err)
				return
			}
			out = append(out, uploaded{Name: path.Base(p), Type: "file", Path: p})
		}
	default:
		writeError(w, http.StatusBadRequest, fmt.Sprintf("unsupported content type %q, expected multipart/form-data or application/octet-stream", r.Header.Get("Content-Type")))
		return
	}
	if out == nil {
		out = []uploaded{}
	}
	writeJSON(w, http.StatusOK, out)
}

// writeFileError answers a failed write of p.
func writeFileError(w http.ResponseWriter, p string, err error) {
	if errors.Is(err, errBody) {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	status := statusOf(err)
	if connect.CodeOf(err) == connect.CodeResourceExhausted {
		status = http.StatusInsufficientStorage
	}
	writeError(w, status, fmt.Sprintf("write %s: %s", p, messageOf(err)))
}

// errBody marks a request body that could not be read.
var errBody = errors.New("read the request body")

// writeStream writes r to p in the sandbox, fileChunk at a time: the first
// chunk replaces the file (making its parents), the rest are appended.
func (h *Handler) writeStream(ctx context.Context, t target, p string, r io.Reader) error {
	buf := make([]byte, fileChunk)
	first := true
	for {
		n, rerr := io.ReadFull(r, buf)
		if rerr != nil && rerr != io.EOF && rerr != io.ErrUnexpectedEOF {
			return fmt.Errorf("%w: %v", errBody, rerr)
		}
		if n > 0 || first {
			_, err := h.api.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{SandboxId: t.ID, Path: p, Data: buf[:n],
				Append: !first, MakeParents: first, User: userOf(t)}))
			if err != nil {
				return err
			}
			first = false
		}
		if rerr != nil {
			return nil
		}
	}
}

// multipartReader reads a multipart body with the given boundary.
func multipartReader(body io.Reader, boundary string) (*multipart.Reader, error) {
	if boundary == "" {
		return nil, errors.New("the Content-Type names no boundary")
	}
	return multipart.NewReader(body, boundary), nil
}

// partFileName is the file name of a part's Content-Disposition as sent:
// a path, which Go's Part.FileName would cut to its last element.
func partFileName(disposition string) string {
	_, params, err := mime.ParseMediaType(disposition)
	if err != nil {
		return ""
	}
	return params["filename"]
}
