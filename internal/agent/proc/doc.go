// Package proc owns the processes the agent starts inside the sandbox: it
// forks and execs each itself, inside the command's own child cgroup from its
// first instruction (cloned into it on cgroup v2; on v1 the forking thread
// joins it, forks and returns), reaps every child of the agent, captures
// their output, and kills whole process trees.
//
// Output goes two ways. The first OutputLimit bytes of each stream are
// retained, for a later Attach to replay (and for fncall, which reads only
// them). Every byte also goes to each Follower, a stream following the
// process (the exec call that started it, an Attach): a follower gets all
// of it from the moment it follows, and one that falls liveWindow behind on
// output past the retained part stops the agent reading the command's pipes
// until it catches up, so a slow reader slows the command rather than lose
// output. Only output past the retained part that no follower was there to
// take is dropped (counted, and reported to later readers as a gap).
//
// A Manager is the single owner of wait4 in the agent: nothing else in the
// process may wait for children (os/exec's Wait would race its reaper).
package proc
