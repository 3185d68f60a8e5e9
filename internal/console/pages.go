package console

import (
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/sandboxpage"
)

// PageSize is how many sandboxes one page of the list shows.
const PageSize = 100

var funcs = template.FuncMap{
	"ms": fmtMillis,
	"utc": func(ms int64) string { // a time standing alone, not in a "(UTC)" column
		if ms == 0 {
			return fmtMillis(ms)
		}
		return fmtMillis(ms) + " UTC"
	},
	"bytes":   fmtBytes,
	"state":   stateName,
	"project": projectOf,
	"display": iam.Display,
	"kind":    kindName,
	"cpuUse":  cpuUse,
	"memUse":  memUse,
	"navs":    func() []string { return navs },
	"enum": func(v interface{ String() string }, prefix string) string {
		return strings.ToLower(strings.TrimPrefix(v.String(), prefix))
	},
	"pct": func(used, limit int64) int64 {
		if limit <= 0 {
			return 0
		}
		return min(100, used*100/limit)
	},
}

// navs are the pages the header links to.
var navs = []string{"sandboxes", "nodes", "pools", "layers", "projects", "events"}

// use is one of a node's figures for its row: how much of how much, and
// the words for it.
type use struct {
	Used, Of float64
	Text     string
}

// cpuUse is a node's busy CPUs of its CPUs; nil when it did not say.
func cpuUse(n *dsecv1.NodeInfo) *use {
	if n.GetCpus() <= 0 || n.GetCpuBusy() < 0 {
		return nil
	}
	busy := min(n.GetCpuBusy(), n.GetCpus())
	return &use{Used: busy, Of: n.GetCpus(),
		Text: fmt.Sprintf("%.2f of %g CPUs (%.0f%%)", busy, n.GetCpus(), 100*busy/n.GetCpus())}
}

// memUse is a node's memory in use (its total less what is available) of
// its total; nil when it did not say.
func memUse(n *dsecv1.NodeInfo) *use {
	total := n.GetMemoryMb()
	if total <= 0 {
		return nil
	}
	used := max(0, total-n.GetMemoryAvailableMb())
	return &use{Used: float64(used), Of: float64(total),
		Text: fmt.Sprintf("%s of %s (%.0f%%)", fmtBytes(used<<20), fmtBytes(total<<20), 100*float64(used)/float64(total))}
}

// kindName is a node's sandbox kind: isolation, profile and accelerator.
func kindName(k *dsecv1.SandboxKind) string {
	s := strings.ToLower(strings.TrimPrefix(k.GetIsolation().String(), "ISOLATION_"))
	if p := strings.ToLower(strings.TrimPrefix(k.GetProfile().String(), "BACKEND_")); p != "container" && p != "unspecified" {
		s += "/" + p
	}
	if k.GetAccelerator() != "" {
		s += " (" + k.GetAccelerator() + ")"
	}
	return s
}

func fmtMillis(ms int64) string {
	if ms == 0 {
		return "—"
	}
	return time.UnixMilli(ms).UTC().Format("2006-01-02 15:04:05")
}

func fmtBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

func stateName(s dsecv1.State) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "STATE_"))
}

// projectOf is the project a sandbox belongs to, as people write it.
func projectOf(sb *dsecv1.Sandbox) string {
	return iam.Display(sb.GetSpec().GetLabels()[iam.ProjectLabel])
}

// states maps the filter's words to the states List takes; "" is List's
// default (the live ones), "all" every state.
var states = map[string]dsecv1.State{
	"creating": dsecv1.State_STATE_CREATING, "running": dsecv1.State_STATE_RUNNING,
	"stopping": dsecv1.State_STATE_STOPPING, "stopped": dsecv1.State_STATE_STOPPED,
	"failed": dsecv1.State_STATE_FAILED, "pausing": dsecv1.State_STATE_PAUSING,
	"paused": dsecv1.State_STATE_PAUSED, "resuming": dsecv1.State_STATE_RESUMING,
}

func (c *Console) signInForm(w http.ResponseWriter, r *http.Request) {
	c.signInPage(w, r, http.StatusOK, "")
}

