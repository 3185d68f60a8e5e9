// Package fs owns the agent's file operations inside the sandbox: read,
// write, list, stat, remove, make directories, and tar upload and download.
// Each operation runs with the file-system credentials of the request's user
// (per-thread setfsuid/setfsgid/setgroups on a locked OS thread), so the
// kernel does the permission checks a process of that user would get.
// Upload never writes through a symlink and refuses names that leave the
// target directory and device nodes.
package fs
