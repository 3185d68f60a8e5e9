package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// API is what an apiserver records: its requests by procedure and its
// placement decisions. Its methods are safe for concurrent use, and a nil
// *API records nothing.
type API struct {
	requests   *prometheus.HistogramVec
	placements *prometheus.CounterVec

	// The series hot paths record into, by their labels (children).
	requestsBy   *children[requestKey, prometheus.Observer]
	placementsBy *children[string, prometheus.Counter]
}

// requestKey is a request's labels.
type requestKey struct{ procedure, code string }

// apiBuckets spans a cached read (under a millisecond) to a long create
// batch; streams (exec, follow) that outlast them land in +Inf.
var apiBuckets = []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 10, 60}

// API registers an apiserver's metrics in r and returns them: request
// latency by procedure and code, placement decisions by outcome, and,
// read at each scrape from nodes, the nodes the apiserver knows and those
// healthy (what placement chooses among). Nil for a nil r. Call it once
// per registry.
func (r *Registry) API(nodes func() (known, healthy int)) *API {
	if r == nil {
		return nil
	}
	a := &API{
		requests: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "dsec_api_request_seconds",
			Help:    "Public API requests this apiserver served, by procedure and code (ok or the Connect code), from arrival to the answer (a stream: to its end).",
			Buckets: apiBuckets,
		}, []string{"procedure", "code"}),
		placements: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_placement_decisions_total",
			Help: "Placement decisions this apiserver made, by outcome: placed, or the shortage that refused them (no_healthy_node, no_backend, all_tried, all_full, too_little_room, too_big).",
		}, []string{"outcome"}),
	}
	a.requestsBy = newChildren(func(k requestKey) prometheus.Observer { return a.requests.WithLabelValues(k.procedure, k.code) })
	a.placementsBy = newChildren(func(outcome string) prometheus.Counter { return a.placements.WithLabelValues(outcome) })
	count := func(pick func(known, healthy int) int) func() float64 {
		return func() float64 { return float64(pick(nodes())) }
	}
	r.reg.MustRegister(a.requests, a.placements,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "dsec_placement_nodes", Help: "Nodes this apiserver knows.", ConstLabels: prometheus.Labels{"state": "known"}},
			count(func(k, _ int) int { return k })),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "dsec_placement_nodes", Help: "Nodes this apiserver knows.", ConstLabels: prometheus.Labels{"state": "healthy"}},
			count(func(_, h int) int { return h })))
	return a
}

// Request records a request to procedure (a Connect procedure's path, a
// fixed set) answered with code ("ok" or a Connect code's name) after d.
func (a *API) Request(procedure, code string, d time.Duration) {
	if a == nil {
		return
	}
	a.requestsBy.get(requestKey{procedure, code}).Observe(d.Seconds())
}

// Placement records a placement decision's outcome ("placed" or a
// shortage's label).
func (a *API) Placement(outcome string) {
	if a == nil {
		return
	}
	a.placementsBy.get(outcome).Inc()
}

// Func is a value read at each scrape: a counter kept elsewhere (an
// atomic the owner adds to) or a gauge.
type Func struct {
	Name, Help string
	Value      func() float64
}

// Gauges registers gauges kept elsewhere, read at each scrape. A nil r
// does nothing.
func (r *Registry) Gauges(fs ...Func) {
	if r == nil {
		return
	}
	for _, f := range fs {
		r.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: f.Name, Help: f.Help}, f.Value))
	}
}

// Counters registers counters kept elsewhere, read at each scrape. A nil
// r does nothing.
func (r *Registry) Counters(fs ...Func) {
	if r == nil {
		return
	}
	for _, f := range fs {
		r.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: f.Name, Help: f.Help}, f.Value))
	}
}

// Errors counts failures of a store (the metadata store, the blob store)
// by store and op. A nil *Errors counts nothing.
type Errors struct {
	vec *prometheus.CounterVec
	ops []string // the ops whose series start at 0 for each store (Of)
}

// StoreErrors registers dsec_store_errors_total (the metadata store's
// failures by store, sqlite or postgres, and op, its method's name), or
// returns it when it is registered already. Nil for a nil r.
func (r *Registry) StoreErrors() *Errors {
	return r.errorsOf("dsec_store_errors_total",
		"Metadata store calls that failed (not its answers: not found, already exists, refused), by store (sqlite, postgres) and op (the store method).", nil)
}

// BlobErrors registers dsec_blob_errors_total (the blob store's failures
// by store, s3 or dir, and op: put, get, get_range, stat, delete, list),
// or returns it when it is registered already (every part of a process
// that opens a blob store counts into it). Nil for a nil r.
func (r *Registry) BlobErrors() *Errors {
	return r.errorsOf("dsec_blob_errors_total",
		"Blob store calls that failed (a missing key is an answer, not a failure), by store (s3, dir) and op (put, get, get_range, stat, delete, list).",
		[]string{"put", "get", "get_range", "stat", "delete", "list"})
}

func (r *Registry) errorsOf(name, help string, ops []string) *Errors {
	if r == nil {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if e := r.errors[name]; e != nil {
		return e
	}
	e := &Errors{vec: prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, []string{"store", "op"}), ops: ops}
	r.reg.MustRegister(e.vec)
	if r.errors == nil {
		r.errors = map[string]*Errors{}
	}
	r.errors[name] = e
	return e
}

// Of returns a function that counts a failure of op in store, for
// store.Observe and blob.Observe; nil for a nil e (pass no observer then).
// The blob store's ops, known in advance, start at 0 for store (the
// metadata store's, its methods, when they first fail).
func (e *Errors) Of(store string) func(op string) {
	if e == nil {
		return nil
	}
	for _, op := range e.ops {
		e.vec.WithLabelValues(store, op)
	}
	return func(op string) { e.vec.WithLabelValues(store, op).Inc() }
}
