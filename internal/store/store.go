// Package store is the metadata store of the control plane: the one place
// that holds durable state shared by every apiserver replica. It keeps
//
//   - create reservations and idempotency records, so a retried Create makes
//     no second batch of sandboxes, whichever replica it reaches;
//   - the rows of the sandboxes those creates made;
//   - doubts: creates an apiserver sent to a node without learning whether
//     they made a sandbox, until an apiserver has settled them with the node;
//   - the node registry: each edge's slot, the slot's generation, its address,
//     backends, capacity and certificate fingerprint, and when it was last seen;
//   - IAM: the project tree, principals, their role bindings and API tokens
//     (stored as SHA-256 only), each project's quota and use, and the audit
//     trail of management calls (package iam holds the rules they follow);
//   - the project each layer, image, snapshot and warm pool belongs to, the
//     bytes charged for it, and the projects it is shared with;
//   - the sandboxes' lifecycle events, by project, read by cursor;
//   - the cost ledger: what each sandbox used, by project and labels;
//   - the web console's sessions, so any apiserver accepts them.
//
// Store is the pluggable backend interface. Open picks an implementation by
// its DSN: SQLite (one file, what the all-in-one dsecd uses under its root)
// or PostgreSQL (what a cluster of apiservers shares). Both apply their
// schema as goose migrations embedded in the binary (migrations/sqlite,
// migrations/postgres) before Open returns. The conformance suite in
// storetest is what both must pass.
package store

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"strings"
	"time"

	"dsec.dev/dsec/internal/errdefs"
)

