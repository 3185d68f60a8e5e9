package flushhold

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

// TestHold checks that messages before Hold reach the reader at once and
// the ones after it only with the end of the response.
func TestHold(t *testing.T) {
	release := make(chan struct{})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "first\n")
		w.(http.Flusher).Flush()
		Hold(r.Context())
		io.WriteString(w, "last\n")
		w.(http.Flusher).Flush()
		<-release
	}))}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })

	resp, err := http.Get("http://" + ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	if err != nil || line != "first\n" {
		t.Fatalf("first line %q, %v", line, err)
	}
	got := make(chan string, 1)
	go func() {
		rest, _ := io.ReadAll(br)
		got <- string(rest)
	}()
	select {
	case s := <-got:
		t.Fatalf("read %q before the handler returned: the flush after Hold went through", s)
	case <-time.After(200 * time.Millisecond):
	}
	close(release)
	if s := <-got; s != "last\n" {
		t.Fatalf("rest %q, want %q", s, "last\n")
	}
}

func TestHoldOutsideHandler(t *testing.T) {
	Hold(context.Background()) // must not panic
}

func TestUnwrap(t *testing.T) {
	var inner http.ResponseWriter = &recorder{}
	w := &writer{ResponseWriter: inner}
	if w.Unwrap() != inner {
		t.Fatal("Unwrap does not return the wrapped writer")
	}
	w.Flush()
	if inner.(*recorder).flushes != 1 {
		t.Fatal("flush before Hold not passed on")
	}
	w.held.Store(true)
	w.Flush()
	if inner.(*recorder).flushes != 1 {
		t.Fatal("flush after Hold passed on")
	}
}

type recorder struct {
	http.ResponseWriter
	flushes int
}

func (r *recorder) Flush() { r.flushes++ }
