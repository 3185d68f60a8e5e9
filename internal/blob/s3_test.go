package blob_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/blob/blobtest"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/testutil"
)

// testBucket holds every S3 test's objects, each test under its own prefix.
const testBucket = "dsec-blobtest"

// s3Config is the S3 server named by DSEC_TEST_S3 (host:port, plain HTTP;
// scripts/seaweedfs.sh starts one), with credentials from the AWS_
// variables if set.
func s3Config(t *testing.T, bucket, prefix string) blob.S3Config {
	t.Helper()
	endpoint := os.Getenv("DSEC_TEST_S3")
	testutil.Require(t, endpoint != "", "DSEC_TEST_S3 (host:port of an S3 server) is not set")
	return blob.S3Config{
		Endpoint:  endpoint,
		Bucket:    bucket,
		Prefix:    prefix,
		AccessKey: os.Getenv("AWS_ACCESS_KEY_ID"),
		SecretKey: os.Getenv("AWS_SECRET_ACCESS_KEY"),
		Insecure:  true,
	}
}

func randName(t *testing.T) string {
	t.Helper()
	b := make([]byte, 6)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// newS3 opens the test bucket under a fresh prefix and removes everything
// under that prefix when the test ends.
func newS3(t *testing.T) *blob.S3 {
	t.Helper()
	st, err := blob.NewS3(t.Context(), s3Config(t, testBucket, "test-"+randName(t)))
	if err != nil {
		t.Fatalf("NewS3: %v", err)
	}
	t.Cleanup(func() { emptyStore(t, st) })
	return st
}

func emptyStore(t *testing.T, st blob.Store) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var keys []string
	if err := st.List(ctx, "", func(key string, _ int64) error {
		keys = append(keys, key)
		return nil
	}); err != nil {
		t.Errorf("list objects to remove: %v", err)
	}
	for _, k := range keys {
		if err := st.Delete(ctx, k); err != nil {
			t.Errorf("remove %s: %v", k, err)
		}
	}
}

func TestS3(t *testing.T) {
	s3Config(t, testBucket, "") // skip (or fail) early without a server
	blobtest.Run(t, func(t *testing.T) blob.Store { return newS3(t) })
}

func TestS3PrefixesAreSeparate(t *testing.T) {
	a, b := newS3(t), newS3(t)
	if err := a.Put(t.Context(), "k", bytesReader("a"), 1); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Stat(t.Context(), "k"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Stat in another prefix: %v, want not found", err)
	}
}

func TestS3CreatesBucket(t *testing.T) {
	bucket := "dsec-blobtest-" + randName(t)
	st, err := blob.NewS3(t.Context(), s3Config(t, bucket, ""))
	if err != nil {
		t.Fatalf("NewS3 with a new bucket: %v", err)
	}
	t.Cleanup(func() {
		emptyStore(t, st)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := st.Client().RemoveBucket(ctx, bucket); err != nil {
			t.Errorf("remove bucket %s: %v", bucket, err)
		}
	})
	ok, err := st.Client().BucketExists(t.Context(), bucket)
	if err != nil || !ok {
		t.Fatalf("bucket %s exists = %v, %v", bucket, ok, err)
	}
	if err := st.Put(t.Context(), "k", bytesReader("v"), 1); err != nil {
		t.Fatal(err)
	}
	// Opening again finds the bucket.
	if _, err := blob.NewS3(t.Context(), s3Config(t, bucket, "")); err != nil {
		t.Fatalf("NewS3 with an existing bucket: %v", err)
	}
}

func TestS3Open(t *testing.T) {
	cfg := s3Config(t, testBucket, "test-"+randName(t))
	st, err := blob.Open(t.Context(), "s3://"+cfg.Bucket+"/"+cfg.Prefix+"?endpoint="+cfg.Endpoint+"&insecure=1")
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() { emptyStore(t, st) })
	if _, ok := st.(*blob.S3); !ok {
		t.Fatalf("Open = %T, want *blob.S3", st)
	}
	if err := st.Put(t.Context(), "k", bytesReader("v"), 1); err != nil {
		t.Fatal(err)
	}
}

func TestS3Unreachable(t *testing.T) {
	// A loopback port that was just closed refuses connections.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()

	start := time.Now()
	_, err = blob.NewS3(t.Context(), blob.S3Config{Endpoint: addr, Bucket: "dsec-unreachable", Insecure: true})
	if !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("NewS3 on a closed port: %v, want unavailable", err)
	}
	// Generous: the store gives up after about a second; this only catches
	// a store that hangs or retries for the default minutes.
	if d := time.Since(start); d > 20*time.Second {
		t.Fatalf("NewS3 on a closed port took %v", d)
	}
	t.Logf("unreachable store failed after %v: %v", time.Since(start), err)
}

func bytesReader(s string) *strings.Reader { return strings.NewReader(s) }
