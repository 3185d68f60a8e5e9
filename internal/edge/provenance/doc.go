// Package provenance says how a sandbox's state came to be, from what the
// host can see of it: the writable layer's entries (Scan: every file
// written, made or removed, which of them replace system binaries,
// interpreters or test runners, which touch the task's tests, the packages
// dpkg and pip installed), reads of the paths a task marks protected
// (Watcher: fanotify marks on the sandbox's own view of them), and the
// flags a trainer filters rollouts on (Flags).
//
// The edge (package sandbox) gathers one sandbox's provenance on demand
// (the Provenance call, and a grade before it runs) from these, the
// network audit log and the sandbox's processes. Nothing here runs on a
// command's path: a scan reads the writable layer when asked, and a
// watcher's marks cost an event only when a protected path is opened.
package provenance
