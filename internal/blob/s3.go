package blob

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"

	"dsec.dev/dsec/internal/errdefs"
)

// S3 retry and timeout bounds: a request to an unreachable store gives up
// after s3MaxRetries attempts (with minio's short backoff between them),
// each dial taking at most s3DialTimeout, so it fails within a few seconds.
const (
	s3MaxRetries     = 3
	s3DialTimeout    = 2 * time.Second
	s3HeaderTimeout  = 30 * time.Second
	s3DefaultRegion  = "us-east-1"
	s3ConnectTimeout = 5 * time.Second
)

// S3Config says where an S3 store lives. Empty AccessKey and SecretKey mean
// anonymous requests; Insecure means plain HTTP instead of HTTPS.
type S3Config struct {
	Endpoint  string // host:port
	Bucket    string
	Prefix    string // prepended (with a slash) to every key
	AccessKey string
	SecretKey string
	Region    string // default us-east-1
	Insecure  bool
}

// S3 is a Store in a bucket of an S3-compatible server, under an optional
// key prefix.
type S3 struct {
	client *minio.Client
	core   minio.Core
	bucket string
	prefix string // "" or ends in "/"
}

var _ Store = (*S3)(nil)

// NewS3 connects to the S3 server in cfg and creates the bucket if it is
// missing. An unreachable server is an error wrapping errdefs.ErrUnavailable.
func NewS3(ctx context.Context, cfg S3Config) (*S3, error) {
	if cfg.Endpoint == "" || cfg.Bucket == "" {
		return nil, fmt.Errorf("open s3 store: endpoint and bucket are required: %w", errdefs.ErrInvalidArgument)
	}
	prefix := strings.Trim(cfg.Prefix, "/")
	if prefix != "" {
		if err := CheckKey(prefix); err != nil {
			return nil, fmt.Errorf("open s3 store: prefix: %w", err)
		}
		prefix += "/"
	}
	region := cfg.Region
	if region == "" {
		region = s3DefaultRegion
	}
	tr, err := minio.DefaultTransport(!cfg.Insecure)
	if err != nil {
		return nil, fmt.Errorf("open s3 store %s: %w", cfg.Endpoint, err)
	}
	tr.DialContext = (&net.Dialer{Timeout: s3DialTimeout, KeepAlive: 30 * time.Second}).DialContext
	tr.ResponseHeaderTimeout = s3HeaderTimeout
	client, err := minio.New(cfg.Endpoint, &minio.Options{
		Creds:      credentials.NewStaticV4(cfg.AccessKey, cfg.SecretKey, ""),
		Secure:     !cfg.Insecure,
		Transport:  tr,
		Region:     region,
		MaxRetries: s3MaxRetries,
	})
	if err != nil {
		return nil, fmt.Errorf("open s3 store %s: %w: %w", cfg.Endpoint, errdefs.ErrInvalidArgument, err)
	}
	s := &S3{client: client, core: minio.Core{Client: client}, bucket: cfg.Bucket, prefix: prefix}

	cctx, cancel := context.WithTimeout(ctx, s3ConnectTimeout)
	defer cancel()
	ok, err := client.BucketExists(cctx, cfg.Bucket)
	if err != nil {
		return nil, fmt.Errorf("open s3 store %s/%s: %w", cfg.Endpoint, cfg.Bucket, s.mapErr(ctx, err))
	}
	if !ok {
		err := client.MakeBucket(cctx, cfg.Bucket, minio.MakeBucketOptions{Region: region})
		if err != nil {
			code := minio.ToErrorResponse(err).Code
			if code != "BucketAlreadyOwnedByYou" && code != "BucketAlreadyExists" {
				return nil, fmt.Errorf("create bucket %s/%s: %w", cfg.Endpoint, cfg.Bucket, s.mapErr(ctx, err))
			}
		}
	}
	return s, nil
}

// Client is the underlying minio client, for tests and tools.
func (s *S3) Client() *minio.Client { return s.client }

func (s *S3) object(key string) (string, error) {
	if err := CheckKey(key); err != nil {
		return "", err
	}
	return s.prefix + key, nil
}

// Put uploads the object in one request (or a multipart upload for large
// or unsized objects); S3 publishes it only once complete.
func (s *S3) Put(ctx context.Context, key string, r io.Reader, size int64) error {
	obj, err := s.object(key)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("put %s: %w", key, err)
	}
	var body io.Reader = &ctxReader{ctx: ctx, r: r}
	if size >= 0 {
		// A short reader must fail the upload, not pad or hang it.
		body = &exactReader{r: body, left: size}
	}
	_, err = s.client.PutObject(ctx, s.bucket, obj, body, size, minio.PutObjectOptions{
		ContentType: "application/octet-stream",
	})
	if err != nil {
		return fmt.Errorf("put %s: %w", key, s.mapErr(ctx, err))
	}
	return nil
}

// exactReader returns io.ErrUnexpectedEOF if r ends before left bytes.
type exactReader struct {
	r    io.Reader
	left int64
}

func (e *exactReader) Read(p []byte) (int, error) {
	if e.left <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > e.left {
		p = p[:e.left]
	}
	n, err := e.r.Read(p)
	e.left -= int64(n)
	if err == io.EOF && e.left > 0 {
		err = io.ErrUnexpectedEOF
	}
	return n, err
}

// Get opens the whole object.
func (s *S3) Get(ctx context.Context, key string) (io.ReadCloser, error) {
	return s.GetRange(ctx, key, 0, -1)
}

