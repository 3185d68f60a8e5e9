package fuse2fs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
)

// Nobody is the uid and gid fuse2fs runs as by default.
const Nobody = 65534

// Options configure Mount. Zero values get the defaults described.
type Options struct {
	// Binary is fuse2fs (default fuse2fs on PATH; Debian's fuse2fs).
	Binary string
	// Helper is the executable bind-mounted as fuse2fs's /bin/fusermount,
	// whose main runs Fusermount when named fusermount (default this
	// process's own executable).
	Helper string
	// UID and GID fuse2fs runs as (default Nobody). The image is chowned
	// to them: fuse2fs opens it again through /proc/self/fd.
	UID, GID int
	// ReadOnly mounts read-only, and fuse2fs opens the image so.
	ReadOnly bool
	// Timeout bounds the wait for the mount's first answer: fuse2fs
	// opening the image and replaying its journal (default 2 min).
	Timeout time.Duration
	// Deadline bounds how long the mount serves, from Mount's return
	// (default 15 min): past it, the FUSE connection is aborted through
	// fusectl (every call on the mount fails: ECONNABORTED for one
	// waiting, ENOTCONN after) and fuse2fs is killed, and Aborted says so. The rlimits
	// catch a fuse2fs that spins; this one that blocks (a hostile image
	// can have it wait forever) and would hang its reader.
	Deadline time.Duration
	// CPUSeconds and MemoryBytes are fuse2fs's RLIMIT_CPU and RLIMIT_AS
	// (default 10 min, 2 GiB): a hostile image that sends it spinning or
	// allocating gets it killed, and the mount's reads then fail.
	CPUSeconds  int64
	MemoryBytes int64
}

const (
	defaultTimeout     = 2 * time.Minute
	defaultDeadline    = 15 * time.Minute
	defaultCPUSeconds  = 600
	defaultMemoryBytes = 2 << 30
	// fuseFD is the /dev/fuse descriptor's number in fuse2fs, named to
	// Fusermount by fdEnv; imageFD the image's.
	imageFD = 3
	fuseFD  = 4
	fdEnv   = "DSEC_FUSE2FS_FD"
	// stderrLimit bounds what of fuse2fs's output an error quotes.
	stderrLimit = 4 << 10
	// fusermountPath is where libfuse 2 runs fusermount from.
	fusermountPath = "/bin/fusermount"
)

// Mounted is an image mounted by fuse2fs. Its methods may be called from
// several goroutines.
type Mounted struct {
	dir    string
	image  string
	cmd    *exec.Cmd
	out    *tailBuffer
	done   chan struct{} // closed once fuse2fs exited
	waited error
	conn   uint64        // the FUSE connection's number (fusectl's dir)
	stop   chan struct{} // closed by Unmount: the deadline's watch ends

	once sync.Once
	err  error

	mu      sync.Mutex
	aborted error // why the connection was aborted, once it was
}

// Mount mounts the ext4 image at image on dir (an empty directory) through
// fuse2fs and returns once the mount answers. Read-write, fuse2fs replays
// the image's journal first, so what the guest committed is there. The
// image is chowned to Options.UID/GID. An image fuse2fs cannot open (a
// corrupted superblock, say) is an error quoting fuse2fs; nothing is left
// mounted or running then.
func Mount(ctx context.Context, image, dir string, o Options) (m *Mounted, err error) {
	o = o.withDefaults()
	bins, err := binaries(o)
	if err != nil {
		return nil, err
	}
	img, size, err := openImage(image, o)
	if err != nil {
		return nil, err
	}
	defer img.Close()
	dev, err := mountFuse(dir, o.ReadOnly)
	if err != nil {
		return nil, err
	}
	defer dev.Close() // fuse2fs holds its own copy
	defer func() {
		if err != nil {
			_ = unix.Unmount(dir, unix.MNT_DETACH)
		}
	}()
	m = &Mounted{dir: dir, image: image, out: &tailBuffer{max: stderrLimit}, done: make(chan struct{}), stop: make(chan struct{})}
	m.cmd = command(bins, o, size)
	m.cmd.ExtraFiles = []*os.File{img, dev} // imageFD, fuseFD
	m.cmd.Stdout, m.cmd.Stderr = m.out, m.out
	if err := m.cmd.Start(); err != nil {
		return nil, fmt.Errorf("mount %s with fuse2fs: %w", image, err)
	}
	go func() {
		m.waited = m.cmd.Wait()
		close(m.done)
	}()
	if err := m.ready(ctx, o.Timeout); err != nil {
		m.cmd.Process.Kill()
		<-m.done
		return nil, fmt.Errorf("mount %s with fuse2fs: %w", image, err)
	}
	go m.watchDeadline(o.Deadline)
	return m, nil
}