func (c *Console) signInPage(w http.ResponseWriter, r *http.Request, code int, problem string) {
	pre := randomToken()
	http.SetCookie(w, cookie(r, preCookie, pre, c.cfg.Now().Add(time.Hour)))
	c.render(w, &request{Request: r, sess: &session{csrf: pre}}, code, "signin",
		map[string]any{"Next": safeNext(r.FormValue("next")), "Problem": problem})
}

// safeNext keeps a sign-in's way back inside the console.
func safeNext(next string) string {
	if !strings.HasPrefix(next, Prefix+"/") || strings.HasPrefix(next, "//") || strings.Contains(next, "\\") {
		return Prefix + "/sandboxes"
	}
	return next
}

// signIn checks the posted token as the API does and starts a session.
func (c *Console) signIn(w http.ResponseWriter, r *http.Request) {
	pre, err := r.Cookie(preCookie)
	if err != nil || !sameOrigin(r) || !sameToken(r.PostFormValue("csrf"), pre.Value) {
		http.Error(w, "refused: this sign-in form did not come from this console (missing or wrong CSRF token); reload the page and try again", http.StatusForbidden)
		return
	}
	tok := strings.TrimSpace(r.PostFormValue("token"))
	if tok == "" {
		c.signInPage(w, r, http.StatusUnauthorized, "A token is needed: paste one (dsec token create, or the node's admin.token).")
		return
	}
	au, err := c.cfg.Authenticate(r.Context(), tok)
	if err != nil {
		c.cfg.Log.Warn("console sign-in refused", "peer", r.RemoteAddr, "err", err)
		if errors.Is(err, errdefs.ErrUnauthenticated) {
			c.signInPage(w, r, http.StatusUnauthorized, "That token was refused: unknown, expired or revoked.")
			return
		}
		c.signInPage(w, r, http.StatusServiceUnavailable, "The token could not be checked: "+err.Error())
		return
	}
	now := c.cfg.Now()
	if _, err := c.cfg.Sessions.ExpireConsoleSessions(r.Context(), now); err != nil {
		c.cfg.Log.Warn("expire console sessions", "err", err)
	}
	sess, value, err := c.sessions.add(r.Context(), tok, au.TokenID, au.Expires, now)
	if err != nil {
		c.cfg.Log.Warn("console session not stored", "err", err)
		c.signInPage(w, r, http.StatusServiceUnavailable, "The session could not be stored: "+err.Error())
		return
	}
	http.SetCookie(w, cookie(r, sessionCookie, value, sess.expires))
	http.SetCookie(w, cookie(r, preCookie, "", time.Time{}))
	c.cfg.Log.Info("console sign-in", "principal", au.Principal, "token", au.TokenID, "peer", r.RemoteAddr)
	http.Redirect(w, r, safeNext(r.PostFormValue("next")), http.StatusSeeOther)
}

func (c *Console) signOut(w http.ResponseWriter, r *request) {
	c.endSession(r.Context(), r.sess)
	http.SetCookie(w, cookie(r.Request, sessionCookie, "", time.Time{}))
	http.Redirect(w, r.Request, Prefix+"/signin", http.StatusSeeOther)
}

func (c *Console) nodes(w http.ResponseWriter, r *request) {
	info, err := c.cfg.Sandboxes.GetServerInfo(r.Context(), connect.NewRequest(&dsecv1.GetServerInfoRequest{}))
	if err != nil {
		c.fail(w, r, err)
		return
	}
	c.render(w, r, http.StatusOK, "nodes", info.Msg)
}

// listQuery is the sandbox list's filter, as its form and links carry
// it, with the page: after the sandbox a List page token names, the
// first shown being the From-th.
type listQuery struct {
	Project, Label, State string
	After                 string
	From                  int
}

func (q listQuery) URL(after string, from int) string {
	v := url.Values{}
	for k, s := range map[string]string{"project": q.Project, "label": q.Label, "state": q.State} {
		if s != "" {
			v.Set(k, s)
		}
	}
	if after != "" {
		v.Set("after", after)
		v.Set("from", strconv.Itoa(from))
	}
	if len(v) == 0 {
		return Prefix + "/sandboxes"
	}
	return Prefix + "/sandboxes?" + v.Encode()
}