// Store is the metadata backend.
//
// Lifecycle: Open returns a Store whose schema is migrated to the version
// this binary knows; it holds a pool of connections until Close, and no
// method may be called after Close returns. Several Stores may share one
// database at once: any number of processes (apiserver replicas) on one
// PostgreSQL database, or handles on one SQLite file on one machine. Every
// guarantee below holds across them, not only within one Store.
//
// Concurrency: every method is safe to call from many goroutines, and each
// is atomic: it takes effect whole or not at all. An error wrapping
// errdefs.ErrUnavailable means the database could not be reached or the
// connection dropped before the answer came: the call may or may not have
// taken effect. Every method but ReserveCreate, AbandonCreate,
// CreateProject, CreatePrincipal, MintToken, Charge, Release, AppendAudit,
// ExpireIdempotency and RemoveNode does the same
// when repeated, so callers may simply try again; ReserveCreate's caller finds
// its own reservation (reserved false, Owner its own name) on a retry, and
// AbandonCreate's finds the reservation gone.
//
// Times are kept to the millisecond. Errors wrap the kinds in errdefs.
type Store interface {
	// GetIdempotency returns the outcome recorded for key, or
	// errdefs.ErrNotFound when there is none. A pending reservation has no
	// outcome yet and is reported as not found.
	GetIdempotency(ctx context.Context, key string) (Idempotency, error)
	// PutIdempotency records the outcome of a create made under a key without
	// a reservation (a single apiserver), replacing any record for the key.
	PutIdempotency(ctx context.Context, rec Idempotency) error
	// ExpireIdempotency forgets the done records (and completed reservations)
	// created before olderThan, and returns how many it removed. Pending
	// reservations are left alone.
	ExpireIdempotency(ctx context.Context, olderThan time.Time) (int, error)

	// ReserveCreate reserves r.Key for a create about to start. If the key
	// is new it stores r as a pending reservation (State, IDs, Nonce and
	// Updated are set by the store; Created too when zero) and returns it
	// with reserved true; of any number of concurrent callers, in any number of processes,
	// exactly one gets reserved true. Otherwise it returns the existing
	// reservation unchanged with reserved false. An existing key with a
	// different RequestHash is errdefs.ErrInvalidArgument.
	ReserveCreate(ctx context.Context, r CreateReservation) (got CreateReservation, reserved bool, err error)
	// CompleteCreate records the sandboxes a reserved create made and marks
	// its reservation (key, with the nonce ReserveCreate gave it) done with
	// their IDs, in one transaction: on error neither the rows nor the done
	// state are stored. Completing a done key again with the same IDs is a
	// no-op; with other IDs it is errdefs.ErrAlreadyExists, as is a sandbox ID
	// already recorded. An unknown key, or one pending under another nonce
	// (its reservation was abandoned or released and the key reserved
	// again), is errdefs.ErrNotFound: only a reservation's own creates
	// complete it.
	CompleteCreate(ctx context.Context, key, nonce string, sbs []SandboxRow) error
	// ReleaseCreate removes the pending reservation of key (its batch
	// failed), so a retry can reserve it again. Releasing an unknown key is a
	// no-op; a done reservation is never released (errdefs.ErrFailedPrecondition).
	ReleaseCreate(ctx context.Context, key string) error
	// Reservation returns key's reservation, pending or done, or
	// errdefs.ErrNotFound.
	Reservation(ctx context.Context, key string) (CreateReservation, error)
	// TouchCreate renews the lease of the pending reservation of key with
	// nonce: its Updated becomes now (never earlier than it was). The
	// creates working for a reservation touch it while they run, so that
	// AbandonCreate leaves it alone. errdefs.ErrNotFound when there is no
	// such pending reservation (done, released, abandoned, or the key
	// reserved again since).
	TouchCreate(ctx context.Context, key, nonce string) error
	// StaleCreates lists at most limit pending reservations last touched
	// before before, least recently touched first.
	StaleCreates(ctx context.Context, before time.Time, limit int) ([]CreateReservation, error)
	// AbandonCreate removes the pending reservation of key with nonce if it
	// was last touched before before, and records doubts, in one
	// transaction; it reports whether it did (false: the reservation was
	// touched, completed, released or abandoned meanwhile, and nothing was
	// stored). A CompleteCreate racing it either wins, and AbandonCreate
	// does nothing, or finds the reservation gone.
	AbandonCreate(ctx context.Context, key, nonce string, before time.Time, doubts []Doubt) (bool, error)
	// SandboxRows lists the sandbox rows a completed create recorded under
	// key, in ID order.
	SandboxRows(ctx context.Context, key string) ([]SandboxRow, error)
	// NodeSandboxRows lists the sandbox rows of the sandboxes on node, in ID
	// order.
	NodeSandboxRows(ctx context.Context, node string) ([]SandboxRow, error)
	// DeleteSandboxRows removes the rows of the given sandboxes; unknown IDs
	// are ignored.
	DeleteSandboxRows(ctx context.Context, ids []string) error

	// AddDoubts records doubts. A doubt already recorded (the same node and
	// token) is kept as it was.
	AddDoubts(ctx context.Context, doubts []Doubt) error
	// Doubts lists every recorded doubt, by node, then oldest first.
	Doubts(ctx context.Context) ([]Doubt, error)
	// ClearDoubts forgets doubts, named by node and token; unknown ones are
	// ignored.
	ClearDoubts(ctx context.Context, doubts []Doubt) error
	// ForgetDoubts deletes the doubts of the nodes not in keep (the fleet
	// as the caller sees it: every registered node, reachable or not)
	// recorded before before: those of nodes that left the cluster, which
	// no node would ever settle. It returns how many it deleted.
	ForgetDoubts(ctx context.Context, keep []string, before time.Time) (int, error)

	// RegisterNode registers an edge and returns its record. A new name
	// gets the lowest free slot and that slot's next generation (a per-slot
	// counter that only grows, kept when the slot is freed). The same name
	// with the same Identity keeps its slot and generation and updates its
	// address, backends, capacity and LastSeen. The same name with another
	// Identity is refused (errdefs.ErrAlreadyExists) while the registered
	// node was seen within liveWindow; after that it takes the slot over with
	// the next generation. The registration happens at n.LastSeen, or now
	// when that is zero; n's Slot, Generation and Registered are ignored.
	RegisterNode(ctx context.Context, n Node, liveWindow time.Duration) (Node, error)
	// Heartbeat records that the node was seen at at. It is
	// errdefs.ErrNotFound for an unknown node and
	// errdefs.ErrFailedPrecondition when generation is not the node's current
	// one (its slot was taken over). LastSeen never moves backwards.
	Heartbeat(ctx context.Context, name string, generation int64, at time.Time) error
	// Nodes lists the registered nodes by slot.
	Nodes(ctx context.Context) ([]Node, error)
	// NodeBySlot returns the node holding slot, or errdefs.ErrNotFound.
	NodeBySlot(ctx context.Context, slot int) (Node, error)
	// RemoveNode forgets a node and frees its slot; the slot's generation
	// counter is kept. An unknown name is errdefs.ErrNotFound.
	RemoveNode(ctx context.Context, name string) error

	// Projects, principals, role bindings, tokens (iam.go), quotas
	// (quota.go) and the audit trail (audit.go).
	IAM
	// Which project each layer, image, snapshot and warm pool belongs to,
	// and its shares (objects.go).
	Objects
	// Sandbox lifecycle events (events.go), which apiserver pulls each
	// node's (eventpulls.go) and the webhooks they are delivered to
	// (webhooks.go).
	Events
	EventPulls
	Webhooks
	// The cost ledger (usage.go).
	Ledger
	// The web console's sessions (consolesessions.go).
	ConsoleSessions

	// Close releases the store's connections.
	Close() error
}

