package e2b

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/testing/protocmp"
	"google.golang.org/protobuf/types/known/timestamppb"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	fspb "dsec.dev/dsec/api/gen/e2b/filesystem"
)

func TestEntryInfo(t *testing.T) {
	names := &idNames{users: map[uint32]string{0: "root", 1000: "user"}, groups: map[uint32]string{0: "root", 1000: "user"}}
	mtime := time.UnixMilli(1_700_000_000_123)
	str := func(s string) *string { return &s }
	for _, tc := range []struct {
		name     string
		p        string
		fi       *dsecv1.FileInfo
		destPath string
		dest     *dsecv1.FileInfo
		want     *fspb.EntryInfo
	}{
		{"file", "/home/user/a.txt", &dsecv1.FileInfo{Name: "a.txt", Type: "file", Size: 5, Mode: 0o644, Uid: 1000, Gid: 1000, MtimeUnixMs: mtime.UnixMilli()}, "", nil,
			&fspb.EntryInfo{Name: "a.txt", Type: fspb.FileType_FILE_TYPE_FILE, Path: "/home/user/a.txt", Size: 5, Mode: 0o644, Permissions: "-rw-r--r--",
				Owner: "user", Group: "user", ModifiedTime: timestamppb.New(mtime)}},
		{"dir", "/tmp", &dsecv1.FileInfo{Type: "dir", Size: 4096, Mode: 0o1777}, "", nil,
			&fspb.EntryInfo{Name: "tmp", Type: fspb.FileType_FILE_TYPE_DIRECTORY, Path: "/tmp", Size: 4096, Mode: 0o777, Permissions: "dtrwxrwxrwx",
				Owner: "root", Group: "root"}},
		{"setuid and an unknown owner", "/bin/su", &dsecv1.FileInfo{Type: "file", Mode: 0o4755, Uid: 4242, Gid: 4343}, "", nil,
			&fspb.EntryInfo{Name: "su", Type: fspb.FileType_FILE_TYPE_FILE, Path: "/bin/su", Mode: 0o755, Permissions: "urwxr-xr-x", Owner: "4242", Group: "4343"}},
		{"symlink to a directory", "/home/user/l", &dsecv1.FileInfo{Type: "symlink", Mode: 0o777, Size: 4, LinkTarget: "d"}, "/home/user/d", &dsecv1.FileInfo{Type: "dir", Mode: 0o750},
			&fspb.EntryInfo{Name: "l", Type: fspb.FileType_FILE_TYPE_DIRECTORY, Path: "/home/user/l", Size: 4, Mode: 0o750, Permissions: "Lrwxrwxrwx",
				Owner: "root", Group: "root", SymlinkTarget: str("/home/user/d")}},
		{"broken symlink", "/home/user/b", &dsecv1.FileInfo{Type: "symlink", Mode: 0o777, LinkTarget: "nope"}, "/home/user/nope", nil,
			&fspb.EntryInfo{Name: "b", Type: fspb.FileType_FILE_TYPE_UNSPECIFIED, Path: "/home/user/b", Permissions: "Lrwxrwxrwx",
				Owner: "root", Group: "root", SymlinkTarget: str("/home/user/nope")}},
		{"a fifo", "/run/f", &dsecv1.FileInfo{Type: "other", Mode: 0o600}, "", nil,
			&fspb.EntryInfo{Name: "f", Type: fspb.FileType_FILE_TYPE_UNSPECIFIED, Path: "/run/f", Mode: 0o600, Permissions: "?rw-------", Owner: "root", Group: "root"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := entryInfo(tc.p, tc.fi, tc.destPath, tc.dest, names)
			if d := cmp.Diff(tc.want, got, protocmp.Transform()); d != "" {
				t.Errorf("entryInfo (-want +got):\n%s", d)
			}
		})
	}
}

