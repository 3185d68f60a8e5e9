//go:build !(linux && amd64)

package refused

// Arch is 0 here: sandboxes' profiles are written for x86_64, and nothing
// logs their refusals on another arch.
const Arch = 0

// Numbers is empty here (see Arch).
var Numbers = map[string]int{}

var byArgument = map[string]int{}
