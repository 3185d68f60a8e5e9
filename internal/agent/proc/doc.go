// Package proc owns the processes the agent starts inside the sandbox: it
// forks them through a re-exec of the agent (so each lands in its own child
// cgroup before it can fork), reaps every child of the agent, captures and
// caps their output, and kills whole process trees.
//
// A Manager is the single owner of wait4 in the agent: nothing else in the
// process may wait for children (os/exec's Wait would race its reaper).
package proc
