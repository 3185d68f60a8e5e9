package agent

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// writeHostFiles gives the sandbox the /etc/hosts and /etc/hostname a
// Docker container gets, whatever its image shipped: many images have
// neither, and without /etc/hosts "localhost" goes to DNS, which a sandbox
// without network rules cannot reach. The host name maps to the sandbox's
// address when it has one, else to 127.0.1.1 (Debian's convention for a
// host without a fixed address). The files are written through the
// sandbox's own root, so a symlink in the image cannot point them at the
// host, and replaced by rename, so a symlink at /etc/hosts is replaced
// rather than followed. They sit in the writable layer like any file the
// sandbox writes; its commands may edit them.
func writeHostFiles(hostname, addr string) error {
	if addr == "" {
		addr = "127.0.1.1"
	}
	hosts := fmt.Sprintf(`127.0.0.1	localhost
::1	localhost ip6-localhost ip6-loopback
fe00::0	ip6-localnet
ff00::0	ip6-mcastprefix
ff02::1	ip6-allnodes
ff02::2	ip6-allrouters
%s	%s
`, addr, hostname)
	if err := os.MkdirAll("/etc", 0o755); err != nil {
		return fmt.Errorf("write host files: %w", err)
	}
	if err := replaceFile("/etc/hosts", hosts); err != nil {
		return err
	}
	return replaceFile("/etc/hostname", hostname+"\n")
}

func replaceFile(path, content string) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".dsec-"+filepath.Base(path)+"-*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.WriteString(content); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Chmod(0o644); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// currentHostname is the UTS host name, as the kernel has it.
func currentHostname() string {
	h, err := os.Hostname()
	if err != nil {
		return "localhost"
	}
	return strings.TrimSpace(h)
}
