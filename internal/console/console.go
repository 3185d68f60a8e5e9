// Package console is dsec's web console: server-rendered HTML pages, at
// /console on the apiserver's port, showing a signed-in token what it may
// see (nodes, sandboxes, warm pools, layers and environments, projects and
// quotas) and acting for it (pause, resume, delete, a command's live
// output).
//
// The console holds no authority of its own and decides nothing: every
// page is made of calls to the apiserver's own Connect services, carrying
// the signed-in token as their bearer token, so listing, filtering,
// project scoping (another project's sandbox is NotFound) and refusals
// (a viewer cannot pause) are the API's, through its interceptor and
// handlers. iam.Allow is asked only to mark what the token may not do.
//
// A browser signs in by posting a token; it gets a session cookie
// (HttpOnly, SameSite=Strict, Secure over TLS) naming a session kept in
// the metadata store (Config.Sessions), so every apiserver on the store
// accepts it and a restart keeps it; the store holds a hash of the
// cookie and the token sealed under a key only the cookie gives. Every
// form carries the session's CSRF token, and a POST without it is
// refused.
package console

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"time"

	"connectrpc.com/connect"

	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
)

// Prefix is the path the console is served under.
const Prefix = "/console"

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// Config is what a console calls. The clients must reach the apiserver
// such that a call carrying a bearer token is decided by that token (an
// in-process connection of package memconn does); the console never
// sends a call without one.
type Config struct {
	Sandboxes dsecv1connect.SandboxServiceClient
	Layers    dsecv1connect.LayerServiceClient
	// IAM is nil when the server serves no IAM service: the projects page
	// then says so.
	IAM dsecv1connect.IAMServiceClient
	// Authenticate checks a token as the apiserver does (its iam.Cache),
	// at sign-in and on every request after it.
	Authenticate func(ctx context.Context, token string) (iam.Authority, error)
	// Sessions keeps the signed-in sessions: the apiservers' shared store,
	// so any of them accepts a browser another signed in. nil keeps them
	// in this process's memory (a restart signs everyone out).
	Sessions store.ConsoleSessions
	Log      *slog.Logger
	// Now is the clock; nil is time.Now.
	Now func() time.Time
}

// Console serves the pages. Make it with New.
type Console struct {
	cfg      Config
	sessions sessions
	pages    map[string]*template.Template
	mux      *http.ServeMux
}

// New returns the console.
func New(cfg Config) (*Console, error) {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Sessions == nil {
		cfg.Sessions = newMemSessions()
	}
	c := &Console{cfg: cfg, sessions: sessions{st: cfg.Sessions}, pages: map[string]*template.Template{}}
	names, err := fs.Glob(templateFS, "templates/*.html")
	if err != nil {
		return nil, fmt.Errorf("list the console's templates: %w", err)
	}
	for _, n := range names {
		base := strings.TrimSuffix(strings.TrimPrefix(n, "templates/"), ".html")
		if base == "layout" {
			continue
		}
		t, err := template.New(base).Funcs(funcs).ParseFS(templateFS, "templates/layout.html", n)
		if err != nil {
			return nil, fmt.Errorf("parse the console's template %s: %w", n, err)
		}
		c.pages[base] = t
	}
	c.routes()
	return c, nil
}

