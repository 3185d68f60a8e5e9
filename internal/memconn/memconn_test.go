package memconn

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// serveHTTP serves h on ln until the test ends and returns a client of it
// speaking cleartext HTTP/2, as dsecd's in-process client does.
func serveHTTP(t testing.TB, ln net.Listener, dial func(ctx context.Context, network, addr string) (net.Conn, error), h http.Handler) *http.Client {
	srv := &http.Server{Handler: h, Protocols: new(http.Protocols)}
	srv.Protocols.SetUnencryptedHTTP2(true)
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	tr := &http.Transport{DialContext: dial, Protocols: new(http.Protocols)}
	tr.Protocols.SetUnencryptedHTTP2(true)
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

func echo(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	w.Write(b)
}

func TestHTTPOverMemconn(t *testing.T) {
	ln := New()
	var inProcess bool
	h := http.HandlerFunc(echo)
	srv := &http.Server{Handler: h, Protocols: new(http.Protocols),
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			ip, ok := c.(interface{ InProcess() bool })
			inProcess = ok && ip.InProcess()
			return ctx
		}}
	srv.Protocols.SetUnencryptedHTTP2(true)
	go srv.Serve(ln)
	defer srv.Close()
	tr := &http.Transport{DialContext: ln.Dial, Protocols: new(http.Protocols)}
	tr.Protocols.SetUnencryptedHTTP2(true)
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr}
	for i := range 3 {
		resp, err := c.Post("http://in-process/", "text/plain", strings.NewReader("hello"))
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(b) != "hello" || resp.ProtoMajor != 2 {
			t.Fatalf("request %d: %q over HTTP/%d", i, b, resp.ProtoMajor)
		}
	}
	if !inProcess {
		t.Error("the server's ConnContext did not see an in-process connection")
	}
}

func TestCloseStopsAcceptAndDial(t *testing.T) {
	ln := New()
	accepted := make(chan error, 1)
	go func() {
		_, err := ln.Accept()
		accepted <- err
	}()
	ln.Close()
	ln.Close() // twice is fine
	select {
	case err := <-accepted:
		if !errors.Is(err, net.ErrClosed) {
			t.Errorf("Accept after Close: %v, want net.ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Accept did not return after Close")
	}
	if _, err := ln.Dial(context.Background(), "", ""); !errors.Is(err, ErrClosed) {
		t.Errorf("Dial after Close: %v, want ErrClosed", err)
	}
}

func TestDialHonoursContext(t *testing.T) {
	ln := New() // nobody accepts
	defer ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := ln.Dial(ctx, "", ""); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Dial without an Accept: %v, want the context's deadline", err)
	}
}

// BenchmarkRoundTrip compares one small HTTP/2 request over an in-process
// connection with the same over a Unix socket, the apiserver's local way.
func BenchmarkRoundTrip(b *testing.B) {
	run := func(b *testing.B, c *http.Client) {
		for b.Loop() {
			resp, err := c.Post("http://x/", "text/plain", strings.NewReader("ping"))
			if err != nil {
				b.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}
	b.Run("memconn", func(b *testing.B) {
		ln := New()
		run(b, serveHTTP(b, ln, ln.Dial, http.HandlerFunc(echo)))
	})
	b.Run("unix", func(b *testing.B) {
		path := filepath.Join(b.TempDir(), "s")
		ln, err := net.Listen("unix", path)
		if err != nil {
			b.Fatal(err)
		}
		var d net.Dialer
		dial := func(ctx context.Context, _, _ string) (net.Conn, error) { return d.DialContext(ctx, "unix", path) }
		run(b, serveHTTP(b, ln, dial, http.HandlerFunc(echo)))
	})
}
