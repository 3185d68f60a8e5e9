package iam

import "context"

type authorityKey struct{}

// WithAuthority returns ctx carrying a, the authority of the call it
// belongs to (set by the apiserver once it has authenticated the caller).
func WithAuthority(ctx context.Context, a Authority) context.Context {
	return context.WithValue(ctx, authorityKey{}, a)
}

// AuthorityFrom is the authority WithAuthority put in ctx.
func AuthorityFrom(ctx context.Context) (Authority, bool) {
	a, ok := ctx.Value(authorityKey{}).(Authority)
	return a, ok
}

// ProjectLabel is the label holding the path of the project a sandbox
// belongs to (absent: the root). The apiserver sets it on every create it
// sends to an edge; it is the one label of the reserved dsec.dev/ prefix
// an edge takes from a create.
const ProjectLabel = "dsec.dev/project"
