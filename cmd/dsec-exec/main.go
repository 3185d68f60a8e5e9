// Command dsec-exec starts each command inside a sandbox for the agent (see
// package child). It is shipped read-only beside dsec-agent at /.dsec/bin.
package main

import (
	"os"

	"dsec.dev/dsec/internal/agent/child"
)

func main() { os.Exit(child.Main()) }
