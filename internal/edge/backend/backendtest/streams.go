package backendtest

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/md5"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
)

// inflightStreams are the streams other than a command's that a pause
// must not cut: a PTY shell, a download and a directory watch, each
// opened as the edge opens it (agentclient's re-attaching and resuming
// wrappers, which a microVM paused to disk needs: its channel ends).
type inflightStreams struct {
	sb       *sandbox
	shell    func() result
	input    func() // sends the shell a line, which it reads after counting
	download *inflightDownload
	watch    *inflightWatch
}

// startStreams opens the streams; the shell has printed its first line,
// the download sent its first chunk (and waits to be read on), the watch
// is set.
func (sb *sandbox) startStreams(t *testing.T) *inflightStreams {
	t.Helper()
	s := &inflightStreams{sb: sb}
	s.shell, s.input = sb.inflightShell(t)
	s.download = sb.startDownload(t, "/dev/shm/state")
	s.watch = sb.startWatch(t, "/tmp/watched")
	return s
}

// check checks, once the sandbox was resumed, that each stream carried on:
// the shell's output whole and in order (with the line sent after the
// resume read), the download's file whole (md5sum's line shmSum), and a
// file made in the watched directory seen.
func (s *inflightStreams) check(t *testing.T, when, shmSum string) {
	t.Helper()
	id := s.sb.spec.ID
	s.input()
	r := s.shell()
	var lines []string
	for l := range strings.SplitSeq(strings.ReplaceAll(r.stdout, "\r", ""), "\n") {
		if l != "" && l != "hi" { // the terminal echoes the input as it comes
			lines = append(lines, l)
		}
	}
	var want []string
	for i := 1; i <= inflightLines; i++ {
		want = append(want, fmt.Sprint(i))
	}
	want = append(want, "got-hi")
	if r.err != nil || strings.Join(lines, ",") != strings.Join(want, ",") || r.exited.GetExitCode() != 0 {
		t.Errorf("%s: a shell in flight %s: %s; want 1 to %d, got-hi and exit 0", id, when, r, inflightLines)
	}
	if sum, err := s.download.finish(); err != nil {
		t.Errorf("%s: a download in flight %s: %v", id, when, err)
	} else if want, _, _ := strings.Cut(shmSum, " "); sum != want {
		t.Errorf("%s: a download in flight %s: md5 %s, want %s", id, when, sum, want)
	}
	if err := s.watch.seesNew(s.sb); err != nil {
		t.Errorf("%s: a watch set before a pause, %s: %v", id, when, err)
	}
}

// inflightShell starts a PTY shell counting 1 to inflightLines, one a
// 0.2 s, then reading a line and printing it, waits for its first line,
// and returns a wait for the rest of its stream and the input's send.
func (sb *sandbox) inflightShell(t *testing.T) (wait func() result, input func()) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*commandWithin)
	s := agentclient.ReattachingShell(ctx, sb.c.Shell, nil)
	command := fmt.Sprintf("for i in $(seq 1 %d); do echo $i; sleep 0.2; done; read x; echo got-$x", inflightLines)
	if err := s.Send(&dsecv1.ShellInput{Input: &dsecv1.ShellInput_Start{Start: &dsecv1.ShellStart{
		Argv: []string{"/bin/sh", "-c", command}, Size: &dsecv1.TerminalSize{Rows: 24, Cols: 80}}}}); err != nil {
		cancel()
		t.Fatalf("%s: start a shell: %v", sb.spec.ID, err)
	}
	first := make(chan struct{})
	done := make(chan result, 1)
	go func() {
		defer cancel()
		defer s.CloseResponse()
		var r result
		var out strings.Builder
		for {
			msg, err := s.Receive()
			if err != nil {
				if !errors.Is(err, io.EOF) {
					r.err = err
				}
				break
			}
			if out.Len() == 0 && len(msg.GetData()) > 0 {
				close(first)
			}
			out.Write(msg.GetData())
			if e := msg.GetExited(); e != nil {
				r.exited = e
			}
		}
		r.stdout = out.String()
		done <- r
	}()
	select {
	case <-first:
	case r := <-done:
		t.Fatalf("%s: a shell ended before its first line: %s", sb.spec.ID, r)
	}
	input = func() {
		if err := s.Send(&dsecv1.ShellInput{Input: &dsecv1.ShellInput_Data{Data: []byte("hi\n")}}); err != nil {
			t.Errorf("%s: send a shell a line: %v", sb.spec.ID, err)
		}
	}
	return func() result { return <-done }, input
}

