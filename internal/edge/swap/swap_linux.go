package swap

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
)

// Swap is the edge's own swap area, on. Its state lives under dir, so a
// later Provision or Remove (another process, after a restart) finds it.
type Swap struct {
	dir  string
	cfg  Config
	path string // the swap file or /dev/zramN
	log  *slog.Logger
}

const (
	fileName = "dsec.swap"
	zramName = "zram" // holds the zram device number
)

// Provision turns the configured swap on, under dir (the edge's root), or
// adopts the one an earlier run of the edge left on. With Kind None it
// returns nil and does nothing.
func Provision(ctx context.Context, dir string, cfg Config, log *slog.Logger) (*Swap, error) {
	if cfg.Kind == None {
		return nil, nil
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("make swap dir %s: %w", dir, err)
	}
	s := &Swap{dir: dir, cfg: cfg, log: log}
	var err error
	switch cfg.Kind {
	case File:
		err = s.provisionFile(ctx)
	case Zram:
		err = s.provisionZram(ctx)
	default:
		err = fmt.Errorf("swap kind %q: %w", cfg.Kind, errdefs.ErrInvalidArgument)
	}
	if err != nil {
		return nil, err
	}
	return s, nil
}

// Path is the swap file or device.
func (s *Swap) Path() string { return s.path }

func (s *Swap) provisionFile(ctx context.Context) error {
	s.path = filepath.Join(s.dir, fileName)
	if on, _ := active(s.path); on {
		s.log.Info("swap file already on", "path", s.path)
		return nil
	}
	var st unix.Statfs_t
	if err := unix.Statfs(s.dir, &st); err != nil {
		return fmt.Errorf("statfs %s: %w", s.dir, err)
	}
	os.Remove(s.path)
	switch st.Type {
	case unix.TMPFS_MAGIC, unix.OVERLAYFS_SUPER_MAGIC, unix.RAMFS_MAGIC:
		return fmt.Errorf("make a swap file in %s: its file system cannot hold one (tmpfs, ramfs and overlay refuse swap files); put the edge's root on a disk or use --swap zram:SIZE: %w",
			s.dir, errdefs.ErrFailedPrecondition)
	case unix.BTRFS_SUPER_MAGIC:
		// A btrfs swap file must be NOCOW and fully allocated; the tool
		// knows how.
		if err := run(ctx, "btrfs", "filesystem", "mkswapfile", "--size", strconv.FormatInt(s.cfg.Size, 10), s.path); err != nil {
			return fmt.Errorf("make a btrfs swap file: %w", err)
		}
	default:
		if err := allocate(s.path, s.cfg.Size); err != nil {
			os.Remove(s.path)
			return err
		}
		if err := run(ctx, "mkswap", s.path); err != nil {
			os.Remove(s.path)
			return err
		}
	}
	if err := swapon(s.path); err != nil {
		os.Remove(s.path)
		return fmt.Errorf("turn on swap file %s: %w", s.path, err)
	}
	s.log.Info("swap file on", "path", s.path, "size_mb", s.cfg.Size>>20)
	return nil
}

// allocate makes a file of size bytes with every block allocated, as swapon
// requires (no holes).
func allocate(path string, size int64) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("make swap file: %w", err)
	}
	defer f.Close()
	if err := unix.Fallocate(int(f.Fd()), 0, 0, size); err != nil {
		return fmt.Errorf("allocate %d MiB for swap file %s: %w", size>>20, path, err)
	}
	return nil
}

func (s *Swap) provisionZram(ctx context.Context) error {
	state := filepath.Join(s.dir, zramName)
	if b, err := os.ReadFile(state); err == nil {
		dev := "/dev/zram" + strings.TrimSpace(string(b))
		if on, _ := active(dev); on {
			s.path = dev
			s.log.Info("zram swap already on", "device", dev)
			return nil
		}
		s.removeZram(strings.TrimSpace(string(b)))
		os.Remove(state)
	}
	b, err := os.ReadFile("/sys/class/zram-control/hot_add") // reading it adds a device
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("make a zram device: the kernel has no zram (modprobe zram), or use --swap file:SIZE: %w", errdefs.ErrNotSupported)
	}
	if err != nil {
		return fmt.Errorf("make a zram device: %w", err)
	}
	num := strings.TrimSpace(string(b))
	if err := os.WriteFile(state, []byte(num), 0o600); err != nil {
		s.removeZram(num)
		return fmt.Errorf("record zram device: %w", err)
	}
	fail := func(err error) error {
		s.removeZram(num)
		os.Remove(state)
		return err
	}
	sys := "/sys/block/zram" + num
	if algs, err := os.ReadFile(sys + "/comp_algorithm"); err == nil && strings.Contains(string(algs), "lz4") {
		_ = os.WriteFile(sys+"/comp_algorithm", []byte("lz4"), 0)
	}
	if err := os.WriteFile(sys+"/disksize", []byte(strconv.FormatInt(s.cfg.Size, 10)), 0); err != nil {
		return fail(fmt.Errorf("size zram device %s: %w", num, err))
	}
	s.path = "/dev/zram" + num
	if err := run(ctx, "mkswap", s.path); err != nil {
		return fail(err)
	}
	if err := swapon(s.path); err != nil {
		return fail(fmt.Errorf("turn on zram swap %s: %w", s.path, err))
	}
	s.log.Info("zram swap on", "device", s.path, "size_mb", s.cfg.Size>>20)
	return nil
}

