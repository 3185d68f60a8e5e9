package daemon

import (
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"runtime"
	"strings"

	"dsec.dev/dsec/internal/errdefs"
)

// agentBuildHint is how to get an agent that runs in any sandbox.
const agentBuildHint = "build it static with `make build` (bin/dsec-agent), or `CGO_ENABLED=0 go build -o bin/dsec-agent ./cmd/dsec-agent`"

// elfMachine is the ELF machine of binaries for goarch; false for an
// architecture this table does not know, whose agents go unchecked.
func elfMachine(goarch string) (elf.Machine, bool) {
	switch goarch {
	case "amd64":
		return elf.EM_X86_64, true
	case "arm64":
		return elf.EM_AARCH64, true
	case "386":
		return elf.EM_386, true
	case "arm":
		return elf.EM_ARM, true
	case "riscv64":
		return elf.EM_RISCV, true
	case "ppc64", "ppc64le":
		return elf.EM_PPC64, true
	case "s390x":
		return elf.EM_S390, true
	case "loong64":
		return elf.EM_LOONGARCH, true
	}
	return 0, false
}

// checkAgent refuses an agent binary that cannot run as pid 1 of every
// sandbox: it must be an executable for this node's architecture and
// statically linked, since it runs from /.dsec/bin inside environments that
// need not hold its dynamic loader or libraries (a dynamic one makes every
// create wait out the start timeout for an agent that never ran).
func checkAgent(path string) error {
	f, err := elf.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("check agent %s: no such file; %s, or name it with --agent: %w", path, agentBuildHint, errdefs.ErrNotFound)
	}
	var fe *elf.FormatError
	if errors.As(err, &fe) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("check agent %s: not an ELF executable (%v); %s: %w", path, err, agentBuildHint, errdefs.ErrFailedPrecondition)
	}
	if err != nil {
		return fmt.Errorf("check agent %s: %w", path, err)
	}
	defer f.Close()
	if want, ok := elfMachine(runtime.GOARCH); ok && f.Machine != want {
		return fmt.Errorf("check agent %s: built for %s, but this node is %s (%s); %s: %w",
			path, f.Machine, runtime.GOARCH, want, agentBuildHint, errdefs.ErrFailedPrecondition)
	}
	if f.Type != elf.ET_EXEC && f.Type != elf.ET_DYN {
		return fmt.Errorf("check agent %s: an ELF %s, not an executable; %s: %w", path, f.Type, agentBuildHint, errdefs.ErrFailedPrecondition)
	}
	var why []string
	for _, p := range f.Progs {
		if p.Type != elf.PT_INTERP {
			continue
		}
		interp, err := io.ReadAll(io.LimitReader(p.Open(), 4096))
		if err != nil {
			return fmt.Errorf("check agent %s: read its interpreter: %w", path, err)
		}
		why = append(why, "interpreter "+strings.TrimRight(string(interp), "\x00"))
	}
	libs, err := f.ImportedLibraries()
	if err != nil {
		return fmt.Errorf("check agent %s: read its dynamic section: %w", path, err)
	}
	if len(libs) > 0 {
		why = append(why, "needs "+strings.Join(libs, ", "))
	}
	if len(why) > 0 {
		return fmt.Errorf("check agent %s: it is dynamically linked (%s), and the sandboxes it runs in need not hold its loader or libraries; %s: %w",
			path, strings.Join(why, "; "), agentBuildHint, errdefs.ErrFailedPrecondition)
	}
	return nil
}
