// Package call runs the fncall backend's calls inside a pooled container:
// the agent side of FnCallService (the edge side is internal/edge/fncall).
//
// A container runs one call at a time. A call:
//
//  1. takes the next uid of the agent's pool (gid the same number), so a
//     process of one call never shares a uid with the next;
//  2. makes a fresh scratch directory under /tmp, owned by that uid and
//     mode 0700, and writes the call's files into it (paths are resolved
//     inside it and may not leave it);
//  3. sets the call's limits on its cgroups, children of the sandbox's:
//     memory (no swap), CPU quota and pids on cgroup v1, made at the first
//     call and reused by every later one (a memory cgroup removed and made
//     again for every call would leave the kernel a dying cgroup each time);
//  4. runs the steps in order (compile, then run), each in a new session as
//     the call's uid with the scratch directory as cwd and HOME, stdout and
//     stderr kept up to the output limit (the rest read and counted); a
//     step with a zygote file runs in a fork of the warm interpreter
//     (zygote.py) rather than a new python3;
//  5. reads the fetch_files back;
//  6. kills every process of the call (every one is in the call's memory
//     cgroup, which an unprivileged process cannot leave), removes the
//     scratch directory, empties /tmp, /var/tmp and /dev/shm and removes
//     the System V IPC objects of the container's IPC namespace.
//
// What survives cleanup (a process of the call, or of its uid) makes the
// response dirty; the edge then retires the container rather than reuse
// it.
//
// The zygote is one python3 started by the agent at the first zygote step,
// as root, that imports the preload modules once and then forks a child
// per run: the child joins the call's cgroups, starts a new session, lowers
// its RLIMIT_DATA to the call's memory limit, drops to the call's uid and
// runs the file as `python3 FILE` would. Between runs the zygote changes
// nothing: every run's changes to the interpreter die with its process.
// What runs share is the zygote's memory image as the fork copied it (the
// preloaded modules, copy-on-write) and its hash seed (PYTHONHASHSEED is
// fixed per zygote, so set iteration order is the same in every run);
// random reseeds itself in every child.
package call