// inflightDownload is a download whose stream has given its first chunk
// and is read on only at finish.
type inflightDownload struct {
	path   string
	s      agentclient.Stream[dsecv1.DownloadChunk]
	buf    bytes.Buffer
	cancel context.CancelFunc
}

func (sb *sandbox) startDownload(t *testing.T, path string) *inflightDownload {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*commandWithin)
	s, err := agentclient.ResumingDownload(ctx, sb.c.Download, &dsecv1.DownloadRequest{Path: path})
	if err != nil {
		cancel()
		t.Fatalf("%s: download %s: %v", sb.spec.ID, path, err)
	}
	d := &inflightDownload{path: path, s: s, cancel: cancel}
	if !s.Receive() {
		cancel()
		t.Fatalf("%s: download %s: no first chunk: %v", sb.spec.ID, path, s.Err())
	}
	d.buf.Write(s.Msg().GetData())
	return d
}

// finish reads the rest of the download and returns the MD5 of the file
// in its tar stream.
func (d *inflightDownload) finish() (string, error) {
	defer d.cancel()
	defer d.s.Close()
	for d.s.Receive() {
		d.buf.Write(d.s.Msg().GetData())
	}
	if err := d.s.Err(); err != nil {
		return "", fmt.Errorf("after %d bytes: %w", d.buf.Len(), err)
	}
	tr := tar.NewReader(&d.buf)
	if _, err := tr.Next(); err != nil {
		return "", fmt.Errorf("read the tar stream: %w", err)
	}
	h := md5.New()
	if _, err := io.Copy(h, tr); err != nil {
		return "", fmt.Errorf("read the tar stream: %w", err)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// inflightWatch is a watch whose events are read in the background.
type inflightWatch struct {
	dir    string
	events chan *dsecv1.WatchEvent // closed at the stream's end
	err    error                   // the stream's, once events is closed
	cancel context.CancelFunc
}

func (sb *sandbox) startWatch(t *testing.T, dir string) *inflightWatch {
	t.Helper()
	sb.must(t, "mkdir -p "+dir)
	ctx, cancel := context.WithTimeout(context.Background(), 2*commandWithin)
	t.Cleanup(cancel)
	s, err := agentclient.Rewatching(ctx, sb.c.WatchDir, &dsecv1.WatchDirRequest{Path: dir})
	if err != nil {
		t.Fatalf("%s: watch %s: %v", sb.spec.ID, dir, err)
	}
	if !s.Receive() || !s.Msg().GetStarted() {
		t.Fatalf("%s: watch %s: no started event: %v", sb.spec.ID, dir, s.Err())
	}
	w := &inflightWatch{dir: dir, events: make(chan *dsecv1.WatchEvent, 64), cancel: cancel}
	go func() {
		defer close(w.events)
		defer s.Close()
		for s.Receive() {
			w.events <- s.Msg()
		}
		w.err = s.Err()
	}()
	return w
}

// seesNew makes files in the watched directory, one every 0.2 s (a watch
// set again after a microVM's resume is set a moment later), until the
// watch reports one, and ends the watch.
func (w *inflightWatch) seesNew(sb *sandbox) error {
	defer w.cancel()
	deadline := time.After(commandWithin)
	for i := 0; ; i++ {
		if r := sb.exec(fmt.Sprintf("touch %s/new%d", w.dir, i)); !r.ok() {
			return fmt.Errorf("touch a file: %s", r)
		}
		select {
		case ev, ok := <-w.events:
			if !ok {
				return fmt.Errorf("the watch ended: %v", w.err)
			}
			if strings.HasPrefix(ev.GetName(), "new") {
				return nil
			}
		case <-time.After(200 * time.Millisecond):
		case <-deadline:
			return fmt.Errorf("no event within %s of making files", commandWithin)
		}
	}
}
