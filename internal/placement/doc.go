// Package placement chooses the node each new sandbox goes to. It is the
// apiserver's placement engine: pure computation over the watcher's view of
// the nodes, with no I/O and no durable state. What it holds, a Placer's
// count of its own placements the nodes have not reported yet, lives only
// in the apiserver process that made them.
//
// # Use
//
// An apiserver keeps one Placer for all its requests. For a create it calls
// Place with the watcher's current view, sends the creates to the edges
// Place named, and reports every outcome with Done; the watcher calls
// Observe for every report a node sends. The edge still makes the final
// admission call, and Retry turns its answer into the next step.
//
// # The algorithm, and why
//
// Candidates are the healthy nodes that offer the backend asked for, have
// room, and are not excluded (the nodes this request already tried). For
// each sandbox Place samples K of them (3) and takes the one with the lowest
// score
//
//	(Live + in flight + placed since its report) / Capacity
//
// This is the power of k choices (DSec §3, E2B's best of K): picking the
// least loaded node of the whole cluster would send every apiserver working
// from the same view to the same node, while a small random sample spreads
// them and still keeps the fullest node close to the mean (with two or more
// choices the gap grows as log log n instead of log n / log log n).
//
// Live is as old as the node's last report, seconds at most, but at 5,000
// creates/s seconds are thousands of sandboxes. A node that looked emptiest
// at its last report keeps looking so until the next, and without more it
// draws about K/N of all creates meanwhile: the thundering herd E2B fixed in
// PR #2201 by adding the API's own unreported placements to the reported
// load. Here a placement counts from Place until Done (in flight), and after
// a successful Done as recent, until a report measured after it arrives
// (Observe, or a view whose ReportedAt is later) or RecentTTL (10 s) passes,
// so that a report taken before the sandbox existed never hides it. Nodes
// report at their own times, so this is kept per node.
//
// Each apiserver sees only its own placements. With M replicas behind a load
// balancer the other replicas' placements, (M-1)/M of the total, stay
// invisible until the next report, and all replicas favour the same nodes:
// the ones whose report is oldest. That is the herd again, across replicas:
// 4 replicas filling 160 nodes of 200 to 80 % at 5,000/s leave the fullest
// node at 1.25 × the mean, as full as the edges allow. Because each replica
// gets about 1/M of the creates and runs the same algorithm on the same
// reports, the others put about M-1 times as many sandboxes where it put
// its own; so with Config.Replicas = M a Placer counts each of its
// unreported placements M times in scores, and the fullest node ends near
// 1.03 × the mean (Simulate). The room check counts them once: a replica
// must not refuse a create for room it only guesses is gone, and the edge's
// admission catches an overshoot. Guessing Replicas high costs less than
// guessing it low: with 4 replicas, Replicas = 8 ends near 1.06 × the mean,
// Replicas = 1 at 1.25.
//
// A batch is one decision, with no I/O inside it. Sparrow (SOSP '13)
// samples d·m nodes for a batch of m tasks rather than d for each task on
// its own; here each pick samples its own K, and the batch's earlier
// picks count at once (virtual load), so 300 sandboxes over 3 equal nodes
// land 100 on each rather than all where the first sample pointed. A pick
// places up to Config.Group sandboxes (4) on the node it chose: the
// apiserver sends a node's share of a batch in one call, and a call to an
// edge costs about what a hollow create does, so a batch of 50 over 160
// nodes costs 13 calls instead of about 45, and its sandboxes share each
// node's layer cache. A small batch still gets Config.Spread picks (8)
// when it has the sandboxes and there are the nodes, its groups shrinking
// for it: 4 sandboxes over 2 nodes go 2 and 2, 8 over 160 one each. The
// price is granularity: a node's share of one
// batch may be a group off, and the fill simulation ends a little less
// even (max ÷ mean 1.05 rather than 1.03 with 4 replicas at 80 %). Sparrow's
// late binding has its counterpart in the edge's admission: a refusal is
// placed again elsewhere. A batch is placed whole or not at all; when it
// does not fit, the *ExhaustedError says what ran out (no healthy node, no
// node with the backend, every candidate tried or full, too little room for
// the batch, or a batch more than the nodes hold even when empty) and how
// much room is left. Only a shortage that waiting can end is
// ResourceExhausted, which callers (the SDKs' Overloaded) retry: no healthy
// node is Unavailable, no node with the backend and a batch too big for the
// nodes are FailedPrecondition.
//
// # Retries
//
// After an edge answers a create, Classify says what to do:
//   - errdefs.ErrResourceExhausted is the edge's admission refusing (full, or
//     short of memory): place again without that node. It is the system
//     working, not a failure, so it does not count as an attempt.
//   - InvalidArgument, NotFound, AlreadyExists, FailedPrecondition and the
//     caller's own cancellation or deadline: stop and return the error. The
//     request is at fault, and every node would answer the same.
//   - Anything else (Unavailable, Internal, an edge's DeadlineExceeded,
//     NotSupported from a node that advertised the backend): place again
//     without that node, counting an attempt; after Attempts (3) failures,
//     stop. When no node is left to place on, the caller returns the
//     failure itself, of its kind, not "every node was tried" (which would
//     read as a full fleet).
//
// Retry applies this to one create. Every node tried is excluded for the
// rest of the request, so refusals end too, at the latest when every node
// has been tried.
//
// # Time
//
// Done stamps a placement with Config.Now and reports carry the time their
// load was measured, so the two clocks must agree to well within a report
// interval. A skew makes recent placements stop counting early or late,
// never for longer than RecentTTL.
package placement
