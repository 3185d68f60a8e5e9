// Package metrics holds the Prometheus metrics a dsecd process records and
// serves at /metrics. There is no global registry: each process makes one
// Registry and passes its parts down (an edge's sandbox manager takes an
// *Edge); a nil *Edge records nothing, so tests and tools that need no
// metrics pass none. docs/operations.md lists every metric, its type and
// labels.
//
// Labels are bounded: no sandbox ID is ever a label; backends, isolations,
// outcomes (internal/outcome's faults), operations and admission reasons
// are small fixed sets.
package metrics

import (
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/outcome"
)

// Registry is one process's metrics. Make it with New; Handler serves it.
type Registry struct {
	reg *prometheus.Registry

	mu     sync.Mutex
	errors map[string]*Errors // by metric name: StoreErrors, BlobErrors
}

// New makes a process's registry, with the Go runtime's and the process's
// own collectors in it.
func New() *Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return &Registry{reg: reg}
}

// Handler serves the registry in Prometheus' text format.
func (r *Registry) Handler() http.Handler {
	return promhttp.HandlerFor(r.reg, promhttp.HandlerOpts{Registry: r.reg})
}

// latencyBuckets spans a warm-pool claim (milliseconds) to a microVM's cold
// boot under TCG (seconds).
var latencyBuckets = []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60}

// execBuckets spans a trivial command through the edge (about a
// millisecond) to a long test run.
var execBuckets = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 10, 60, 300}

// Edge is what a node's sandbox manager records. Its methods are safe for
// concurrent use, and a nil *Edge records nothing.
type Edge struct {
	creates       *prometheus.CounterVec
	createSeconds *prometheus.HistogramVec
	deletes       *prometheus.CounterVec
	deleteSeconds *prometheus.HistogramVec
	pauses        *prometheus.CounterVec
	pauseSeconds  *prometheus.HistogramVec
	poolHits      prometheus.Counter
	poolMisses    prometheus.Counter
	refusals      *prometheus.CounterVec
	execSeconds   *prometheus.HistogramVec
	network       *prometheus.CounterVec

	// The series hot paths record into, by their labels (children).
	createsBy *children[kindKey, timed]
	deletesBy *children[kindKey, timed]
	execsBy   *children[execKey, prometheus.Observer]
	networkBy *children[networkKey, prometheus.Counter]
}

// kindKey is a create's or a delete's labels: backend, isolation, outcome.
type kindKey struct{ backend, isolation, outcome string }

// execKey is an exec's labels.
type execKey struct{ isolation, outcome string }

// networkKey is a network event's labels.
type networkKey struct{ kind, verdict string }

// timed is a counter and a histogram of the same labels: an operation's
// count and its latency.
type timed struct {
	count   prometheus.Counter
	seconds prometheus.Observer
}

// Edge registers a node's sandbox metrics in r and returns them; nil for
// a nil r. Call it once per registry.
func (r *Registry) Edge() *Edge {
	if r == nil {
		return nil
	}
	kind := []string{"backend", "isolation", "outcome"}
	e := &Edge{
		creates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_sandbox_creates_total",
			Help: "Sandbox creates on this node by backend, isolation and outcome (ok, a fault's name, or error).",
		}, kind),
		createSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "dsec_sandbox_create_seconds",
			Help:    "Latency of sandbox creates on this node, warm-pool claims included.",
			Buckets: latencyBuckets,
		}, kind),
		deletes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_sandbox_deletes_total",
			Help: "Sandbox deletes on this node by backend, isolation and outcome.",
		}, kind),
		deleteSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "dsec_sandbox_delete_seconds",
			Help:    "Latency of sandbox deletes on this node.",
			Buckets: latencyBuckets,
		}, kind),
		pauses: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_sandbox_pauses_total",
			Help: "Pauses and resumes on this node by op (pause, resume) and outcome.",
		}, []string{"op", "outcome"}),
		pauseSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "dsec_sandbox_pause_seconds",
			Help:    "Latency of pauses and resumes on this node by op.",
			Buckets: latencyBuckets,
		}, []string{"op"}),
		poolHits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "dsec_pool_hits_total",
			Help: "Creates served by a warm pool member.",
		}),
		poolMisses: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "dsec_pool_misses_total",
			Help: "Creates a warm pool could have served but had no ready member for, and creates with no pool of their shape.",
		}),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_admission_refusals_total",
			Help: "Creates this node refused for lack of room, by reason (max_sandboxes, memory_floor).",
		}, []string{"reason"}),
		execSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "dsec_exec_seconds",
			Help:    "Execs on this node, from the request to the command's exit (or the stream's end), by isolation and outcome.",
			Buckets: execBuckets,
		}, []string{"isolation", "outcome"}),
		network: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_network_events_total",
			Help: "Sandboxes' connection attempts and DNS queries on this node by kind (connect, dns) and verdict (allow, deny).",
		}, []string{"kind", "verdict"}),
	}
	e.createsBy = newChildren(func(k kindKey) timed {
		return timed{e.creates.WithLabelValues(k.backend, k.isolation, k.outcome), e.createSeconds.WithLabelValues(k.backend, k.isolation, k.outcome)}
	})
	e.deletesBy = newChildren(func(k kindKey) timed {
		return timed{e.deletes.WithLabelValues(k.backend, k.isolation, k.outcome), e.deleteSeconds.WithLabelValues(k.backend, k.isolation, k.outcome)}
	})
	e.execsBy = newChildren(func(k execKey) prometheus.Observer { return e.execSeconds.WithLabelValues(k.isolation, k.outcome) })
	e.networkBy = newChildren(func(k networkKey) prometheus.Counter { return e.network.WithLabelValues(k.kind, k.verdict) })
	r.reg.MustRegister(e.execSeconds, e.creates, e.createSeconds, e.deletes, e.deleteSeconds, e.pauses, e.pauseSeconds,
		e.poolHits, e.poolMisses, e.refusals, e.network)
	// The series of labels known in advance start at 0, so a node that
	// has refused, paused or logged nothing yet serves them (a dashboard's
	// rate() of a series never served reads "No data", not 0).
	for _, reason := range []string{"max_sandboxes", "memory_floor"} {
		e.refusals.WithLabelValues(reason)
	}
	for _, kind := range []string{"connect", "dns"} {
		for _, verdict := range []string{"allow", "deny"} {
			e.networkBy.get(networkKey{kind, verdict})
		}
	}
	for _, op := range []string{"pause", "resume"} {
		e.pauses.WithLabelValues(op, "ok")
		e.pauseSeconds.WithLabelValues(op)
	}
	return e
}

