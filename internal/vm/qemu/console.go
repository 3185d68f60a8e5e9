package qemu

import (
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
)

// consoleLog keeps what a guest's serial console printed in at most limit
// bytes on disk: the log file, and once it holds half the limit it becomes
// log.1 (replacing the one before) and a new log starts. A guest that
// floods its console costs the host that much disk and no more.
type consoleLog struct {
	path string
	half int64

	mu   sync.Mutex
	f    *os.File
	size int64
}

func openConsoleLog(path string, limit int64) (*consoleLog, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open console log: %w", err)
	}
	os.Remove(path + ".1")
	return &consoleLog{path: path, half: max(limit/2, 4096), f: f}, nil
}

// appendConsoleLog opens the log at path to go on where it ends.
func appendConsoleLog(path string, limit int64) (*consoleLog, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open console log: %w", err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("open console log: %w", err)
	}
	return &consoleLog{path: path, half: max(limit/2, 4096), f: f, size: fi.Size()}, nil
}

// Console is the console of a VM this process did not start, followed
// into its log (FollowConsole).
type Console struct {
	conn net.Conn
	done chan struct{}
}

// FollowConsole connects to the console of the VM whose run directory is
// dir, one an earlier process started (a re-adopted VM), and appends what
// it prints to its log, capped at limit as Start's (0 = 1 MiB), until QEMU
// ends or Close: without it the log of a re-adopted VM stops at the
// restart. QEMU serves one console client at a time: while another process
// still holds the console, this one waits its turn.
func FollowConsole(dir string, limit int64) (*Console, error) {
	if limit == 0 {
		limit = 1 << 20
	}
	conn, err := net.Dial("unix", filepath.Join(dir, ConsoleSocket))
	if err != nil {
		return nil, fmt.Errorf("follow vm console: %w", err)
	}
	log, err := appendConsoleLog(filepath.Join(dir, ConsoleLog), limit)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("follow vm console: %w", err)
	}
	c := &Console{conn: conn, done: make(chan struct{})}
	go func() {
		defer close(c.done)
		io.Copy(log, conn)
		conn.Close()
		log.Close()
	}()
	return c, nil
}

// Close stops following and waits until the log is closed.
func (c *Console) Close() error {
	err := c.conn.Close()
	<-c.done
	return err
}

// Write logs b. It never fails: a console that cannot be logged must not
// stop the copy that drains it.
func (l *consoleLog) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return len(b), nil
	}
	if l.size > 0 && l.size+int64(len(b)) > l.half {
		l.f.Close()
		os.Rename(l.path, l.path+".1")
		f, err := os.OpenFile(l.path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
		if err != nil {
			l.f = nil
			return len(b), nil
		}
		l.f, l.size = f, 0
	}
	n, _ := l.f.Write(b)
	l.size += int64(n)
	return len(b), nil
}

// Close closes the log file; Tail still reads it.
func (l *consoleLog) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return nil
	}
	err := l.f.Close()
	l.f = nil
	return err
}

// tailBytes is how much of the log Tail reads.
const tailBytes = 64 << 10

// Tail is the log's last n lines (the last line may be unfinished).
func (l *consoleLog) Tail(n int) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return tailLines(l.path, n)
}

// ConsoleTail is the last n lines of what the console of the VM whose run
// directory is dir printed, read from its log: for a VM this process did
// not start (a re-adopted one), or whose Process is gone.
func ConsoleTail(dir string, n int) string {
	return tailLines(filepath.Join(dir, ConsoleLog), n)
}

// tailLines is the last n lines of the log at path and its older half.
func tailLines(path string, n int) string {
	data := append(readTail(path+".1", tailBytes), readTail(path, tailBytes)...)
	text := strings.TrimRight(string(data), "\r\n")
	if text == "" || n <= 0 {
		return ""
	}
	lines := strings.Split(text, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	for i, line := range lines {
		lines[i] = strings.TrimRight(line, "\r")
	}
	return strings.Join(lines, "\n")
}

// readTail is the last (at most) n bytes of the file at path.
func readTail(path string, n int64) []byte {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil
	}
	off := max(fi.Size()-n, 0)
	b, _ := io.ReadAll(io.NewSectionReader(f, off, fi.Size()-off))
	return b
}

// panicMark starts the kernel's panic message on the console.
const panicMark = "Kernel panic - not syncing"

// Explain reads console text, the last lines a guest printed: panic is
// the kernel's panic message when the guest panicked ("" otherwise), and
// lines the n lines worth quoting: those leading up to the panic message
// (what the guest printed before it; the trace after it says little to a
// user), else the last n.
func Explain(console string, n int) (panic, lines string) {
	all := strings.Split(console, "\n")
	end := len(all)
	for i := len(all) - 1; i >= 0; i-- {
		if j := strings.Index(all[i], panicMark); j >= 0 {
			panic, end = strings.TrimSpace(all[i][j:]), i+1
			break
		}
	}
	return panic, strings.Join(all[max(end-n, 0):end], "\n")
}