// Idempotency is the outcome recorded for one idempotency key.
type Idempotency struct {
	Key         string
	RequestHash string
	IDs         []string
	Created     time.Time
}

// Reservation states.
const (
	StatePending = "pending" // reserved, batch being made
	StateDone    = "done"    // batch made, IDs recorded
)

// CreateReservation is a create in flight (or done) under an idempotency key.
type CreateReservation struct {
	Key         string
	RequestHash string
	// Owner names the apiserver replica that reserved the key.
	Owner string
	// Placements is the node chosen for each sandbox index of the batch.
	Placements []string
	State      string // StatePending or StateDone
	IDs        []string
	// Nonce is random, chosen by the store when the key is reserved: it
	// names this reservation, and no other of the same key, in the create
	// tokens of its sandboxes (package apiserver). Reservations made before
	// nonces existed have "".
	Nonce   string
	Created time.Time
	// Updated is when the reservation last changed or was touched
	// (TouchCreate): the lease its creates hold.
	Updated time.Time
	// Charge, when set, is charged in the transaction that reserves the
	// key, and only if it does (a repeat of a reserved key charges
	// nothing); its Held part is held under ReservationHold(Key, Nonce)
	// until the create settles (Settle). A refusal reserves nothing and is
	// the charge's errdefs.ErrResourceExhausted. It is not stored.
	Charge *QuotaCharge
}

// Doubt is a create an apiserver sent to a node without learning whether
// it made a sandbox (the call timed out, the connection dropped, the caller
// gave up), or a batch whose reservation was abandoned: the node may hold a
// sandbox nobody was told of. An apiserver settles it once the node answers
// (the node reaps the sandboxes the token names, but never one the key's
// completed create recorded), then clears it.
type Doubt struct {
	Node string
	// Token is the create token, or with Prefix a prefix of the tokens of
	// every create of one batch.
	Token  string
	Prefix bool
	// Key is the idempotency key of the create, "" for none.
	Key     string
	Created time.Time
}

// SandboxRow is the store's record of one sandbox a create made.
type SandboxRow struct {
	ID   string
	Node string
	// Key is the idempotency key of the create that made it; CompleteCreate
	// fills it in when empty.
	Key     string
	Created time.Time
}

// Node is one edge in the registry.
type Node struct {
	Name string
	// Slot (1..65535) and Generation are what a sandbox ID made on the node
	// encodes; a slot's generation grows each time the slot changes hands.
	Slot         int
	Generation   int64
	Addr         string
	Backends     []string
	MaxSandboxes int
	CPUs         float64
	MemoryMB     int64
	// Identity is the fingerprint of the TLS certificate the node registered
	// with.
	Identity   string
	Registered time.Time
	LastSeen   time.Time
}

// MaxSlot is the highest node slot.
const MaxSlot = 65535

// Open opens the store named by dsn, creating and migrating its schema:
//
//	/path/to/meta.db, sqlite:/path/to/meta.db    SQLite file
//	postgres://… or postgresql://…               PostgreSQL URL
//	host=… dbname=… (libpq keywords)            PostgreSQL
//
// PostgreSQL DSNs take pgx's options too (pool_max_conns=N).
func Open(ctx context.Context, dsn string) (Store, error) {
	kind, target, err := parseDSN(dsn)
	if err != nil {
		return nil, err
	}
	if kind == dialectPostgres {
		return openPostgres(ctx, target)
	}
	return openSQLite(ctx, target)
}

