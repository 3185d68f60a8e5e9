// Package memconn is a net.Listener inside the process: an http.Server
// serving on it and an http.Client dialing it talk through in-memory pipes,
// with no socket, port or file for anyone else to reach. The compatibility
// adapters (E2B) call the apiserver's own Connect handlers through one, so
// they go through the same code path, interceptors and streams as any
// client, without a network hop.
package memconn

import (
	"context"
	"errors"
	"net"
	"sync"
)

// Listener is an in-process listener. The zero value is not usable: call
// New.
type Listener struct {
	conns  chan net.Conn
	closed chan struct{}
	once   sync.Once
}

// New returns an open listener.
func New() *Listener {
	return &Listener{conns: make(chan net.Conn), closed: make(chan struct{})}
}

// Addr is the listener's address, of network "memconn".
type Addr struct{}

func (Addr) Network() string { return "memconn" }
func (Addr) String() string  { return "in-process" }

// PeerHeader names, on a call over an in-process connection, the address
// of the client an adapter (E2B's API) makes the call for, so the audit
// trail says where the call came from. A server believes it on in-process
// calls only: anyone may send the header over a socket.
const PeerHeader = "Dsec-Adapter-Peer"

// Conn is one side of an in-process connection. InProcess tells a server's
// ConnContext that the peer is this process.
type Conn struct{ net.Conn }

// InProcess reports true: the other side is code of this process.
func (Conn) InProcess() bool { return true }

func (Conn) LocalAddr() net.Addr  { return Addr{} }
func (Conn) RemoteAddr() net.Addr { return Addr{} }

// ErrClosed is what Accept and Dial return once the listener is closed.
var ErrClosed = errors.New("memconn: listener closed")

// Accept waits for the next Dial.
func (l *Listener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.closed:
		return nil, net.ErrClosed
	}
}

// Close stops Accept and Dial; connections already made stay open.
func (l *Listener) Close() error {
	l.once.Do(func() { close(l.closed) })
	return nil
}

// Addr returns the listener's address.
func (l *Listener) Addr() net.Addr { return Addr{} }

// Dial connects to the listener; its signature fits http.Transport's
// DialContext (network and address are ignored).
func (l *Listener) Dial(ctx context.Context, _, _ string) (net.Conn, error) {
	client, server := net.Pipe()
	select {
	case l.conns <- Conn{server}:
		return Conn{client}, nil
	case <-l.closed:
		client.Close()
		server.Close()
		return nil, ErrClosed
	case <-ctx.Done():
		client.Close()
		server.Close()
		return nil, ctx.Err()
	}
}