// listRequest is the List call a filter makes: labels (KEY=VALUE, comma
// separated) and the project (its label) narrow it on the API's side; a
// filter on the root keeps the sandboxes without a project label, which
// List cannot ask for.
func (q listQuery) listRequest() (*dsecv1.ListRequest, bool, error) {
	req := &dsecv1.ListRequest{Labels: map[string]string{}}
	for _, kv := range strings.Split(q.Label, ",") {
		kv = strings.TrimSpace(kv)
		if kv == "" {
			continue
		}
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, false, fmt.Errorf("label filter %q: want KEY=VALUE: %w", kv, errdefs.ErrInvalidArgument)
		}
		req.Labels[strings.TrimSpace(k)] = strings.TrimSpace(v)
	}
	rootOnly := false
	if q.Project != "" {
		p, err := iam.CleanPath(q.Project)
		if err != nil {
			return nil, false, err
		}
		if p == "" {
			rootOnly = true
		} else {
			req.Labels[iam.ProjectLabel] = p
		}
	}
	switch q.State {
	case "":
	case "all":
		req.All = true
	default:
		s, ok := states[q.State]
		if !ok {
			return nil, false, fmt.Errorf("state %q: want one of all, %s: %w", q.State, strings.Join(slices.Sorted(mapsKeys(states)), ", "), errdefs.ErrInvalidArgument)
		}
		req.States = []dsecv1.State{s}
	}
	return req, rootOnly, nil
}

func mapsKeys(m map[string]dsecv1.State) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// sandboxes lists a page of the sandboxes the filter matches, newest
// first: List pages on the API's side (page_size, page_token), so a page
// costs one page's sandboxes on the wire whatever the total. The root's
// own sandboxes (a filter List cannot ask for) are read whole and paged
// here, in the same order and with the same tokens.
func (c *Console) sandboxes(w http.ResponseWriter, r *request) {
	q := listQuery{Project: r.FormValue("project"), Label: r.FormValue("label"), State: r.FormValue("state"), After: r.FormValue("after")}
	q.From, _ = strconv.Atoi(r.FormValue("from"))
	if q.After == "" || q.From < 1 {
		q.From = 1
	}
	req, rootOnly, err := q.listRequest()
	if err != nil {
		c.fail(w, r, connect.NewError(connect.CodeInvalidArgument, err))
		return
	}
	if !rootOnly {
		req.PageSize, req.PageToken = PageSize, q.After
	}
	resp, err := c.cfg.Sandboxes.List(r.Context(), connect.NewRequest(req))
	if err != nil {
		c.fail(w, r, err)
		return
	}
	sbs, next, total := resp.Msg.GetSandboxes(), resp.Msg.GetNextPageToken(), int(resp.Msg.GetTotal())
	if rootOnly {
		sbs = slices.DeleteFunc(sbs, func(sb *dsecv1.Sandbox) bool { return sb.GetSpec().GetLabels()[iam.ProjectLabel] != "" })
		sandboxpage.Sort(sbs)
		total = len(sbs)
		if sbs, next, err = sandboxpage.Cut(sbs, PageSize, q.After); err != nil {
			c.fail(w, r, connect.NewError(connect.CodeInvalidArgument, err))
			return
		}
	}
	to := q.From + len(sbs) - 1
	data := map[string]any{"Query": q, "Sandboxes": sbs, "Total": total, "From": q.From, "To": to, "Unreachable": resp.Msg.GetUnreachableNodes(),
		"Page": (q.From-1)/PageSize + 1, "Pages": max(1, (total+PageSize-1)/PageSize),
		"States": append([]string{"all"}, slices.Sorted(mapsKeys(states))...)}
	if q.After != "" {
		data["Newest"] = q.URL("", 0)
	}
	if next != "" {
		data["Next"] = q.URL(next, to+1)
	}
	c.render(w, r, http.StatusOK, "sandboxes", data)
}

// action is a sandbox action the page offers, with why the token may not
// take it ("" when it may): the API decides, the page only says.
type action struct {
	Name, Label, Denied string
}

