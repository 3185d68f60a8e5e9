package container

import "testing"

func TestLoopbackNameservers(t *testing.T) {
	for _, c := range []struct {
		in, want string
		found    bool
	}{
		{"nameserver 127.0.0.53\noptions timeout:2 attempts:2\n", "nameserver 169.254.0.53\noptions timeout:2 attempts:2\n", true},
		{"nameserver 127.0.0.53\nnameserver 127.0.0.1\n", "nameserver 169.254.0.53\n", true},
		{"nameserver 198.18.0.1\noptions ndots:0\n", "nameserver 198.18.0.1\noptions ndots:0\n", false},
	} {
		got, found := loopbackNameservers([]byte(c.in))
		if string(got) != c.want || found != c.found {
			t.Errorf("loopbackNameservers(%q) = %q, %v; want %q, %v", c.in, got, found, c.want, c.found)
		}
	}
}
