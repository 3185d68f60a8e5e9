package store

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// Webhooks are endpoints projects registered for their events, and how
// far the apiservers delivered to each. One apiserver at a time delivers a
// webhook's events: the one holding its lease (ClaimWebhooks), which only
// it can advance (AdvanceWebhook), so two apiservers do not both deliver
// it, and one started again resumes after the last event acknowledged.
type Webhooks interface {
	// AddWebhook records w (ID, Project, URL, Kinds, Secret, Batch; Created set
	// by the store when zero); its deliveries start after the event ID
	// w.Delivered (the stream's end when it was added). An ID taken is
	// errdefs.ErrAlreadyExists.
	AddWebhook(ctx context.Context, w Webhook) error
	// ListWebhooks lists the webhooks of the projects (each with those
	// under it; none, or the root, is all), by ID.
	ListWebhooks(ctx context.Context, projects []string) ([]Webhook, error)
	// RemoveWebhook removes webhook id of project (or of a project under
	// it); another's, or an unknown one, is errdefs.ErrNotFound.
	RemoveWebhook(ctx context.Context, project, id string) error
	// ClaimWebhooks takes the lease of every webhook whose lease is free
	// or lapsed (or owner's own: renewed) until until, and returns them.
	ClaimWebhooks(ctx context.Context, owner string, now, until time.Time) ([]Webhook, error)
	// AdvanceWebhook records a delivery attempt of webhook id by owner:
	// acknowledged (err nil: Delivered becomes delivered, the last success
	// now) or failed (the last failure now with err's words, the failures
	// in a row counted). It returns errdefs.ErrFailedPrecondition when
	// owner no longer holds the lease (the webhook is another's, or gone).
	AdvanceWebhook(ctx context.Context, id, owner string, delivered int64, at time.Time, failure error) error
	// RotateWebhookSecret gives webhook id of project (or of a project
	// under it) secret; the secret it had signs beside it until
	// previousUntil (zero or past: retired at once). Another's webhook,
	// or an unknown one, is errdefs.ErrNotFound.
	RotateWebhookSecret(ctx context.Context, project, id, secret string, previousUntil time.Time) error
	// UpdateWebhook changes what u sets of webhook id of project (or of a
	// project under it) and returns it as it now is; its cursor, secret,
	// lease and history stay. Another's webhook, or an unknown one, is
	// errdefs.ErrNotFound.
	UpdateWebhook(ctx context.Context, project, id string, u WebhookUpdate) (Webhook, error)
	// ReleaseWebhooks gives up owner's leases (an apiserver stopping), so
	// another apiserver takes them at once rather than when they lapse.
	ReleaseWebhooks(ctx context.Context, owner string) error
}

// Webhook is an endpoint a project registered for its events.
type Webhook struct {
	ID      string
	Project string // path; the webhook gets its events and those of the projects under it
	URL     string
	Kinds   []string // none: every kind
	Secret  string   // signs each delivery (HMAC-SHA256)
	// PrevSecret, after a rotation, signs deliveries beside Secret until
	// PrevUntil.
	PrevSecret string
	PrevUntil  time.Time
	// Batch is the most events one delivery carries, in an envelope; 0:
	// one event a delivery, the event itself as the body (the format
	// before batches, which webhooks added before them keep).
	Batch   int
	Created time.Time
	// Delivered is the ID of the last event acknowledged.
	Delivered int64
	// LeaseOwner holds the lease until LeaseUntil.
	LeaseOwner string
	LeaseUntil time.Time
	// LastOK and LastFailure are the times of the last acknowledged and
	// failed attempts; Failures counts the failures since the last success,
	// LastError says what the last failure was.
	LastOK      time.Time
	LastFailure time.Time
	Failures    int
	LastError   string
}

// WebhookUpdate is what UpdateWebhook changes: each field set (non-nil)
// replaces the webhook's.
type WebhookUpdate struct {
	URL   *string
	Kinds *[]string
	Batch *int
}

const webhookCols = `id, project, url, kinds, secret, created{ms}, delivered, lease_owner, lease{ms}, ok{ms}, failed{ms}, failures, last_error, prev_secret, prev_until{ms}, batch`

func scanWebhook(rows interface{ Scan(...any) error }) (Webhook, error) {
	var w Webhook
	var kinds string
	err := rows.Scan(&w.ID, &w.Project, &w.URL, &kinds, &w.Secret, timeCol{&w.Created}, &w.Delivered, &w.LeaseOwner,
		timeCol{&w.LeaseUntil}, timeCol{&w.LastOK}, timeCol{&w.LastFailure}, &w.Failures, &w.LastError, &w.PrevSecret, timeCol{&w.PrevUntil}, &w.Batch)
	if kinds != "" {
		w.Kinds = strings.Split(kinds, ",")
	}
	return w, err
}