const (
	dialectSQLite   = "sqlite"
	dialectPostgres = "postgres"
)

// parseDSN says which backend dsn names and what to hand it.
func parseDSN(dsn string) (dialect, target string, err error) {
	switch {
	case strings.TrimSpace(dsn) == "":
		return "", "", fmt.Errorf("open metadata store: empty DSN: %w", errdefs.ErrInvalidArgument)
	case strings.HasPrefix(dsn, "postgres://"), strings.HasPrefix(dsn, "postgresql://"):
		return dialectPostgres, dsn, nil
	case strings.HasPrefix(dsn, "sqlite:"):
		path := strings.TrimPrefix(dsn, "sqlite:")
		if path == "" {
			return "", "", fmt.Errorf("open metadata store %q: no file path: %w", dsn, errdefs.ErrInvalidArgument)
		}
		return dialectSQLite, path, nil
	case isKeywordDSN(dsn):
		return dialectPostgres, dsn, nil
	}
	return dialectSQLite, dsn, nil
}

// isKeywordDSN reports whether s reads as a libpq keyword/value string
// naming a host ("host=/run/pg dbname=dsec").
func isKeywordDSN(s string) bool {
	for _, f := range strings.Fields(s) {
		if strings.HasPrefix(f, "host=") {
			return true
		}
	}
	return false
}

// tokenPrefix starts every API token, so a leaked one is easy to recognise.
const tokenPrefix = "dsec_"

// tokenBytes is how much randomness a token carries.
const tokenBytes = 32

// newToken returns a fresh API token and its SHA-256.
func newToken() (string, []byte) {
	b := make([]byte, tokenBytes)
	rand.Read(b) // never returns an error (crypto/rand)
	tok := tokenPrefix + base64.RawURLEncoding.EncodeToString(b)
	return tok, hashToken(tok)
}

func hashToken(tok string) []byte {
	sum := sha256.Sum256([]byte(tok))
	return sum[:]
}

// wellFormedToken reports whether tok can be a token newToken made; others
// are refused before a database look-up.
func wellFormedToken(tok string) bool {
	rest, ok := strings.CutPrefix(tok, tokenPrefix)
	if !ok || len(rest) != base64.RawURLEncoding.EncodedLen(tokenBytes) {
		return false
	}
	_, err := base64.RawURLEncoding.DecodeString(rest)
	return err == nil
}

// newNonce returns a reservation's nonce: 16 random hex digits.
func newNonce() string { return newID("") }

// checkDoubts refuses doubts that name no node or token, and fills in
// their creation time.
func checkDoubts(doubts []Doubt) ([]Doubt, error) {
	out := make([]Doubt, len(doubts))
	now := ms(time.Now())
	for i, d := range doubts {
		if d.Node == "" || d.Token == "" {
			return nil, fmt.Errorf("record doubt %d: a node and a token are required: %w", i, errdefs.ErrInvalidArgument)
		}
		if d.Created.IsZero() {
			d.Created = now
		}
		d.Created = ms(d.Created)
		out[i] = d
	}
	return out, nil
}

