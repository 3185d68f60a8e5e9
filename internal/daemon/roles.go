package daemon

import (
	"context"
	"crypto/tls"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	"dsec.dev/dsec/internal/apiserver"
	"dsec.dev/dsec/internal/clustertls"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edge/hollow"
	"dsec.dev/dsec/internal/edge/layers"
	"dsec.dev/dsec/internal/edgeclient"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/watcher"
)

// The cluster's roles. `dsecd edge` is one node: the all-in-one's edge
// (runtimes, layers, network, admission; its sandboxes' truth on local
// disk), serving EdgeService to apiservers over mutual TLS. `dsecd
// apiserver` is stateless: the public API in front of every edge, with the
// metadata store shared by all its replicas.

// DefaultEdgeAddr is where an edge serves EdgeService unless told otherwise.
const DefaultEdgeAddr = "127.0.0.1:8676"

// EdgeConfig is `dsecd edge`'s configuration.
type EdgeConfig struct {
	// Node is the node, as the all-in-one dsecd has it (root, runtime,
	// network, storage, limits). Runtime "fake" makes a hollow edge that
	// starts nothing (package hollow), for control-plane scale tests.
	Node Config
	// Listen is EdgeService's TCP address; default DefaultEdgeAddr.
	Listen string
	// TLS is the edge's certificate (role edge, named for the node), its
	// key, and the cluster's CA bundle; edges accept apiservers only.
	TLS clustertls.Files
	// Hollow shapes a fake-runtime edge.
	Hollow hollow.Config
}

func (c *EdgeConfig) fill() error {
	if c.Listen == "" {
		c.Listen = DefaultEdgeAddr
	}
	if c.Node.Node == "" {
		c.Node.Node = nodeName()
	}
	if c.TLS.Cert == "" || c.TLS.Key == "" || c.TLS.CABundle == "" {
		return fmt.Errorf("edge %s: a certificate, its key and the cluster's CA bundle are required (dsecd init-cluster makes them): %w",
			c.Node.Node, errdefs.ErrInvalidArgument)
	}
	return nil
}

// RunEdge serves one node's EdgeService until ctx ends. Sandboxes keep
// running after it returns, as with the all-in-one dsecd.
func RunEdge(ctx context.Context, cfg EdgeConfig, log *slog.Logger) error {
	if err := cfg.fill(); err != nil {
		return err
	}
	tlsConfig, err := clustertls.ServerConfig(cfg.TLS, clustertls.RoleAPIServer)
	if err != nil {
		return err
	}
	var svc *edgesvc.Service
	if cfg.Node.Runtime == "fake" {
		h := cfg.Hollow
		h.Node = cfg.Node.Node
		svc = edgesvc.New(hollow.New(h), nil, log.With("component", "edgesvc"))
	} else {
		ncfg := cfg.Node
		if err := ncfg.fill(); err != nil {
			return err
		}
		if err := checkAgent(ncfg.AgentPath); err != nil {
			return err
		}
		n, err := open(ctx, ncfg, log)
		if err != nil {
			return err
		}
		defer n.close()
		if err := n.edge.Recover(ctx); err != nil {
			return err
		}
		defer n.edge.Shutdown()
		if n.net != nil {
			defer n.net.Close()
		}
		svc = edgesvc.New(n.edge, layers.NewHandler(n.layers, n.layerInUse), log.With("component", "edgesvc"))
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", cfg.Listen, err)
	}
	mux := http.NewServeMux()
	mux.Handle(svc.Handler())
	log.Info("edge ready", "node", cfg.Node.Node, "listen", ln.Addr().String(), "runtime", cfg.Node.Runtime)
	err = serve(ctx, log, mux, tlsConfig, ln)
	log.Info("edge stopped; sandboxes keep running")
	return err
}

// StaticEdge is an edge an apiserver is told of, rather than one it finds
// in the registry.
type StaticEdge struct {
	Name string
	URL  string // https://HOST:PORT
}

// ParseStaticEdge reads NAME=https://HOST:PORT.
func ParseStaticEdge(s string) (StaticEdge, error) {
	name, url, ok := strings.Cut(s, "=")
	if !ok || name == "" || !strings.HasPrefix(url, "https://") {
		return StaticEdge{}, fmt.Errorf("edge %q: want NAME=https://HOST:PORT: %w", s, errdefs.ErrInvalidArgument)
	}
	return StaticEdge{Name: name, URL: url}, nil
}