func (s *Swap) removeZram(num string) {
	sys := "/sys/block/zram" + num
	_ = os.WriteFile(sys+"/reset", []byte("1"), 0)
	if n, err := strconv.Atoi(num); err == nil {
		_ = os.WriteFile("/sys/class/zram-control/hot_remove", []byte(strconv.Itoa(n)), 0)
	}
}

// Remove turns off and deletes whatever swap of the edge's own dir holds
// (the pages in it come back to RAM first, which takes a while when much
// is swapped). Nothing there is not an error.
func Remove(dir string) error {
	var errs []error
	file := filepath.Join(dir, fileName)
	if on, _ := active(file); on {
		if err := swapoff(file); err != nil {
			errs = append(errs, fmt.Errorf("turn off swap file %s: %w", file, err))
		}
	}
	if err := os.Remove(file); err != nil && !errors.Is(err, fs.ErrNotExist) {
		errs = append(errs, err)
	}
	state := filepath.Join(dir, zramName)
	if b, err := os.ReadFile(state); err == nil {
		num := strings.TrimSpace(string(b))
		dev := "/dev/zram" + num
		if on, _ := active(dev); on {
			if err := swapoff(dev); err != nil {
				errs = append(errs, fmt.Errorf("turn off zram swap %s: %w", dev, err))
			}
		}
		(&Swap{}).removeZram(num)
		os.Remove(state)
	}
	return errors.Join(errs...)
}

// Describe reads the node's swap: every area, the host's included, and
// which is the edge's own under dir.
func Describe(dir string) (Node, error) {
	var n Node
	areas, err := areas()
	if err != nil {
		return n, err
	}
	own := map[string]bool{filepath.Join(dir, fileName): true}
	if b, err := os.ReadFile(filepath.Join(dir, zramName)); err == nil {
		own["/dev/zram"+strings.TrimSpace(string(b))] = true
	}
	for _, a := range areas {
		n.Total += a.size
		n.Free += a.size - a.used
		if own[a.path] {
			n.Own = a.path
		}
	}
	return n, nil
}

type area struct {
	path       string
	size, used int64
}

// areas reads /proc/swaps.
func areas() ([]area, error) {
	f, err := os.Open("/proc/swaps")
	if err != nil {
		return nil, fmt.Errorf("read swap areas: %w", err)
	}
	defer f.Close()
	var out []area
	sc := bufio.NewScanner(f)
	sc.Scan() // header
	for sc.Scan() {
		// Filename Type Size Used Priority; sizes in KiB; the kernel
		// writes spaces in names as \040.
		fields := strings.Fields(sc.Text())
		if len(fields) < 4 {
			continue
		}
		size, _ := strconv.ParseInt(fields[2], 10, 64)
		used, _ := strconv.ParseInt(fields[3], 10, 64)
		out = append(out, area{path: strings.ReplaceAll(fields[0], `\040`, " "), size: size << 10, used: used << 10})
	}
	return out, sc.Err()
}

func active(path string) (bool, error) {
	as, err := areas()
	if err != nil {
		return false, err
	}
	for _, a := range as {
		if a.path == path {
			return true, nil
		}
	}
	return false, nil
}

func swapon(path string) error {
	p, err := unix.BytePtrFromString(path)
	if err != nil {
		return err
	}
	if _, _, errno := unix.Syscall(unix.SYS_SWAPON, uintptr(unsafe.Pointer(p)), 0, 0); errno != 0 {
		return errno
	}
	return nil
}

func swapoff(path string) error {
	p, err := unix.BytePtrFromString(path)
	if err != nil {
		return err
	}
	if _, _, errno := unix.Syscall(unix.SYS_SWAPOFF, uintptr(unsafe.Pointer(p)), 0, 0); errno != 0 {
		return errno
	}
	return nil
}

func run(ctx context.Context, name string, args ...string) error {
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}