// GetRange opens length bytes from offset; a range running past the end is
// cut at the end, an offset past the end is an invalid argument.
func (s *S3) GetRange(ctx context.Context, key string, offset, length int64) (io.ReadCloser, error) {
	obj, err := s.object(key)
	if err != nil {
		return nil, err
	}
	if offset < 0 {
		return nil, fmt.Errorf("get %s: offset %d: %w", key, offset, errdefs.ErrInvalidArgument)
	}
	if length == 0 {
		// S3 cannot express an empty range; check the object exists.
		size, err := s.Stat(ctx, key)
		if err != nil {
			return nil, err
		}
		if offset > size {
			return nil, fmt.Errorf("get %s: offset %d outside object of %d bytes: %w", key, offset, size, errdefs.ErrInvalidArgument)
		}
		return io.NopCloser(bytes.NewReader(nil)), nil
	}
	var opts minio.GetObjectOptions
	switch {
	case length > 0:
		err = opts.SetRange(offset, offset+length-1)
	case offset > 0:
		err = opts.SetRange(offset, 0)
	}
	if err != nil {
		return nil, fmt.Errorf("get %s: %w: %w", key, errdefs.ErrInvalidArgument, err)
	}
	body, _, _, err := s.core.GetObject(ctx, s.bucket, obj, opts)
	if err != nil {
		if minio.ToErrorResponse(err).StatusCode == http.StatusRequestedRangeNotSatisfiable {
			// S3 refuses any range starting at the end, even of an empty
			// object; that is an empty read, like reading a file at EOF.
			size, serr := s.Stat(ctx, key)
			if serr != nil {
				return nil, serr
			}
			if offset == size {
				return io.NopCloser(bytes.NewReader(nil)), nil
			}
			return nil, fmt.Errorf("get %s: offset %d outside object of %d bytes: %w", key, offset, size, errdefs.ErrInvalidArgument)
		}
		return nil, fmt.Errorf("get %s: %w", key, s.mapErr(ctx, err))
	}
	return &ctxReadCloser{ctxReader: ctxReader{ctx: ctx, r: body}, c: body}, nil
}

// Stat returns the object's size.
func (s *S3) Stat(ctx context.Context, key string) (int64, error) {
	obj, err := s.object(key)
	if err != nil {
		return 0, err
	}
	info, err := s.client.StatObject(ctx, s.bucket, obj, minio.StatObjectOptions{})
	if err != nil {
		return 0, fmt.Errorf("stat %s: %w", key, s.mapErr(ctx, err))
	}
	return info.Size, nil
}

// Delete removes the object; S3 does not report missing keys.
func (s *S3) Delete(ctx context.Context, key string) error {
	obj, err := s.object(key)
	if err != nil {
		return err
	}
	err = s.client.RemoveObject(ctx, s.bucket, obj, minio.RemoveObjectOptions{})
	if err != nil && !errors.Is(s.mapErr(ctx, err), errdefs.ErrNotFound) {
		return fmt.Errorf("delete %s: %w", key, s.mapErr(ctx, err))
	}
	return nil
}

// List calls fn for every key starting with prefix, in S3's (lexical) order.
func (s *S3) List(ctx context.Context, prefix string, fn func(key string, size int64) error) error {
	lctx, cancel := context.WithCancel(ctx)
	defer cancel() // stops minio's listing goroutine when fn stops early
	for info := range s.client.ListObjects(lctx, s.bucket, minio.ListObjectsOptions{
		Prefix:    s.prefix + prefix,
		Recursive: true,
	}) {
		if info.Err != nil {
			return fmt.Errorf("list %q: %w", prefix, s.mapErr(ctx, info.Err))
		}
		if err := fn(strings.TrimPrefix(info.Key, s.prefix), info.Size); err != nil {
			return err
		}
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("list %q: %w", prefix, err)
	}
	return nil
}

// mapErr turns minio and network errors into errdefs kinds, keeping the
// original message.
func (s *S3) mapErr(ctx context.Context, err error) error {
	if ctx.Err() != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
		return err
	}
	resp := minio.ToErrorResponse(err)
	switch {
	case resp.Code == "NoSuchKey" || resp.Code == "NoSuchBucket" || resp.StatusCode == http.StatusNotFound:
		return fmt.Errorf("%w: %w", errdefs.ErrNotFound, err)
	case resp.Code == "AccessDenied" || resp.StatusCode == http.StatusForbidden:
		return fmt.Errorf("%w: %w", errdefs.ErrPermissionDenied, err)
	case resp.Code == "InvalidAccessKeyId" || resp.Code == "SignatureDoesNotMatch":
		return fmt.Errorf("%w: %w", errdefs.ErrUnauthenticated, err)
	case resp.Code == "InvalidBucketName" || resp.Code == "XMinioInvalidObjectName" || resp.Code == "InvalidArgument":
		return fmt.Errorf("%w: %w", errdefs.ErrInvalidArgument, err)
	case resp.StatusCode >= 500:
		return fmt.Errorf("%w: %w", errdefs.ErrUnavailable, err)
	case resp.StatusCode != 0 || resp.Code != "":
		return err
	}
	var netErr net.Error
	var opErr *net.OpError
	if errors.As(err, &netErr) || errors.As(err, &opErr) || errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%w: %w", errdefs.ErrUnavailable, err)
	}
	return err
}