// watchDeadline aborts the mount once it has served for deadline, unless
// it is unmounted first.
func (m *Mounted) watchDeadline(deadline time.Duration) {
	t := time.NewTimer(deadline)
	defer t.Stop()
	select {
	case <-t.C:
	case <-m.stop:
		return
	}
	err := fmt.Errorf("fuse2fs serving %s did not finish within its deadline of %s (it blocks, or the image is too slow to read): its FUSE connection was aborted: %w",
		m.image, deadline, errdefs.ErrDeadlineExceeded)
	// Said before it is done: the readers' calls fail at once.
	m.mu.Lock()
	m.aborted = err
	m.mu.Unlock()
	if aerr := abortConn(m.conn); aerr != nil {
		m.mu.Lock()
		m.aborted = fmt.Errorf("%w (abort through fusectl: %v; fuse2fs killed instead)", err, aerr)
		m.mu.Unlock()
	}
	m.cmd.Process.Kill()
}

// Aborted returns why the mount's FUSE connection was aborted (its
// deadline passed), or nil: reads of the mount failing with ECONNABORTED
// or ENOTCONN then failed for that reason.
func (m *Mounted) Aborted() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.aborted
}

// fusectlDir is where fusectl is mounted on most hosts.
const fusectlDir = "/sys/fs/fuse/connections"

// abortConn aborts FUSE connection conn: "1" to its abort file in
// fusectl, at fusectlDir or, where nothing is mounted there, on a mount of
// fusectl's own (one super block: every mount shows every connection).
func abortConn(conn uint64) error {
	name := strconv.FormatUint(conn, 10)
	if err := os.WriteFile(filepath.Join(fusectlDir, name, "abort"), []byte("1"), 0); err == nil {
		return nil
	}
	dir, err := os.MkdirTemp("", "dsec-fusectl-")
	if err != nil {
		return fmt.Errorf("mount fusectl: %w", err)
	}
	defer os.Remove(dir)
	if err := unix.Mount("fusectl", dir, "fusectl", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount fusectl: %w", err)
	}
	defer unix.Unmount(dir, unix.MNT_DETACH)
	if err := os.WriteFile(filepath.Join(dir, name, "abort"), []byte("1"), 0); err != nil {
		return fmt.Errorf("abort connection %s: %w", name, err)
	}
	return nil
}

func (o Options) withDefaults() Options {
	if o.Binary == "" {
		o.Binary = "fuse2fs"
	}
	if o.UID == 0 && o.GID == 0 {
		o.UID, o.GID = Nobody, Nobody
	}
	if o.Timeout == 0 {
		o.Timeout = defaultTimeout
	}
	if o.Deadline == 0 {
		o.Deadline = defaultDeadline
	}
	if o.CPUSeconds == 0 {
		o.CPUSeconds = defaultCPUSeconds
	}
	if o.MemoryBytes == 0 {
		o.MemoryBytes = defaultMemoryBytes
	}
	return o
}

// bins are the programs a mount runs.
type bins struct {
	fuse2fs, helper, fusermount           string // fusermount: what /bin/fusermount resolves to
	e2fsck, unshare, prlimit, setpriv, sh string
}

