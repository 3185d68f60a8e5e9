package dsec

import (
	"context"
	"fmt"
	"strings"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// Node is a node sandboxes are placed on, with what it offers.
type Node struct {
	Name         string
	Healthy      bool
	Live         int // its sandboxes
	MaxSandboxes int // the most it admits
	// Kinds are the kinds of sandbox it offers.
	Kinds []NodeKind
	// Missing says why it lacks each isolation it lacks, by name
	// ("microvm": "no QEMU (apt-get install qemu-system-x86)").
	Missing map[string]string
	// CoreScheduling says whether its latency sandboxes get a
	// core-scheduling cookie (SMT siblings kept to one sandbox at a time);
	// CoreSchedulingReason why not (docs/qos.md).
	CoreScheduling       bool
	CoreSchedulingReason string
	// LastSeen is when the node last answered the apiserver (zero: not
	// since it started), and UnreachableReason, while it is not Healthy,
	// why its polls fail; Live is then as of LastSeen.
	LastSeen          time.Time
	UnreachableReason string
}

// NodeKind is one kind of sandbox a node offers.
type NodeKind struct {
	Isolation string // IsolationContainer, IsolationGVisor or IsolationMicroVM
	Profile   string // "container" (a sandbox) or "fncall"
	// Accelerator is what runs the kind's kernel where its backend says:
	// kvm or tcg for a microVM, gVisor's platform; "" for containers.
	Accelerator string
}

// Nodes lists the nodes with the isolations each offers (what dsec nodes
// shows).
func (c *Client) Nodes(ctx context.Context) ([]Node, error) {
	var info *dsecv1.ServerInfo
	err := c.unary(ctx, true, func(ctx context.Context) error {
		r, err := c.sb.GetServerInfo(ctx, connect.NewRequest(&dsecv1.GetServerInfoRequest{}))
		if err == nil {
			info = r.Msg
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list nodes: %w", err)
	}
	var out []Node
	for _, n := range info.GetNodes() {
		node := Node{Name: n.GetName(), Healthy: n.GetHealthy(), Live: int(n.GetLive()),
			MaxSandboxes: int(n.GetMaxSandboxes()), Missing: n.GetMissing(),
			CoreScheduling: n.GetCoreScheduling().GetAvailable(), CoreSchedulingReason: n.GetCoreScheduling().GetReason(),
			UnreachableReason: n.GetUnreachableReason()}
		if ms := n.GetLastSeenUnixMs(); ms > 0 {
			node.LastSeen = time.UnixMilli(ms)
		}
		for _, k := range n.GetKinds() {
			node.Kinds = append(node.Kinds, NodeKind{Isolation: enumName(k.GetIsolation().String(), "ISOLATION_", IsolationContainer),
				Profile: enumName(k.GetProfile().String(), "BACKEND_", "container"), Accelerator: k.GetAccelerator()})
		}
		out = append(out, node)
	}
	return out, nil
}

// enumName is an enum value's name without prefix in lower case; def for
// its unspecified value.
func enumName(name, prefix, def string) string {
	s := strings.ToLower(strings.TrimPrefix(name, prefix))
	if s == "unspecified" {
		return def
	}
	return s
}