// Outcome is err's outcome label: "ok" for nil, the fault's name where
// err is a platform fault (outcome.Words), else "error".
func Outcome(err error) string {
	if err == nil {
		return "ok"
	}
	if f := outcome.Of(err); f != dsecv1.Fault_FAULT_UNSPECIFIED {
		return outcome.Words(f)
	}
	return "error"
}

// Create records a create of the given backend and isolation that took d
// and ended with err.
func (e *Edge) Create(backend, isolation string, err error, d time.Duration) {
	if e == nil {
		return
	}
	s := e.createsBy.get(kindKey{backend, isolation, Outcome(err)})
	s.count.Inc()
	s.seconds.Observe(d.Seconds())
}

// Delete records a delete as Create records a create.
func (e *Edge) Delete(backend, isolation string, err error, d time.Duration) {
	if e == nil {
		return
	}
	s := e.deletesBy.get(kindKey{backend, isolation, Outcome(err)})
	s.count.Inc()
	s.seconds.Observe(d.Seconds())
}

// Pause records a pause or a resume (op) that took d and ended with err.
func (e *Edge) Pause(op string, err error, d time.Duration) {
	if e == nil {
		return
	}
	e.pauses.WithLabelValues(op, Outcome(err)).Inc()
	e.pauseSeconds.WithLabelValues(op).Observe(d.Seconds())
}

// Pool records whether a create was served by a warm pool member.
func (e *Edge) Pool(hit bool) {
	if e == nil {
		return
	}
	if hit {
		e.poolHits.Inc()
	} else {
		e.poolMisses.Inc()
	}
}

// Refused records a create refused for reason.
func (e *Edge) Refused(reason string) {
	if e == nil {
		return
	}
	e.refusals.WithLabelValues(reason).Inc()
}

// Exec records an exec in a sandbox of the given isolation that took d
// (request to exit) and ended with err.
func (e *Edge) Exec(isolation string, err error, d time.Duration) {
	if e == nil {
		return
	}
	e.execsBy.get(execKey{isolation, Outcome(err)}).Observe(d.Seconds())
}

// Network records a sandbox's connection attempt or DNS query (kind
// "connect" or "dns") and the verdict on it ("allow" or "deny").
func (e *Edge) Network(kind, verdict string) {
	if e == nil {
		return
	}
	e.networkBy.get(networkKey{kind, verdict}).Inc()
}

// FnCall is what a node's FnCall backend records. A nil *FnCall records
// nothing.
type FnCall struct {
	calls   *prometheus.CounterVec
	seconds *prometheus.HistogramVec
	by      *children[callKey, timed]
}

// callKey is an FnCall call's labels.
type callKey struct{ language, status string }

// FnCall registers a node's FnCall metrics in r: calls and their latency
// by language, and, read at each scrape from load, the calls waiting for a
// container (the queue), running, and the idle containers. Nil for a nil
// r. Call it once per registry.
func (r *Registry) FnCall(load func() (busy, queue, idle int)) *FnCall {
	if r == nil {
		return nil
	}
	f := &FnCall{
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_fncall_calls_total",
			Help: "FnCall calls on this node by language and status (success, failed, sandbox_error; or error: not run).",
		}, []string{"language", "status"}),
		seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "dsec_fncall_call_seconds",
			Help:    "FnCall calls' latency on this node, from arrival to answer (the wait for a container included), by language.",
			Buckets: execBuckets,
		}, []string{"language"}),
	}
	f.by = newChildren(func(k callKey) timed {
		return timed{f.calls.WithLabelValues(k.language, k.status), f.seconds.WithLabelValues(k.language)}
	})
	state := func(pick func(busy, queue, idle int) int) func() float64 {
		return func() float64 { return float64(pick(load())) }
	}
	r.reg.MustRegister(f.calls, f.seconds,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "dsec_fncall_queue", Help: "FnCall calls on this node waiting for a container now."},
			state(func(_, q, _ int) int { return q })),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "dsec_fncall_running", Help: "FnCall calls running on this node now."},
			state(func(b, _, _ int) int { return b })),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "dsec_fncall_idle_containers", Help: "FnCall containers on this node idle now."},
			state(func(_, _, i int) int { return i })))
	return f
}

// Call records a call in language (one the node knows, or "unknown")
// answered with status (see the counter's help) after d.
func (f *FnCall) Call(language, status string, d time.Duration) {
	if f == nil {
		return
	}
	s := f.by.get(callKey{language, status})
	s.count.Inc()
	s.seconds.Observe(d.Seconds())
}