func binaries(o Options) (bins, error) {
	var b bins
	var err error
	if b.fuse2fs, err = exec.LookPath(o.Binary); err != nil {
		return b, fmt.Errorf("mount with fuse2fs: %s is not installed (apt-get install fuse2fs): %w", o.Binary, errdefs.ErrNotSupported)
	}
	// libfuse 2 runs /bin/fusermount; Debian's fuse3 makes it a link to
	// fusermount3. The bind mount goes over what it resolves to.
	if b.fusermount, err = filepath.EvalSymlinks(fusermountPath); err != nil {
		return b, fmt.Errorf("mount with fuse2fs: %s, which fuse2fs's libfuse runs, is missing (apt-get install fuse3): %w", fusermountPath, errdefs.ErrNotSupported)
	}
	b.helper = o.Helper
	if b.helper == "" {
		if b.helper, err = os.Executable(); err != nil {
			return b, fmt.Errorf("mount with fuse2fs: find this executable: %w", err)
		}
	}
	for _, p := range []struct {
		dst       *string
		name, pkg string
	}{{&b.e2fsck, "e2fsck", "e2fsprogs"}, {&b.unshare, "unshare", "util-linux"}, {&b.prlimit, "prlimit", "util-linux"},
		{&b.setpriv, "setpriv", "util-linux"}, {&b.sh, "sh", "dash"}} {
		if *p.dst, err = lookPath(p.name); err != nil {
			return b, fmt.Errorf("mount with fuse2fs: %s is not installed (%s): %w", p.name, p.pkg, errdefs.ErrNotSupported)
		}
	}
	return b, nil
}

// lookPath finds name on PATH or in the sbin directories a daemon's PATH
// may lack.
func lookPath(name string) (string, error) {
	p, err := exec.LookPath(name)
	if err == nil {
		return p, nil
	}
	for _, dir := range []string{"/usr/sbin", "/sbin"} {
		if _, serr := os.Stat(filepath.Join(dir, name)); serr == nil {
			return filepath.Join(dir, name), nil
		}
	}
	return "", err
}

// openImage chowns the image to fuse2fs's uid and opens it for fuse2fs to
// inherit; size bounds what fuse2fs may write (RLIMIT_FSIZE).
func openImage(image string, o Options) (*os.File, int64, error) {
	flag := os.O_RDWR
	if o.ReadOnly {
		flag = os.O_RDONLY
	}
	f, err := os.OpenFile(image, flag|unix.O_NOFOLLOW, 0)
	if err != nil {
		return nil, 0, fmt.Errorf("mount with fuse2fs: %w", err)
	}
	fi, err := f.Stat()
	if err == nil && !fi.Mode().IsRegular() {
		err = fmt.Errorf("%s is not a regular file: %w", image, errdefs.ErrInvalidArgument)
	}
	if err == nil {
		err = f.Chown(o.UID, o.GID)
	}
	if err != nil {
		f.Close()
		return nil, 0, fmt.Errorf("mount with fuse2fs: %w", err)
	}
	return f, fi.Size(), nil
}

// mountFuse mounts a new FUSE connection on dir and returns its device.
// The mount is root's (allow_other, so root reads it through the served
// permissions; default_permissions, so the kernel checks modes).
func mountFuse(dir string, ro bool) (*os.File, error) {
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("mount with fuse2fs: open /dev/fuse: %w", err)
	}
	dev := os.NewFile(uintptr(fd), "/dev/fuse")
	flags := uintptr(unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC)
	if ro {
		flags |= unix.MS_RDONLY
	}
	data := fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions", fd)
	if err := unix.Mount("fuse2fs", dir, "fuse.fuse2fs", flags, data); err != nil {
		dev.Close()
		return nil, fmt.Errorf("mount with fuse2fs: mount fuse on %s: %w", dir, err)
	}
	return dev, nil
}

