package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/fake"
	"dsec.dev/dsec/internal/edge/sandbox"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/vm/qemu"
)

// TestFillRunsc: a named runsc is required, none turns gVisor off, and the
// deprecated --runtime runsc reads as --runsc beside runc.
func TestFillRunsc(t *testing.T) {
	for _, tc := range []struct {
		name     string
		in       Config
		runsc    string
		required bool
	}{
		{"named", Config{Runsc: "/opt/runsc"}, "/opt/runsc", true},
		{"off", Config{Runsc: NoRunsc}, NoRunsc, false},
		{"deprecated runtime", Config{Runtime: "runsc", RuntimePath: "/opt/runsc"}, "/opt/runsc", true},
		{"deprecated runtime beside runsc", Config{Runtime: "runsc", RuntimePath: "/opt/a", Runsc: "/opt/b"}, "/opt/b", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := tc.in
			c.Root = t.TempDir()
			if err := c.fill(); err != nil {
				t.Fatal(err)
			}
			if c.Runtime != "runc" || c.RuntimePath != "" || c.Runsc != tc.runsc || c.runscRequired != tc.required {
				t.Errorf("filled runtime %q at %q, runsc %q (required %v); want runc, runsc %q (required %v)",
					c.Runtime, c.RuntimePath, c.Runsc, c.runscRequired, tc.runsc, tc.required)
			}
		})
	}
	// Unnamed: whatever the host has, offered only if it works.
	c := Config{Root: t.TempDir()}
	if err := c.fill(); err != nil {
		t.Fatal(err)
	}
	if c.runscRequired || c.Runsc != findRunsc() {
		t.Errorf("unnamed runsc filled as %q (required %v), want %q, not required", c.Runsc, c.runscRequired, findRunsc())
	}
}

// failingInit is a runtime whose Init refuses, as a backend's does on a
// node without what it needs.
type failingInit struct {
	*fake.Runtime
	err error
}

func (f failingInit) Init(ctx context.Context) error { return f.err }

// TestOffersAdd: a runtime that cannot be made ready is not offered; its
// refusal is why the node lacks its isolation, or, when required, the
// node's refusal to start. One that works is offered.
func TestOffersAdd(t *testing.T) {
	ctx := context.Background()
	o := &offers{log: slog.New(slog.DiscardHandler), runtimes: map[sandbox.Kind]backend.Runtime{}, missing: map[dsecv1.Isolation]string{}}
	noQEMU := fmt.Errorf("init microvm runtime: QEMU qemu-system-x86_64 is not installed (apt-get install qemu-system-x86): %w", errdefs.ErrNotSupported)
	open := func(err error) func() (backend.Runtime, error) {
		return func() (backend.Runtime, error) { return failingInit{fake.New(t.TempDir()), err}, nil }
	}
	if err := o.add(ctx, sandbox.MicroVMKind, false, open(noQEMU)); err != nil {
		t.Fatalf("an optional isolation's refusal stopped the node: %v", err)
	}
	if _, ok := o.runtimes[sandbox.MicroVMKind]; ok || o.missing[dsecv1.Isolation_ISOLATION_MICROVM] != noQEMU.Error() {
		t.Errorf("after a refused microvm: runtimes %v, missing %q", o.runtimes, o.missing[dsecv1.Isolation_ISOLATION_MICROVM])
	}
	if err := o.add(ctx, sandbox.GVisorKind, true, open(noQEMU)); !errors.Is(err, errdefs.ErrNotSupported) || !strings.Contains(err.Error(), "offer gvisor sandboxes") {
		t.Errorf("a required isolation's refusal: %v, want it to stop the node naming gvisor", err)
	}
	if err := o.add(ctx, sandbox.GVisorKind, false, open(nil)); err != nil || o.runtimes[sandbox.GVisorKind] == nil {
		t.Errorf("a working runtime: %v, offered %v", err, o.runtimes)
	}
}

// TestRunscPlatform: a named platform is taken as named; otherwise kvm
// where the accelerator test finds a /dev/kvm that runs stock guests,
// else systrap (this machine kind: no /dev/kvm, or kvm_pvm's without vmx).
func TestRunscPlatform(t *testing.T) {
	kvm := func() (qemu.Accel, string) { return qemu.KVM, "" }
	tcg := func() (qemu.Accel, string) { return qemu.TCG, "open /dev/kvm: no such file or directory" }
	for _, tc := range []struct {
		name, named string
		detect      func() (qemu.Accel, string)
		want, why   string
	}{
		{"kvm found", "", kvm, "kvm", "/dev/kvm"},
		{"no kvm", "", tcg, "systrap", "no such file"},
		{"named ptrace beside kvm", "ptrace", kvm, "ptrace", "--runsc-platform"},
		{"named kvm", "kvm", tcg, "kvm", "--runsc-platform"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, why := runscPlatform(tc.named, tc.detect)
			if got != tc.want || !strings.Contains(why, tc.why) {
				t.Errorf("runscPlatform(%q) = %q, %q; want %q, a reason holding %q", tc.named, got, why, tc.want, tc.why)
			}
		})
	}
}
