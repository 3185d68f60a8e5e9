package refused

// Name names syscall nr of Arch if the profile refuses it, whole or by its
// arguments.
func Name(nr int) (string, bool) {
	for _, m := range []map[string]int{Numbers, byArgument} {
		for name, n := range m {
			if n == nr {
				return name, true
			}
		}
	}
	return "", false
}