// fuseSetup makes fuse2fs's mount namespace, then runs the rest of its
// arguments. The namespace began as a copy of the caller's, which would
// keep every mount of the host alive while fuse2fs runs (the caller's
// FUSE mount included, so that its unmount would not end fuse2fs): its
// root becomes a tmpfs (over /tmp, then pivot_root) holding only /usr and
// /etc read-only, the root's links or binds into them, a fresh /proc (for
// /proc/self/fd), /dev/null, zero, random and urandom (libext2fs reads
// urandom when it writes), and /dev/null again as /dev/fuse, so that
// libfuse's own mount fails with EPERM (its fall-back to fusermount)
// whatever /dev/fuse's mode on the host, and fuse2fs opens no FUSE
// connection of its own; the old root is detached. The helper ($1) is
// bind-mounted over fusermount ($2, as /bin/fusermount resolves), through a
// descriptor opened before the tmpfs hides where it is.
const fuseSetup = `set -e
h=$1 fm=$2 r=/tmp
shift 2
exec 5<"$h"
mount -t tmpfs -o mode=0755,size=64k fuse2fs-root $r
mkdir $r/usr $r/etc $r/dev $r/proc $r/old
mount --bind -o ro /usr $r/usr
mount --bind -o ro /etc $r/etc
for d in bin sbin lib lib32 lib64 libx32; do
  if [ -L /$d ]; then ln -s "$(readlink /$d)" $r/$d
  elif [ -d /$d ]; then mkdir $r/$d; mount --bind -o ro /$d $r/$d
  fi
done
for d in null zero random urandom; do
  touch $r/dev/$d
  mount --bind /dev/$d $r/dev/$d
done
touch $r/dev/fuse
mount --bind /dev/null $r/dev/fuse
mount -t proc -o nosuid,nodev,noexec proc $r/proc
mount --bind /proc/self/fd/5 "$r$fm"
exec 5<&-
cd $r
pivot_root . old
umount -l /old
rmdir /old
cd /
exec "$@"`

// fuseRun replays the image's journal with e2fsck when $1 is 1 (e2fsck
// $2 on the image $3), then runs the rest of its arguments (fuse2fs).
// fuse2fs 1.47.0's own replay crashed (SIGSEGV) on the journal of a
// guest's disk that needed recovery; e2fsck's replays it. An exit of 4 or
// more is e2fsck's "errors left uncorrected" or worse: the image is not
// served.
const fuseRun = `if [ "$1" = 1 ]; then
  "$2" -E journal_only -y "$3" >&2
  rc=$?
  if [ $rc -ge 4 ]; then echo "e2fsck -E journal_only: exit $rc" >&2; exit 1; fi
fi
shift 3
exec "$@"`

// command is fuse2fs in its own namespaces, with its own fusermount
// (Fusermount: the descriptor handed over), its rlimits, and no privilege.
func command(b bins, o Options, size int64) *exec.Cmd {
	opts := []string{"nonempty"}
	replay := "1"
	if o.ReadOnly {
		opts, replay = append(opts, "ro", "norecovery"), "0"
	}
	image := "/proc/self/fd/" + strconv.Itoa(imageFD)
	args := []string{
		"--mount", "--propagation", "private", "--net", "--ipc", "--uts", "--",
		b.sh, "-c", fuseSetup, "sh", b.helper, b.fusermount,
		b.prlimit, "--as=" + strconv.FormatInt(o.MemoryBytes, 10), "--cpu=" + strconv.FormatInt(o.CPUSeconds, 10),
		"--nofile=64", "--core=0", "--fsize=" + strconv.FormatInt(max(size, 1), 10), "--",
		b.setpriv, "--reuid=" + strconv.Itoa(o.UID), "--regid=" + strconv.Itoa(o.GID), "--clear-groups",
		"--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--",
		b.sh, "-c", fuseRun, "sh", replay, b.e2fsck, image,
		// The mount point is fuse2fs's business only through fusermount,
		// which ignores it; libfuse resolves it, so it is one fuse2fs can
		// see.
		b.fuse2fs, image, "/", "-f", "-o", strings.Join(opts, ","),
	}
	cmd := exec.Command(b.unshare, args...)
	cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", fdEnv + "=" + strconv.Itoa(fuseFD)}
	return cmd
}