func (c *Console) sandbox(w http.ResponseWriter, r *request) {
	id := r.PathValue("id")
	got, err := c.cfg.Sandboxes.Get(r.Context(), connect.NewRequest(&dsecv1.GetRequest{Id: id}))
	if err != nil {
		c.fail(w, r, err)
		return
	}
	sb := got.Msg
	project := sb.GetSpec().GetLabels()[iam.ProjectLabel]
	denied := func(op string) string {
		if err := iam.Allow(r.au, iam.Op("/dsec.v1.SandboxService/"+op), project); err != nil {
			return fmt.Sprintf("needs %s", need(op))
		}
		return ""
	}
	var acts []action
	switch sb.GetState() {
	case dsecv1.State_STATE_RUNNING:
		acts = append(acts, action{"pause", "Pause", denied("Pause")})
	case dsecv1.State_STATE_PAUSED:
		acts = append(acts, action{"resume", "Resume", denied("Resume")})
	}
	acts = append(acts, action{"delete", "Delete", denied("Delete")})
	data := map[string]any{"Sandbox": sb, "Project": iam.Display(project), "Actions": acts,
		"ExecDenied": denied("Exec"), "NetDenied": denied("NetworkLog"), "Labels": sb.GetSpec().GetLabels()}
	if data["NetDenied"] == "" {
		lg, err := c.cfg.Sandboxes.NetworkLog(r.Context(), connect.NewRequest(&dsecv1.NetworkLogRequest{SandboxId: id, Limit: 200}))
		if err != nil {
			data["NetError"] = err.Error()
		} else {
			data["Network"] = lg.Msg.GetEvents()
		}
	}
	c.render(w, r, http.StatusOK, "sandbox", data)
}

func need(op string) string {
	role, _ := iam.Need(iam.Op("/dsec.v1.SandboxService/" + op))
	return role.String()
}

func (c *Console) pause(w http.ResponseWriter, r *request) {
	_, err := c.cfg.Sandboxes.Pause(r.Context(), connect.NewRequest(&dsecv1.PauseRequest{SandboxId: r.PathValue("id")}))
	c.acted(w, r, err, "")
}

func (c *Console) resume(w http.ResponseWriter, r *request) {
	_, err := c.cfg.Sandboxes.Resume(r.Context(), connect.NewRequest(&dsecv1.ResumeRequest{SandboxId: r.PathValue("id")}))
	c.acted(w, r, err, "")
}

func (c *Console) delete(w http.ResponseWriter, r *request) {
	_, err := c.cfg.Sandboxes.Delete(r.Context(), connect.NewRequest(&dsecv1.DeleteRequest{Id: r.PathValue("id")}))
	c.acted(w, r, err, Prefix+"/sandboxes")
}

// acted answers an action: back to the sandbox's page (or to), or the
// API's refusal.
func (c *Console) acted(w http.ResponseWriter, r *request, err error, to string) {
	if err != nil {
		c.fail(w, r, err)
		return
	}
	if to == "" {
		to = Prefix + "/sandboxes/" + url.PathEscape(r.PathValue("id"))
	}
	http.Redirect(w, r.Request, to, http.StatusSeeOther)
}

func (c *Console) pools(w http.ResponseWriter, r *request) {
	resp, err := c.cfg.Sandboxes.ListWarmPools(r.Context(), connect.NewRequest(&dsecv1.ListWarmPoolsRequest{}))
	if err != nil {
		c.fail(w, r, err)
		return
	}
	c.render(w, r, http.StatusOK, "pools", resp.Msg.GetPools())
}

func (c *Console) layers(w http.ResponseWriter, r *request) {
	ls, err := c.cfg.Layers.ListLayers(r.Context(), connect.NewRequest(&dsecv1.ListLayersRequest{}))
	if connect.CodeOf(err) == connect.CodeUnimplemented {
		c.render(w, r, http.StatusOK, "layers", map[string]any{"NoLayers": true})
		return
	}
	if err != nil {
		c.fail(w, r, err)
		return
	}
	envs, err := c.cfg.Layers.ListEnvironments(r.Context(), connect.NewRequest(&dsecv1.ListEnvironmentsRequest{}))
	if err != nil {
		c.fail(w, r, err)
		return
	}
	c.render(w, r, http.StatusOK, "layers", map[string]any{"Layers": ls.Msg.GetLayers(), "Environments": envs.Msg.GetEnvironments()})
}