// APIServerConfig is `dsecd apiserver`'s configuration.
type APIServerConfig struct {
	Name string // this replica's name, in its certificate and logs
	// Listen is the public API's TCP address; default DefaultAddr. Socket,
	// if set, is a Unix socket it serves too.
	Listen string
	Socket string
	// TLS is the apiserver's certificate (role apiserver), its key and the
	// cluster's CA bundle: it proves the apiserver to the edges, which
	// prove themselves back.
	TLS clustertls.Files
	// Edges are the nodes, when they are listed rather than registered.
	Edges []StaticEdge
	// DB is the metadata store every replica shares: postgres://… (a
	// cluster) or a SQLite file (one replica).
	DB string
	// PollInterval is how often the watcher polls each edge; 0 = its
	// default.
	PollInterval time.Duration
	// Replicas is how many apiservers place onto these edges; default 1.
	Replicas int
}

func (c *APIServerConfig) fill() error {
	if c.Name == "" {
		c.Name = nodeName()
	}
	if c.Listen == "" {
		c.Listen = DefaultAddr
	}
	if c.TLS.Cert == "" || c.TLS.Key == "" || c.TLS.CABundle == "" {
		return fmt.Errorf("apiserver %s: a certificate, its key and the cluster's CA bundle are required (dsecd init-cluster makes them): %w",
			c.Name, errdefs.ErrInvalidArgument)
	}
	if c.DB == "" {
		return fmt.Errorf("apiserver %s: a metadata store is required (--db postgres://… or a SQLite file): %w", c.Name, errdefs.ErrInvalidArgument)
	}
	if len(c.Edges) == 0 {
		return fmt.Errorf("apiserver %s: no edges are named: %w", c.Name, errdefs.ErrInvalidArgument)
	}
	return nil
}

// RunAPIServer serves the public API in front of the cluster's edges until
// ctx ends.
func RunAPIServer(ctx context.Context, cfg APIServerConfig, log *slog.Logger) error {
	if err := cfg.fill(); err != nil {
		return err
	}
	meta, err := store.Open(ctx, cfg.DB)
	if err != nil {
		return err
	}
	defer meta.Close()
	members := make([]watcher.Member, 0, len(cfg.Edges))
	urls := map[string]string{}
	for _, e := range cfg.Edges {
		members = append(members, watcher.Member{Name: e.Name, Addr: e.URL})
		urls[e.Name] = e.URL
	}
	var api *apiserver.Server
	w := watcher.New(watcher.Config{
		Members:  func(context.Context) ([]watcher.Member, error) { return members, nil },
		Dial:     func(m watcher.Member) (watcher.Edge, error) { return dialEdge(cfg.TLS, m) },
		Interval: cfg.PollInterval,
		OnReport: func(node string, _ *edgev1.NodeStatus) { api.Observe(node) },
		Log:      log.With("component", "watcher"),
	})
	api = apiserver.New(apiserver.Config{Replicas: cfg.Replicas}, meta, w, log.With("component", "apiserver"))
	wctx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	w.Poll(ctx) // routable edges from the first call on
	go w.Run(wctx)

	var lns []net.Listener
	if cfg.Socket != "" {
		uln, err := listenUnix(cfg.Socket)
		if err != nil {
			return err
		}
		lns = append(lns, uln)
	}
	tln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		for _, l := range lns {
			l.Close()
		}
		return fmt.Errorf("listen on %s: %w", cfg.Listen, err)
	}
	lns = append(lns, tln)
	log.Info("apiserver ready", "name", cfg.Name, "listen", tln.Addr().String(), "edges", len(members))
	return serve(ctx, log, api.Handler(), nil, lns...)
}

// dialEdge returns the EdgeService client of an edge, over HTTP/2 with the
// apiserver's certificate, checking that the peer is that very node.
func dialEdge(files clustertls.Files, m watcher.Member) (watcher.Edge, error) {
	tc, err := clustertls.ClientConfig(files, clustertls.RoleEdge, m.Name)
	if err != nil {
		return nil, err
	}
	return edgeclient.New(&http.Client{Transport: edgeTransport(tc)}, m.Addr), nil
}

func edgeTransport(tc *tls.Config) *http.Transport {
	tr := &http.Transport{
		TLSClientConfig:     tc,
		ForceAttemptHTTP2:   true,
		MaxIdleConnsPerHost: 16,
		IdleConnTimeout:     90 * time.Second,
		TLSHandshakeTimeout: 5 * time.Second,
	}
	tr.Protocols = new(http.Protocols)
	tr.Protocols.SetHTTP2(true)
	return tr
}
