// Package agent is dsec-agent, the process that is pid 1 of every container
// sandbox. It serves the agent protocol (agentv1connect.AgentServiceHandler)
// with Connect on a listening Unix socket inherited from the edge, and exec
// also in the framed form of package execwire on the same socket. It runs
// commands (package proc), shell sessions (package session) and file
// operations (package fs) inside the sandbox, and, where the edge passes
// the sandbox's btrfs qgroup, answers statfs of the sandbox's root with its
// disk limit (package diskfree).
//
// The agent binary's modes: serve (the server), guest (the server as a
// microVM's init, package agent/guest; ServeListener serves its port's
// streams) and state-dump (run by session shells to report their directory
// and environment).
package agent
