package store

// TokenHashForTest is what the store keeps of a token.
func TokenHashForTest(tok string) []byte { return hashToken(tok) }
