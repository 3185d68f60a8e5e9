// Package session owns the agent's named shell sessions. A session keeps a
// working directory and an exported environment: each command runs under
// the session's shell (`shell -c`), and an EXIT trap then runs the agent's
// state-dump mode, which writes the shell's final directory and environment
// to an extra fd, so `cd` and `export` carry into the next command of the
// session. One command runs at a time per session.
package session