func TestPermissionStrings(t *testing.T) {
	for _, tc := range []struct {
		typ  string
		mode uint32
		want string
	}{
		{"file", 0o644, "-rw-r--r--"},
		{"file", 0o600, "-rw-------"},
		{"file", 0o755, "-rwxr-xr-x"},
		{"dir", 0o755, "drwxr-xr-x"},
		{"dir", 0o2775, "dgrwxrwxr-x"},
		{"symlink", 0o777, "Lrwxrwxrwx"},
		{"file", 0, "----------"},
	} {
		if got := fileMode(&dsecv1.FileInfo{Type: tc.typ, Mode: tc.mode}).String(); got != tc.want {
			t.Errorf("%s %o: %q, want %q", tc.typ, tc.mode, got, tc.want)
		}
	}
}

func TestParseIDFile(t *testing.T) {
	got := parseIDFile("root:x:0:0:root:/root:/bin/bash\n# a comment\nbroken\nuser:x:1000:1000::/home/user:/bin/bash\nalias:x:1000:1000::/:/bin/sh\nbad:x:nan:1::/:/bin/sh\n")
	want := map[uint32]string{0: "root", 1000: "user"}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("parseIDFile (-want +got):\n%s", d)
	}
}

func TestAbs(t *testing.T) {
	for _, tc := range []struct {
		user, p, want string
	}{
		{"", "a.txt", "/home/user/a.txt"},
		{"", "", "/home/user"},
		{"root", "x/../y", "/root/y"},
		{"", "~/d/", "/home/user/d"},
		{"", "~", "/home/user"},
		{"", "/etc/../../tmp", "/tmp"},
	} {
		if got := abs(target{User: tc.user}, tc.p); got != tc.want {
			t.Errorf("abs(%q, %q) = %q, want %q", tc.user, tc.p, got, tc.want)
		}
	}
}

func TestCheckSigned(t *testing.T) {
	tok := NewSigner([]byte("0123456789abcdef0123456789abcdef")).AccessToken("sb-t1-1")
	now := time.Unix(1_800_000_000, 0)
	exp := now.Unix() + 60
	sig := FileSignature("a.txt", "read", "", tok, 0)
	sigExp := FileSignature("a.txt", "read", "user", tok, exp)
	for _, tc := range []struct {
		name                      string
		sig, exp, p, op, user, tk string
		at                        time.Time
		ok                        bool
	}{
		{"plain", sig, "", "a.txt", "read", "", tok, now, true},
		{"another path", sig, "", "b.txt", "read", "", tok, now, false},
		{"a write with a read signature", sig, "", "a.txt", "write", "", tok, now, false},
		{"another user", sig, "", "a.txt", "read", "root", tok, now, false},
		{"another sandbox", sig, "", "a.txt", "read", "", NewSigner([]byte("0123456789abcdef0123456789abcdeX")).AccessToken("sb-t1-1"), now, false},
		{"with expiry", sigExp, "1800000060", "a.txt", "read", "user", tok, now, true},
		{"expired", sigExp, "1800000060", "a.txt", "read", "user", tok, now.Add(2 * time.Minute), false},
		{"expiry moved", sigExp, "1800009999", "a.txt", "read", "user", tok, now, false},
		{"expiry dropped", sigExp, "", "a.txt", "read", "user", tok, now, false},
		{"expiry not a number", sigExp, "soon", "a.txt", "read", "user", tok, now, false},
		{"empty", "", "", "a.txt", "read", "", tok, now, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := checkSigned(tc.sig, tc.exp, tc.p, tc.op, tc.user, tc.tk, tc.at)
			if (err == nil) != tc.ok {
				t.Errorf("checkSigned: %v, want ok=%v", err, tc.ok)
			}
		})
	}
}

func TestPartFileName(t *testing.T) {
	for in, want := range map[string]string{
		`form-data; name="file"; filename="dir/sub/a.txt"`: "dir/sub/a.txt",
		`form-data; name="file"; filename="/abs/b"`:        "/abs/b",
		`form-data; name="file"`:                           "",
		`garbage;;`:                                        "",
	} {
		if got := partFileName(in); got != want {
			t.Errorf("partFileName(%q) = %q, want %q", in, got, want)
		}
	}
}
