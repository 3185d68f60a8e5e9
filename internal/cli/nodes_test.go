package cli

import (
	"testing"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

func TestParseIsolation(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want dsecv1.Isolation
		ok   bool
	}{
		{"", dsecv1.Isolation_ISOLATION_UNSPECIFIED, true},
		{"container", dsecv1.Isolation_ISOLATION_CONTAINER, true},
		{"gvisor", dsecv1.Isolation_ISOLATION_GVISOR, true},
		{"microvm", dsecv1.Isolation_ISOLATION_MICROVM, true},
		{"MicroVM", dsecv1.Isolation_ISOLATION_MICROVM, true},
		{"unspecified", 0, false},
		{"firecracker", 0, false},
	} {
		got, err := parseIsolation(tc.in)
		if (err == nil) != tc.ok || (tc.ok && got != tc.want) {
			t.Errorf("parseIsolation(%q) = %v, %v; want %v, ok %v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

func TestKindsText(t *testing.T) {
	ks := []*dsecv1.SandboxKind{
		{Isolation: dsecv1.Isolation_ISOLATION_CONTAINER, Profile: dsecv1.Backend_BACKEND_CONTAINER},
		{Isolation: dsecv1.Isolation_ISOLATION_CONTAINER, Profile: dsecv1.Backend_BACKEND_FNCALL},
		{Isolation: dsecv1.Isolation_ISOLATION_GVISOR, Profile: dsecv1.Backend_BACKEND_CONTAINER, Accelerator: "systrap"},
	}
	if got, want := kindsText(ks), "container, container/fncall, gvisor (systrap)"; got != want {
		t.Errorf("kindsText = %q, want %q", got, want)
	}
	if got, want := missingText(map[string]string{"microvm": "no QEMU", "gvisor": "no runsc"}), "gvisor: no runsc; microvm: no QEMU"; got != want {
		t.Errorf("missingText = %q, want %q", got, want)
	}
}
