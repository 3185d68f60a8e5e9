// Command netprobe is the network tests' tool: a static binary copied into
// sandboxes to probe what they can reach, and run in the tests' own network
// namespaces as the hosts they try to reach.
//
//	netprobe get URL             print the body of an HTTP(S) GET (TLS not verified)
//	netprobe connect HOST:PORT   exit 0 if a TCP connection opens within 2 s
//	netprobe scan HOST PORTS...  print the open ports among PORTS (a-b ranges allowed)
//	netprobe resolve NAME        print the IPv4 addresses of NAME
//	netprobe resolve-tcp NAME    the same, asking the nameserver over TCP only
//	netprobe post URL BYTES      POST BYTES zero bytes; print "BYTES SECONDS", the upload's time to the server's answer
//	netprobe hold HOST:PORT      connect, print "connected", then report when the peer cuts
//	netprobe serve NAME          serve HTTP on :80 and HTTPS on :443 answering NAME
//	netprobe self NAME           listen on loopback, then dial NAME at that port (does NAME reach this host?)
package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: netprobe get|connect|scan|resolve|resolve-tcp|post|hold|serve|self ARG...")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "get":
		err = get(os.Args[2])
	case "connect":
		var c net.Conn
		c, err = net.DialTimeout("tcp", os.Args[2], 2*time.Second)
		if err == nil {
			c.Close()
		}
	case "scan":
		err = scan(os.Args[2], os.Args[3:])
	case "resolve":
		var addrs []string
		addrs, err = net.DefaultResolver.LookupHost(context.Background(), os.Args[2])
		if err == nil {
			fmt.Println(strings.Join(addrs, " "))
		}
	case "resolve-tcp":
		var addrs []string
		addrs, err = tcpResolver().LookupHost(context.Background(), os.Args[2])
		if err == nil {
			fmt.Println(strings.Join(addrs, " "))
		}
	case "post":
		err = post(os.Args[2], os.Args[3:])
	case "hold":
		err = hold(os.Args[2])
	case "serve":
		err = serve(os.Args[2])
	case "self":
		err = self(os.Args[2])
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "netprobe:", err)
		os.Exit(1)
	}
}

// self listens on both loopback addresses at one port and dials name there,
// as a test suite that serves on localhost and connects to it does.
func self(name string) error {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	defer ln.Close()
	port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	if ln6, err := net.Listen("tcp", "[::1]:"+port); err == nil {
		defer ln6.Close()
		go accept(ln6)
	}
	go accept(ln)
	c, err := net.DialTimeout("tcp", net.JoinHostPort(name, port), 2*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	fmt.Println("connected to", c.RemoteAddr())
	return nil
}

func accept(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		c.Close()
	}
}

func get(url string) error {
	c := &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{InsecureSkipVerify: true},
		Proxy:           nil,
	}}
	resp, err := c.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, err = io.Copy(os.Stdout, resp.Body)
	return err
}

// tcpResolver is Go's resolver with every query to the nameserver of
// resolv.conf sent over TCP.
func tcpResolver() *net.Resolver {
	return &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, addr string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", addr)
	}}
}

// post uploads args[0] zero bytes to url and prints the byte count and the
// seconds from the first byte sent to the server's answer, which it sends
// once it has read them all.
func post(url string, args []string) error {
	if len(args) != 1 {
		return fmt.Errorf("post URL BYTES")
	}
	n, err := strconv.ParseInt(args[0], 10, 64)
	if err != nil {
		return err
	}
	c := &http.Client{Timeout: time.Minute, Transport: &http.Transport{Proxy: nil}}
	t0 := time.Now()
	resp, err := c.Post(url, "application/octet-stream", io.LimitReader(zeros{}, n))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if want := fmt.Sprintf("received %d\n", n); string(body) != want {
		return fmt.Errorf("the server answered %q, want %q", body, want)
	}
	fmt.Printf("%d %.3f\n", n, time.Since(t0).Seconds())
	return nil
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

func scan(host string, specs []string) error {
	var ports []int
	for _, s := range specs {
		lo, hi, isRange := strings.Cut(s, "-")
		a, err := strconv.Atoi(lo)
		if err != nil {
			return err
		}
		b := a
		if isRange {
			if b, err = strconv.Atoi(hi); err != nil {
				return err
			}
		}
		for p := a; p <= b; p++ {
			ports = append(ports, p)
		}
	}
	var mu sync.Mutex
	var open []string
	sem := make(chan struct{}, 256)
	var wg sync.WaitGroup
	for _, p := range ports {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			c, err := net.DialTimeout("tcp", net.JoinHostPort(host, strconv.Itoa(p)), time.Second)
			if err == nil {
				c.Close()
				mu.Lock()
				open = append(open, strconv.Itoa(p))
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	fmt.Println(strings.Join(open, " "))
	return nil
}

func hold(addr string) error {
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	fmt.Println("connected")
	buf := make([]byte, 1)
	for {
		if _, err := c.Write([]byte("x")); err != nil {
			fmt.Println("cut:", err)
			return nil
		}
		c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
		if _, err := c.Read(buf); err != nil && !isTimeout(err) {
			fmt.Println("cut:", err)
			return nil
		}
	}
}

func isTimeout(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout()
}

func serve(name string) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		DNSNames: []string{name}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return err
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			// The post command's sink: the count once all is read.
			n, _ := io.Copy(io.Discard, r.Body)
			fmt.Fprintf(w, "received %d\n", n)
			return
		}
		fmt.Fprintf(w, "hello from %s\n", name)
	})
	errc := make(chan error, 3)
	go func() { errc <- http.ListenAndServe(":80", h) }()
	go func() {
		srv := &http.Server{Addr: ":443", Handler: h, TLSConfig: &tls.Config{
			Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}}}
		errc <- srv.ListenAndServeTLS("", "")
	}()
	go func() {
		// An echo port: the hold command writes bytes and reads them back.
		ln, err := net.Listen("tcp", ":7")
		if err != nil {
			errc <- err
			return
		}
		for {
			c, err := ln.Accept()
			if err != nil {
				errc <- err
				return
			}
			go func() { io.Copy(c, c); c.Close() }()
		}
	}()
	return <-errc
}