func (c *Console) routes() {
	m := http.NewServeMux()
	static, _ := fs.Sub(staticFS, "static")
	m.Handle("GET "+Prefix+"/static/", http.StripPrefix(Prefix+"/static/", cacheFor(http.FileServerFS(static))))
	m.HandleFunc("GET "+Prefix+"/signin", c.signInForm)
	m.HandleFunc("POST "+Prefix+"/signin", c.signIn)
	m.HandleFunc("GET "+Prefix, redirect(Prefix+"/sandboxes"))
	m.HandleFunc("GET "+Prefix+"/{$}", redirect(Prefix+"/sandboxes"))
	m.Handle("POST "+Prefix+"/signout", c.auth(c.signOut))
	m.Handle("GET "+Prefix+"/nodes", c.auth(c.nodes))
	m.Handle("GET "+Prefix+"/sandboxes", c.auth(c.sandboxes))
	m.Handle("GET "+Prefix+"/sandboxes/{id}", c.auth(c.sandbox))
	m.Handle("POST "+Prefix+"/sandboxes/{id}/pause", c.auth(c.pause))
	m.Handle("POST "+Prefix+"/sandboxes/{id}/resume", c.auth(c.resume))
	m.Handle("POST "+Prefix+"/sandboxes/{id}/delete", c.auth(c.delete))
	m.Handle("POST "+Prefix+"/sandboxes/{id}/exec", c.auth(c.exec))
	m.Handle("GET "+Prefix+"/pools", c.auth(c.pools))
	m.Handle("GET "+Prefix+"/layers", c.auth(c.layers))
	m.Handle("GET "+Prefix+"/projects", c.auth(c.projects))
	m.Handle("GET "+Prefix+"/events", c.auth(c.events))
	c.mux = m
}

// ServeHTTP serves the console's pages, with headers that keep them out
// of frames, caches and other sites' reach.
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("X-Frame-Options", "DENY")
	h.Set("Referrer-Policy", "same-origin") // no-referrer would make a form's Origin "null"
	c.mux.ServeHTTP(w, r)
}

func cacheFor(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "public, max-age=3600")
		h.ServeHTTP(w, r)
	})
}

func redirect(to string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) { http.Redirect(w, r, to, http.StatusSeeOther) }
}

// request is one signed-in request: who makes it and the session's CSRF
// token for the forms it renders.
type request struct {
	*http.Request
	au   iam.Authority
	sess *session
}

type tokenKey struct{}

// auth admits a request with a live session whose token the apiserver
// still accepts; any other is sent to sign in (a revoked token's session
// ends). A POST must also carry the session's CSRF token and come from
// this origin.
func (c *Console) auth(h func(http.ResponseWriter, *request)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ck, err := r.Cookie(sessionCookie)
		var sess *session
		if err == nil {
			sess, err = c.sessions.get(r.Context(), ck.Value, c.cfg.Now())
			if err != nil {
				c.cfg.Log.Warn("console session not read", "path", r.URL.Path, "err", err)
				http.Error(w, "the console's session could not be read: "+err.Error(), http.StatusServiceUnavailable)
				return
			}
		}
		if sess == nil {
			c.toSignIn(w, r)
			return
		}
		au, err := c.cfg.Authenticate(r.Context(), sess.token)
		if err != nil {
			if errors.Is(err, errdefs.ErrUnauthenticated) {
				c.endSession(r.Context(), sess)
				c.toSignIn(w, r)
				return
			}
			c.fail(w, &request{Request: r, sess: sess}, fmt.Errorf("check the session's token: %w", err))
			return
		}
		if r.Method == http.MethodPost {
			if !sameOrigin(r) || !sameToken(r.PostFormValue("csrf"), sess.csrf) {
				c.cfg.Log.Warn("console POST refused: no CSRF token of its session", "path", r.URL.Path, "peer", r.RemoteAddr)
				http.Error(w, "refused: this form did not come from this console (missing or wrong CSRF token); reload the page and try again", http.StatusForbidden)
				return
			}
		}
		ctx := context.WithValue(r.Context(), tokenKey{}, sess.token)
		h(w, &request{Request: r.WithContext(ctx), au: au, sess: sess})
	})
}

// endSession forgets a session in the store (a sign-out, or its token
// refused); a failure is logged, the session then ending when it expires
// or at its next request, whose token is refused again.
func (c *Console) endSession(ctx context.Context, sess *session) {
	if err := c.cfg.Sessions.DeleteConsoleSession(context.WithoutCancel(ctx), sess.id); err != nil {
		c.cfg.Log.Warn("console session not ended", "err", err)
	}
}

