// Package e2b answers E2B's wire protocol, so that the official E2B SDKs
// (npm e2b, PyPI e2b, e2b-code-interpreter) drive dsec sandboxes unchanged:
// a user sets E2B_API_URL and E2B_SANDBOX_URL to one dsec address and
// E2B_API_KEY to a dsec token in E2B's form.
//
// One port serves both of E2B's planes. A request with an E2b-Sandbox-Id
// header belongs to the data plane and is routed by it and by
// E2b-Sandbox-Port: 49983 is envd (the process and filesystem Connect
// services, GET /health, GET and POST /files), 49999 the code
// interpreter (POST /execute, /contexts). Every other request is the
// control plane, E2B's REST API (/sandboxes, /v2/sandboxes, /snapshots,
// /templates). Routing by header needs no wildcard DNS.
//
// The package owns the translation only. It calls dsec's public
// SandboxService through a client (in dsecd, an in-process connection to
// the apiserver's own handlers), so E2B's calls take the same path as any
// other client's; it imports no edge package.
//
// Identities: an E2B sandbox ID is the dsec sandbox ID in base32 (E2B's
// IDs are [a-z0-9]+), an E2B API key is a dsec token in hexadecimal behind
// "e2b_" (APIKey, TokenOf), and a sandbox's envd access token is an HMAC of
// its ID under a secret the cluster's apiservers share (Signer), so any
// apiserver checks it without a lookup.
//
// docs/e2b.md lists what is supported and what differs from E2B.
package e2b
