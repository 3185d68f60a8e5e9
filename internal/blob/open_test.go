package blob_test

import (
	"errors"
	"path/filepath"
	"testing"

	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/errdefs"
)

func TestOpenDir(t *testing.T) {
	root := t.TempDir()
	for _, spec := range []string{filepath.Join(root, "plain"), "dir:" + filepath.Join(root, "prefixed")} {
		st, err := blob.Open(t.Context(), spec)
		if err != nil {
			t.Fatalf("Open(%q): %v", spec, err)
		}
		if _, ok := st.(*blob.Dir); !ok {
			t.Fatalf("Open(%q) = %T, want *blob.Dir", spec, st)
		}
	}
}

func TestOpenBadSpecs(t *testing.T) {
	for _, spec := range []string{
		"",
		"dir:",
		"http://host/bucket",
		"s3://",
		"s3://bucket",
		"s3://bucket?endpoint=",
		"s3://bucket?endpoint=http://host:9000",
		"s3://bucket?endpoint=host:9000&insecure=maybe",
		"s3://bucket?endpoint=host:9000&colour=blue",
		"s3://user:pass@bucket?endpoint=host:9000",
		"s3://bucket/a//b?endpoint=host:9000",
	} {
		if _, err := blob.Open(t.Context(), spec); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Open(%q): %v, want invalid argument", spec, err)
		}
	}
}

func TestParseS3Spec(t *testing.T) {
	for _, tc := range []struct {
		spec string
		want blob.S3Config
	}{
		{"s3://b?endpoint=127.0.0.1:8333", blob.S3Config{Endpoint: "127.0.0.1:8333", Bucket: "b"}},
		{"s3://b/p/q/?endpoint=h:1&insecure=1&region=eu-west-1",
			blob.S3Config{Endpoint: "h:1", Bucket: "b", Prefix: "p/q", Region: "eu-west-1", Insecure: true}},
	} {
		got, err := blob.ParseS3Spec(tc.spec)
		if err != nil {
			t.Fatalf("ParseS3Spec(%q): %v", tc.spec, err)
		}
		if got != tc.want {
			t.Errorf("ParseS3Spec(%q) = %+v, want %+v", tc.spec, got, tc.want)
		}
	}
}

// TestStoreName: nodes sharing a store name it alike, whatever options
// they spell differently; a directory or a loopback endpoint is one
// machine's.
func TestStoreName(t *testing.T) {
	for _, tc := range []struct {
		a, b     string
		machines [2]string
		same     bool
	}{
		{"s3://b/p?endpoint=s3.example:9000", "s3://b/p/?endpoint=s3.example:9000&insecure=1&region=r", [2]string{"m1", "m2"}, true},
		{"s3://b/p?endpoint=s3.example:9000", "s3://b/q?endpoint=s3.example:9000", [2]string{"m1", "m1"}, false},
		{"s3://b?endpoint=127.0.0.1:8333", "s3://b?endpoint=127.0.0.1:8333", [2]string{"m1", "m1"}, true},
		{"s3://b?endpoint=127.0.0.1:8333", "s3://b?endpoint=127.0.0.1:8333", [2]string{"m1", "m2"}, false},
		{"s3://b?endpoint=localhost:8333", "s3://b?endpoint=localhost:8333", [2]string{"m1", "m2"}, false},
		{"/var/lib/dsec/blobstore", "dir:/var/lib/dsec/./blobstore", [2]string{"m1", "m1"}, true},
		{"/var/lib/dsec/blobstore", "/var/lib/dsec/blobstore", [2]string{"m1", "m2"}, false},
	} {
		a, b := blob.StoreName(tc.a, tc.machines[0]), blob.StoreName(tc.b, tc.machines[1])
		if (a == b) != tc.same {
			t.Errorf("StoreName(%q, %s) = %q, StoreName(%q, %s) = %q; same = %v, want %v",
				tc.a, tc.machines[0], a, tc.b, tc.machines[1], b, a == b, tc.same)
		}
	}
	if got := blob.StoreName("", "m1"); got != "" {
		t.Errorf(`StoreName("") = %q, want ""`, got)
	}
}