func (d *sqlDB) AddWebhook(ctx context.Context, w Webhook) error {
	path, err := iam.CleanPath(w.Project)
	if err != nil {
		return err
	}
	if w.ID == "" || w.URL == "" || w.Secret == "" {
		return fmt.Errorf("add webhook: id, url and secret are required: %w", errdefs.ErrInvalidArgument)
	}
	err = d.retry(ctx, false, func(ctx context.Context) error {
		_, err := d.db.ExecContext(ctx, d.q(`INSERT INTO webhooks (id, project, url, kinds, secret, created{ms}, delivered, batch)
			VALUES (?, ?, ?, ?, ?, ?, ?, ?)`), w.ID, path, w.URL, strings.Join(w.Kinds, ","), w.Secret, d.ts(nowOr(w.Created)), w.Delivered, w.Batch)
		return err
	})
	if err != nil {
		if d.unique(err) {
			return fmt.Errorf("webhook %s exists already: %w", w.ID, errdefs.ErrAlreadyExists)
		}
		return d.fail("add webhook "+w.ID, err)
	}
	return nil
}

// subtrees is the condition selecting rows whose project column is one of
// paths or under one (none, or the root: every row), and its arguments.
func subtrees(paths []string) (string, []any, error) {
	var conds []string
	var args []any
	for _, p := range paths {
		path, err := iam.CleanPath(p)
		if err != nil {
			return "", nil, err
		}
		if path == "" {
			return "1 = 1", nil, nil
		}
		conds = append(conds, `(project = ? OR (project >= ? AND project < ?))`)
		args = append(args, path, path+"/", path+"0")
	}
	if len(conds) == 0 {
		return "1 = 1", nil, nil
	}
	return "(" + strings.Join(conds, " OR ") + ")", args, nil
}