func (c *Console) projects(w http.ResponseWriter, r *request) {
	if c.cfg.IAM == nil {
		c.render(w, r, http.StatusOK, "projects", map[string]any{"NoIAM": true})
		return
	}
	q, err := c.cfg.IAM.GetQuota(r.Context(), connect.NewRequest(&dsecv1.GetQuotaRequest{}))
	if err != nil {
		c.fail(w, r, err)
		return
	}
	sub := true
	ps, err := c.cfg.IAM.ListProjects(r.Context(), connect.NewRequest(&dsecv1.ListProjectsRequest{Subtree: sub}))
	if err != nil {
		c.fail(w, r, err)
		return
	}
	c.render(w, r, http.StatusOK, "projects", map[string]any{"Quotas": q.Msg.GetProjects(), "Projects": ps.Msg.GetProjects()})
}

// events is a stated gap: the event store (issue 33, item 2) is not on
// this branch's main yet.
// EventsPage is how many events one page of the events list shows, and
// EventsRefresh how often a live one reloads, in seconds.
const (
	EventsPage    = 100
	EventsRefresh = 3
)

// eventKinds are the kinds the events page filters by (docs/events.md).
var eventKinds = []string{"created", "paused", "resumed", "phase_ended", "forked", "snapshot", "deleted", "expired", "failed"}

// eventsQuery is the events page's filter: a project (and those under
// it), a sandbox, a kind, a page (events below an ID), live or not.
type eventsQuery struct {
	Project, Sandbox, Kind string
	Before                 int64
	Live                   bool
}

func (q eventsQuery) URL(before int64, live bool) string {
	v := url.Values{}
	for k, s := range map[string]string{"project": q.Project, "sandbox": q.Sandbox, "kind": q.Kind} {
		if s != "" {
			v.Set(k, s)
		}
	}
	if before > 0 {
		v.Set("before", strconv.FormatInt(before, 10))
	}
	if live {
		v.Set("live", "1")
	}
	if len(v) == 0 {
		return Prefix + "/events"
	}
	return Prefix + "/events?" + v.Encode()
}

// events lists the events the token sees, newest first, a page at a
// time; live, the newest page reloads every EventsRefresh seconds.
func (c *Console) events(w http.ResponseWriter, r *request) {
	q := eventsQuery{Project: strings.TrimSpace(r.FormValue("project")), Sandbox: strings.TrimSpace(r.FormValue("sandbox")),
		Kind: r.FormValue("kind"), Live: r.FormValue("live") == "1"}
	q.Before, _ = strconv.ParseInt(r.FormValue("before"), 10, 64)
	if q.Kind != "" && !slices.Contains(eventKinds, q.Kind) {
		c.fail(w, r, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("event kind %q: want one of %s", q.Kind, strings.Join(eventKinds, ", "))))
		return
	}
	req := &dsecv1.ListEventsRequest{SandboxId: q.Sandbox, Limit: EventsPage, NewestFirst: true, Before: max(q.Before, 0)}
	if q.Project != "" {
		p, err := iam.CleanPath(q.Project)
		if err != nil {
			c.fail(w, r, connect.NewError(connect.CodeInvalidArgument, err))
			return
		}
		req.Project = &p
	}
	if q.Kind != "" {
		req.Kinds = []string{q.Kind}
	}
	resp, err := c.cfg.Sandboxes.ListEvents(r.Context(), connect.NewRequest(req))
	if err != nil {
		c.fail(w, r, err)
		return
	}
	evs := resp.Msg.GetEvents()
	data := map[string]any{"Query": q, "Events": evs, "Kinds": eventKinds}
	if q.Before > 0 {
		data["Newest"] = q.URL(0, false)
	}
	if len(evs) == EventsPage {
		data["Older"] = q.URL(evs[len(evs)-1].GetId(), false)
	}
	// Live only on the newest page: an older one does not change.
	if q.Before <= 0 {
		data["LiveURL"], data["StillURL"] = q.URL(0, true), q.URL(0, false)
		if q.Live {
			data["Refresh"] = EventsRefresh
		}
	}
	c.render(w, r, http.StatusOK, "events", data)
}
