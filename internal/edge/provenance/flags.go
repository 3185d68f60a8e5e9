package provenance

import dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"

// Flags sets p's flags from its evidence: each true when its list holds
// anything (files outside the workspace by p's count of them).
func Flags(p *dsecv1.SandboxProvenance, outside int64) *dsecv1.ProvenanceFlags {
	f := &dsecv1.ProvenanceFlags{
		FilesOutsideWorkspace: outside > 0,
		TestsModified:         len(p.GetTestsChanged()) > 0,
		InterpreterReplaced:   len(p.GetReplaced()) > 0,
		ProtectedRead:         len(p.GetProtectedReads()) > 0,
		LeftoverProcesses:     len(p.GetProcesses()) > 0,
		PackagesInstalled:     len(p.GetPackages()) > 0,
		SyscallsDenied:        len(p.GetSyscallsDenied()) > 0,
	}
	for _, n := range p.GetNetwork() {
		switch n.GetVerdict() {
		case "allow":
			f.NetworkAllowed = true
		case "deny":
			f.NetworkDenied = true
		}
	}
	return f
}
