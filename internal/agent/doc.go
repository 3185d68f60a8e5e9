// Package agent is dsec-agent, the process that is pid 1 of every container
// sandbox. It serves the agent protocol (agentv1connect.AgentServiceHandler)
// with Connect over cleartext HTTP/2 on a listening Unix socket inherited
// from the edge, and runs commands (package proc), shell sessions (package
// session) and file operations (package fs) inside the sandbox.
//
// The agent binary has three modes: serve (the server), child (the re-exec
// that puts a command into its cgroup before executing it) and state-dump
// (run by session shells to report their directory and environment).
package agent
