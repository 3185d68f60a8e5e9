// Package proc owns the processes the agent starts inside the sandbox: it
// forks and execs each itself, inside the command's own child cgroup from its
// first instruction (cloned into it on cgroup v2; on v1 the forking thread
// joins it, forks and returns), reaps every child of the agent, captures and
// caps their output, and kills whole process trees.
//
// A Manager is the single owner of wait4 in the agent: nothing else in the
// process may wait for children (os/exec's Wait would race its reaper).
package proc