// newID returns prefix followed by 16 random hex digits.
func newID(prefix string) string {
	b := make([]byte, 8)
	rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

func nilIfEmpty(l []string) []string {
	if len(l) == 0 {
		return nil
	}
	return l
}

// ms truncates t to the store's precision; the zero time stays zero.
func ms(t time.Time) time.Time {
	if t.IsZero() {
		return t
	}
	return time.UnixMilli(t.UnixMilli())
}

// nowOr is t, or now when t is zero, to the store's precision.
func nowOr(t time.Time) time.Time {
	if t.IsZero() {
		t = time.Now()
	}
	return ms(t)
}

// newReservation checks r and fills in what ReserveCreate sets.
func newReservation(r CreateReservation) (CreateReservation, error) {
	if r.Key == "" {
		return CreateReservation{}, fmt.Errorf("reserve create: empty idempotency key: %w", errdefs.ErrInvalidArgument)
	}
	r.State, r.IDs, r.Nonce = StatePending, nil, newNonce()
	r.Placements = nilIfEmpty(r.Placements)
	r.Created = nowOr(r.Created)
	r.Updated = r.Created
	return r, nil
}

func differentRequest(key string) error {
	return fmt.Errorf("idempotency key %q was used for a different request: %w", key, errdefs.ErrInvalidArgument)
}

// completeRows checks sbs for CompleteCreate and fills in their key and
// creation time.
func completeRows(key string, sbs []SandboxRow) ([]SandboxRow, []string, error) {
	if key == "" {
		return nil, nil, fmt.Errorf("complete create: empty idempotency key: %w", errdefs.ErrInvalidArgument)
	}
	out := make([]SandboxRow, len(sbs))
	ids := make([]string, len(sbs))
	now := ms(time.Now())
	for i, sb := range sbs {
		if sb.ID == "" {
			return nil, nil, fmt.Errorf("complete create %q: sandbox %d has no ID: %w", key, i, errdefs.ErrInvalidArgument)
		}
		if sb.Key != "" && sb.Key != key {
			return nil, nil, fmt.Errorf("complete create %q: sandbox %s carries idempotency key %q: %w", key, sb.ID, sb.Key, errdefs.ErrInvalidArgument)
		}
		sb.Key = key
		if sb.Created.IsZero() {
			sb.Created = now
		}
		sb.Created = ms(sb.Created)
		out[i], ids[i] = sb, sb.ID
	}
	return out, ids, nil
}

func reservedAgain() error {
	return fmt.Errorf("the key was reserved again by another create since: %w", errdefs.ErrNotFound)
}

func noPendingReservation(key string) error {
	return fmt.Errorf("reservation %q: no such pending reservation: %w", key, errdefs.ErrNotFound)
}

func otherIDs(key string) error {
	return fmt.Errorf("complete create %q: the key is already done with other sandboxes: %w", key, errdefs.ErrAlreadyExists)
}

func checkNode(n Node, liveWindow time.Duration) error {
	switch {
	case n.Name == "":
		return fmt.Errorf("register node: empty name: %w", errdefs.ErrInvalidArgument)
	case n.Identity == "":
		return fmt.Errorf("register node %s: empty identity: %w", n.Name, errdefs.ErrInvalidArgument)
	case liveWindow < 0:
		return fmt.Errorf("register node %s: negative live window %s: %w", n.Name, liveWindow, errdefs.ErrInvalidArgument)
	case n.MaxSandboxes < 0 || n.CPUs < 0 || n.MemoryMB < 0:
		return fmt.Errorf("register node %s: negative capacity: %w", n.Name, errdefs.ErrInvalidArgument)
	}
	return nil
}

func identityConflict(name string, seen time.Time, at time.Time) error {
	return fmt.Errorf("register node %s: the name is held by an edge with another identity, seen %s ago: %w",
		name, at.Sub(seen).Round(time.Millisecond), errdefs.ErrAlreadyExists)
}

func staleGeneration(name string, have, current int64) error {
	return fmt.Errorf("heartbeat from node %s: generation %d is not current (%d): its slot was taken over: %w",
		name, have, current, errdefs.ErrFailedPrecondition)
}

func slotsFull() error {
	return fmt.Errorf("register node: all %d node slots are taken: %w", MaxSlot, errdefs.ErrResourceExhausted)
}

func expiresAt(created time.Time, ttl time.Duration) time.Time {
	if ttl == 0 {
		return time.Time{}
	}
	return ms(created.Add(ttl))
}

// tokenValid reports whether a token row found by its hash may be used now.
func tokenValid(stored, want []byte, expires, revoked time.Time, now time.Time) bool {
	if subtle.ConstantTimeCompare(stored, want) != 1 {
		return false
	}
	if !revoked.IsZero() {
		return false
	}
	return expires.IsZero() || now.Before(expires)
}

// checkPrincipalName refuses names that cannot be displayed or typed.
func checkPrincipalName(name string) error {
	if name == "" || strings.TrimSpace(name) != name || strings.ContainsFunc(name, func(r rune) bool { return r < ' ' }) {
		return fmt.Errorf("create principal %q: a name is non-empty printable text without surrounding spaces: %w", name, errdefs.ErrInvalidArgument)
	}
	return nil
}
