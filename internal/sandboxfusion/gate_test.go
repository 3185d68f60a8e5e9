package sandboxfusion

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// blocking is a runner whose calls wait until released.
type blocking struct {
	started chan struct{}
	release chan struct{}
}

func (b *blocking) RunCode(ctx context.Context, _ *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
	b.started <- struct{}{}
	select {
	case <-b.release:
		return success("ok\n"), nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// TestOverload: with 2 calls in flight and 1 queued, the 4th is answered
// 504 at once (while the others still run); a queued call whose client
// goes away leaves the queue, so the next call queues instead of 504.
func TestOverload(t *testing.T) {
	b := &blocking{started: make(chan struct{}, 8), release: make(chan struct{})}
	hh := NewHandler(b, Config{MaxInFlight: 2, MaxQueue: 1})
	h := hh.(*handler)
	body := `{"code": "x", "language": "python"}`

	type answer struct {
		code int
		body string
	}
	var wg sync.WaitGroup
	answers := make(chan answer, 8)
	start := func(ctx context.Context) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req := httptest.NewRequestWithContext(ctx, http.MethodPost, "/run_code", strings.NewReader(body))
			w := httptest.NewRecorder()
			hh.ServeHTTP(w, req)
			answers <- answer{w.Code, w.Body.String()}
		}()
	}
	start(context.Background())
	start(context.Background())
	<-b.started
	<-b.started

	waiterCtx, cancelWaiter := context.WithCancel(context.Background())
	start(waiterCtx)
	testutil.WaitFor(t, 10*time.Second, "the 3rd call to queue", func() bool { return h.gate.waiting.Load() == 1 })

	// The 4th: 504 without waiting for anything.
	code, m, raw := post(t, hh, "/run_code", body)
	if code != http.StatusGatewayTimeout || m["detail"] == nil {
		t.Fatalf("4th call: %d %s, want 504", code, raw)
	}

	// The queued client goes away: it leaves the queue, unanswered.
	cancelWaiter()
	testutil.WaitFor(t, 10*time.Second, "the cancelled waiter to leave", func() bool { return h.gate.waiting.Load() == 0 })
	if a := <-answers; a.body != "" {
		t.Errorf("the cancelled waiter was answered: %d %q", a.code, a.body)
	}

	// So the next call queues again rather than getting 504.
	start(context.Background())
	testutil.WaitFor(t, 10*time.Second, "the 5th call to queue", func() bool { return h.gate.waiting.Load() == 1 })

	close(b.release) // every call finishes; the queued one runs
	wg.Wait()
	close(answers)
	n := 0
	for a := range answers {
		if a.code != http.StatusOK || !strings.Contains(a.body, `"status":"Success"`) {
			t.Errorf("call answered %d %s", a.code, a.body)
		}
		n++
	}
	if n != 3 {
		t.Errorf("%d calls answered 200, want 3", n)
	}
	if h.gate.waiting.Load() != 0 || len(h.gate.slots) != 0 {
		t.Errorf("gate not empty after: %d waiting, %d running", h.gate.waiting.Load(), len(h.gate.slots))
	}
}