// ready waits until the mount answers a statfs (fuse2fs opened the image
// and answered the kernel's INIT) and a stat of its root (which names its
// connection: m.conn), or fuse2fs ends, or timeout.
func (m *Mounted) ready(ctx context.Context, timeout time.Duration) error {
	answered := make(chan error, 1)
	go func() {
		var sfs unix.Statfs_t
		if err := unix.Statfs(m.dir, &sfs); err != nil {
			answered <- err
			return
		}
		var st unix.Stat_t
		err := unix.Stat(m.dir, &st)
		// fusectl names a connection by its super block's device number
		// in the kernel's own encoding (major << 20 | minor).
		m.conn = uint64(unix.Major(st.Dev))<<20 | uint64(unix.Minor(st.Dev))
		answered <- err
	}()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case err := <-answered:
		if err != nil {
			return m.failure(err)
		}
		return nil
	case <-m.done:
		return m.failure(fmt.Errorf("fuse2fs ended: %v", m.waited))
	case <-t.C:
		return m.failure(fmt.Errorf("no answer in %s: %w", timeout, errdefs.ErrDeadlineExceeded))
	case <-ctx.Done():
		return ctx.Err()
	}
}

// failure is err with what fuse2fs said, once it ended (given a moment).
func (m *Mounted) failure(err error) error {
	select {
	case <-m.done:
	case <-time.After(2 * time.Second):
	}
	if out := strings.TrimSpace(m.out.String()); out != "" {
		return fmt.Errorf("%w: fuse2fs: %s", err, out)
	}
	return err
}

// Unmount detaches the mount and waits for fuse2fs to end (killing it
// after a while: a hostile image may have it stuck). It is idempotent.
func (m *Mounted) Unmount() error {
	m.once.Do(func() {
		close(m.stop)
		m.err = Detach(m.dir)
		select {
		case <-m.done:
		case <-time.After(10 * time.Second):
			m.cmd.Process.Kill()
			<-m.done
		}
	})
	return m.err
}

// Detach unmounts the fuse2fs mount on dir, if any, lazily: one an earlier
// process left (its fuse2fs then ends on its own) or one whose fuse2fs is
// stuck.
func Detach(dir string) error {
	err := unix.Unmount(dir, unix.MNT_DETACH)
	if err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmount %s: %w", dir, err)
	}
	return nil
}

// Fusermount is libfuse 2's fusermount as fuse2fs runs it under Mount:
// it hands over the /dev/fuse descriptor the caller mounted (named by
// DSEC_FUSE2FS_FD) on the socket _FUSE_COMMFD names, and unmounts nothing
// (-u: the caller unmounts). It returns the exit code. A main calls it
// when its argv[0] is fusermount.
func Fusermount(args []string) int {
	for _, a := range args[1:] {
		if a == "-u" {
			return 0
		}
	}
	comm, err1 := strconv.Atoi(os.Getenv("_FUSE_COMMFD"))
	fd, err2 := strconv.Atoi(os.Getenv(fdEnv))
	if err := errors.Join(err1, err2); err != nil {
		fmt.Fprintf(os.Stderr, "fusermount: only fuse2fs under dsec's mount runs this: %v\n", err)
		return 1
	}
	if err := unix.Sendmsg(comm, []byte{0}, unix.UnixRights(fd), nil, 0); err != nil {
		fmt.Fprintf(os.Stderr, "fusermount: hand over the fuse descriptor: %v\n", err)
		return 1
	}
	return 0
}

// IsFusermount reports whether argv0 names this program as fusermount.
func IsFusermount(argv0 string) bool { return filepath.Base(argv0) == "fusermount" }

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > t.max {
		t.b = t.b[len(t.b)-t.max:]
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.b)
}
