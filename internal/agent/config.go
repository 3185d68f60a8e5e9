package agent

import "log/slog"

// Version is reported by Ping.
const Version = "0.1.0"

// DefaultShell is the static shell shipped read-only with the agent.
const DefaultShell = "/.dsec/bin/sh"

// Config is the serve mode's configuration; flags map onto it one to one.
type Config struct {
	ListenFD       int      // listening Unix stream socket; unused with ListenPath
	CgroupFD       int      // sandbox cgroup dir (freezer v1 / unified v2); -1 = none
	MemoryCgroupFD int      // sandbox memory cgroup dir; -1 = none
	PidsCgroupFD   int      // cgroup v1 pids dir that caps commands (not the agent); -1 = none
	CgroupPath     string   // without CgroupFD: the agent's own cgroup v2 dir, where it makes the commands' cgroup (gVisor: the sentry's)
	PidsMax        int64    // with CgroupPath: the commands' pids.max; 0 = none
	CPUCgroupFD    int      // cgroup v1 cpu dir of the sandbox (fncall calls' CPU limits); -1 = none
	FnCall         bool     // serve Call (package call): a fncall container
	Guest          bool     // a microVM's init (guest mode): serve Reidentify
	ZygotePreload  string   // comma-separated modules for the warm interpreter ("" = call.DefaultPreload)
	CallScratch    string   // where calls' scratch directories go ("" = /tmp)
	CallWipe       string   // comma-separated directories emptied after each call ("" = /tmp,/var/tmp,/dev/shm)
	User           string   // default user of commands and file operations ("" = root)
	Workdir        string   // default working directory ("" = the user's home, else /)
	Env            []string // K=V added to every command's environment
	Shell          string   // shell for commands and sessions ("" = DefaultShell)
	OutputLimit    int64    // output kept per stream for Attach (0 = 16 MiB); followers get all of it
	Hostname       string   // set as the UTS hostname when pid 1
	Address        string   // the sandbox's IPv4 address, for /etc/hosts ("" = loopback only)
	LogRefusals    bool     // log what the sandbox's profile refuses: a filter refusing the same calls with SECCOMP_FILTER_FLAG_LOG (package refused)
	DiskQgroup     string   // sysfs dir of the btrfs qgroup capping the writable layer: statfs of / reports it (package diskfree)
	AgentPath      string   // the agent's binary as the sandbox's commands see it, for sessions' state-dump ("" = os.Executable())
	// ListenPath, when set, is where the agent makes its listening Unix
	// socket itself, in place of ListenFD: under gVisor, whose sentry
	// cannot accept on a listening socket handed in from the host, the
	// socket is made in a directory bind-mounted from the host (runsc
	// --host-uds=create), so the host connects to the file it leaves.
	ListenPath string
	Log        *slog.Logger
}