// toSignIn sends a browser to the sign-in page, coming back here after.
func (c *Console) toSignIn(w http.ResponseWriter, r *http.Request) {
	next := ""
	if r.Method == http.MethodGet {
		next = "?next=" + url.QueryEscape(r.URL.RequestURI())
	}
	http.Redirect(w, r, Prefix+"/signin"+next, http.StatusSeeOther)
}

// BearerToken is the client interceptor the console's clients must carry:
// it sends the signed-in token of the call's context, and refuses a call
// without one rather than send it token-less (which an in-process
// connection would take as the node's own).
type BearerToken struct{}

func tokenOf(ctx context.Context) (string, error) {
	tok, _ := ctx.Value(tokenKey{}).(string)
	if tok == "" {
		return "", connect.NewError(connect.CodeUnauthenticated, errors.New("the console calls the API only with a signed-in token"))
	}
	return tok, nil
}

func (BearerToken) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		tok, err := tokenOf(ctx)
		if err != nil {
			return nil, err
		}
		req.Header().Set("Authorization", "Bearer "+tok)
		return next(ctx, req)
	}
}

func (BearerToken) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		if tok, err := tokenOf(ctx); err == nil {
			conn.RequestHeader().Set("Authorization", "Bearer "+tok)
		} else {
			conn.RequestHeader().Set("Authorization", "Bearer -") // refused by the server: never token-less
		}
		return conn
	}
}

func (BearerToken) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// status is the HTTP status of an API error.
func status(err error) int {
	switch connect.CodeOf(err) {
	case connect.CodeNotFound:
		return http.StatusNotFound
	case connect.CodePermissionDenied:
		return http.StatusForbidden
	case connect.CodeUnauthenticated:
		return http.StatusUnauthorized
	case connect.CodeInvalidArgument:
		return http.StatusBadRequest
	case connect.CodeFailedPrecondition, connect.CodeAlreadyExists:
		return http.StatusConflict
	case connect.CodeResourceExhausted:
		return http.StatusTooManyRequests
	case connect.CodeUnavailable:
		return http.StatusServiceUnavailable
	case connect.CodeUnimplemented:
		return http.StatusNotImplemented
	}
	return http.StatusInternalServerError
}

// fail renders an error page with the API's words and its status.
func (c *Console) fail(w http.ResponseWriter, r *request, err error) {
	code := status(err)
	if code >= 500 {
		c.cfg.Log.Warn("console page failed", "path", r.URL.Path, "err", err)
	}
	msg := err.Error()
	var ce *connect.Error
	if errors.As(err, &ce) {
		msg = ce.Message()
	}
	c.render(w, r, code, "error", map[string]any{"Status": code, "StatusText": http.StatusText(code), "Message": msg})
}

// page is what every page's template gets: its data and the frame's.
type page struct {
	Title     string
	Principal string
	Project   string
	Role      string
	CSRF      string
	Nav       string
	Data      any
	// Refresh, when set, has the browser load the page again after that
	// many seconds (a live events page: no JavaScript).
	Refresh int
}

func (c *Console) render(w http.ResponseWriter, r *request, code int, name string, data any) {
	t, ok := c.pages[name]
	if !ok {
		http.Error(w, "no console page "+name, http.StatusInternalServerError)
		return
	}
	p := page{Title: name, Nav: name, Data: data}
	if r != nil {
		p = c.frame(r, name, data)
	}
	if d, ok := data.(map[string]any); ok {
		p.Refresh, _ = d["Refresh"].(int)
	}
	var b strings.Builder
	if err := t.ExecuteTemplate(&b, "layout", p); err != nil {
		c.cfg.Log.Error("render a console page", "page", name, "err", err)
		http.Error(w, "render the page: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	io.WriteString(w, b.String())
}