func (d *sqlDB) ListWebhooks(ctx context.Context, projects []string) ([]Webhook, error) {
	cond, args, err := subtrees(projects)
	if err != nil {
		return nil, err
	}
	var out []Webhook
	err = d.retry(ctx, true, func(ctx context.Context) error {
		out = nil
		rows, err := d.db.QueryContext(ctx, d.q(`SELECT `+webhookCols+` FROM webhooks WHERE `+cond+` ORDER BY id`), args...)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			w, err := scanWebhook(rows)
			if err != nil {
				return err
			}
			out = append(out, w)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, d.fail("list webhooks", err)
	}
	return out, nil
}

func (d *sqlDB) RemoveWebhook(ctx context.Context, project, id string) error {
	cond, args, err := subtrees([]string{project})
	if err != nil {
		return err
	}
	var n int64
	err = d.retry(ctx, true, func(ctx context.Context) error {
		res, err := d.db.ExecContext(ctx, d.q(`DELETE FROM webhooks WHERE id = ? AND `+cond), append([]any{id}, args...)...)
		if err != nil {
			return err
		}
		n, _ = res.RowsAffected()
		return nil
	})
	if err != nil {
		return d.fail("remove webhook "+id, err)
	}
	if n == 0 {
		return noWebhook(project, id)
	}
	return nil
}

func (d *sqlDB) ClaimWebhooks(ctx context.Context, owner string, now, until time.Time) ([]Webhook, error) {
	var out []Webhook
	err := d.inTx(ctx, func(tx *sql.Tx) error {
		out = nil
		_, err := tx.ExecContext(ctx, d.q(`UPDATE webhooks SET lease_owner = ?, lease{ms} = ?
			WHERE lease_owner = ? OR lease{ms} IS NULL OR lease{ms} < ?`), owner, d.ts(until), owner, d.ts(now))
		if err != nil {
			return err
		}
		rows, err := tx.QueryContext(ctx, d.q(`SELECT `+webhookCols+` FROM webhooks WHERE lease_owner = ? ORDER BY id`), owner)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			w, err := scanWebhook(rows)
			if err != nil {
				return err
			}
			out = append(out, w)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, d.fail("claim webhooks", err)
	}
	return out, nil
}

func (d *sqlDB) AdvanceWebhook(ctx context.Context, id, owner string, delivered int64, at time.Time, failure error) error {
	q, args := `UPDATE webhooks SET delivered = ?, ok{ms} = ?, failures = 0, last_error = '' WHERE id = ? AND lease_owner = ?`,
		[]any{delivered, d.ts(nowOr(at)), id, owner}
	if failure != nil {
		q, args = `UPDATE webhooks SET failed{ms} = ?, failures = failures + 1, last_error = ? WHERE id = ? AND lease_owner = ?`,
			[]any{d.ts(nowOr(at)), clip(failure.Error(), 500), id, owner}
	}
	var n int64
	err := d.retry(ctx, true, func(ctx context.Context) error {
		res, err := d.db.ExecContext(ctx, d.q(q), args...)
		if err != nil {
			return err
		}
		n, _ = res.RowsAffected()
		return nil
	})
	if err != nil {
		return d.fail("advance webhook "+id, err)
	}
	if n == 0 {
		return fmt.Errorf("webhook %s: its lease is not %s's: %w", id, owner, errdefs.ErrFailedPrecondition)
	}
	return nil
}

func (d *sqlDB) ReleaseWebhooks(ctx context.Context, owner string) error {
	err := d.retry(ctx, true, func(ctx context.Context) error {
		_, err := d.db.ExecContext(ctx, d.q(`UPDATE webhooks SET lease_owner = '', lease{ms} = NULL WHERE lease_owner = ?`), owner)
		return err
	})
	if err != nil {
		return d.fail("release webhooks", err)
	}
	return nil
}

func (d *sqlDB) RotateWebhookSecret(ctx context.Context, project, id, secret string, previousUntil time.Time) error {
	if secret == "" {
		return fmt.Errorf("rotate webhook %s's secret: no secret: %w", id, errdefs.ErrInvalidArgument)
	}
	cond, args, err := subtrees([]string{project})
	if err != nil {
		return err
	}
	prev, until := "secret", d.ts(previousUntil)
	if previousUntil.IsZero() || !previousUntil.After(time.Now()) {
		prev, until = "''", nil
	}
	var n int64
	err = d.retry(ctx, true, func(ctx context.Context) error {
		res, err := d.db.ExecContext(ctx, d.q(`UPDATE webhooks SET prev_secret = `+prev+`, prev_until{ms} = ?, secret = ? WHERE id = ? AND `+cond),
			append([]any{until, secret, id}, args...)...)
		if err != nil {
			return err
		}
		n, _ = res.RowsAffected()
		return nil
	})
	if err != nil {
		return d.fail("rotate webhook "+id+"'s secret", err)
	}
	if n == 0 {
		return noWebhook(project, id)
	}
	return nil
}

func (d *sqlDB) UpdateWebhook(ctx context.Context, project, id string, u WebhookUpdate) (Webhook, error) {
	cond, args, err := subtrees([]string{project})
	if err != nil {
		return Webhook{}, err
	}
	var sets []string
	var vals []any
	if u.URL != nil {
		if *u.URL == "" {
			return Webhook{}, fmt.Errorf("update webhook %s: an empty url: %w", id, errdefs.ErrInvalidArgument)
		}
		sets, vals = append(sets, "url = ?"), append(vals, *u.URL)
	}
	if u.Kinds != nil {
		sets, vals = append(sets, "kinds = ?"), append(vals, strings.Join(*u.Kinds, ","))
	}
	if u.Batch != nil {
		if *u.Batch < 0 {
			return Webhook{}, fmt.Errorf("update webhook %s: a batch of %d: %w", id, *u.Batch, errdefs.ErrInvalidArgument)
		}
		sets, vals = append(sets, "batch = ?"), append(vals, *u.Batch)
	}
	var w Webhook
	found := false
	err = d.inTx(ctx, func(tx *sql.Tx) error {
		found = false
		if len(sets) > 0 {
			if _, err := tx.ExecContext(ctx, d.q(`UPDATE webhooks SET `+strings.Join(sets, ", ")+` WHERE id = ? AND `+cond),
				append(append(vals, id), args...)...); err != nil {
				return err
			}
		}
		rows, err := tx.QueryContext(ctx, d.q(`SELECT `+webhookCols+` FROM webhooks WHERE id = ? AND `+cond), append([]any{id}, args...)...)
		if err != nil {
			return err
		}
		defer rows.Close()
		if rows.Next() {
			if w, err = scanWebhook(rows); err != nil {
				return err
			}
			found = true
		}
		return rows.Err()
	})
	if err != nil {
		return Webhook{}, d.fail("update webhook "+id, err)
	}
	if !found {
		return Webhook{}, noWebhook(project, id)
	}
	return w, nil
}

// noWebhook is the refusal of a call naming a webhook the project and
// those under it do not hold.
func noWebhook(project, id string) error {
	if project == "" {
		project = "/"
	}
	return fmt.Errorf("no webhook %s in project %s or under it: %w", id, project, errdefs.ErrNotFound)
}
