// Command dsec is the command-line client of dsecd.
package main

import (
	"os"

	"dsec.dev/dsec/internal/cli"
)

func main() { os.Exit(cli.Main(os.Args[1:])) }
