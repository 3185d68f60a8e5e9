package blob

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"strings"

	"dsec.dev/dsec/internal/errdefs"
)

// Open opens the store a spec names:
//
//	/var/lib/dsec/blobs      a directory (any spec without a scheme)
//	dir:/var/lib/dsec/blobs  a directory
//	s3://BUCKET[/PREFIX]?endpoint=HOST:PORT&insecure=1&region=R
//
// S3 credentials come from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY when
// set; requests are anonymous otherwise. insecure=1 means plain HTTP.
func Open(ctx context.Context, spec string) (Store, error) {
	switch {
	case spec == "":
		return nil, fmt.Errorf("open blob store: empty spec: %w", errdefs.ErrInvalidArgument)
	case strings.HasPrefix(spec, "dir:"):
		return NewDir(strings.TrimPrefix(spec, "dir:"))
	case strings.HasPrefix(spec, "s3://"):
		cfg, err := ParseS3Spec(spec)
		if err != nil {
			return nil, err
		}
		cfg.AccessKey = os.Getenv("AWS_ACCESS_KEY_ID")
		cfg.SecretKey = os.Getenv("AWS_SECRET_ACCESS_KEY")
		return NewS3(ctx, cfg)
	case strings.Contains(spec, "://"):
		return nil, fmt.Errorf("open blob store %q: unknown scheme (want a directory, dir:PATH or s3://BUCKET): %w",
			spec, errdefs.ErrInvalidArgument)
	}
	return NewDir(spec)
}

// ParseS3Spec parses s3://BUCKET[/PREFIX]?endpoint=HOST:PORT&insecure=1&region=R
// into a config without credentials.
func ParseS3Spec(spec string) (S3Config, error) {
	bad := func(format string, args ...any) (S3Config, error) {
		return S3Config{}, fmt.Errorf("parse blob store %q: %s: %w", spec, fmt.Sprintf(format, args...), errdefs.ErrInvalidArgument)
	}
	u, err := url.Parse(spec)
	if err != nil {
		return bad("%v", err)
	}
	if u.Scheme != "s3" {
		return bad("scheme %q is not s3", u.Scheme)
	}
	if u.User != nil {
		return bad("credentials belong in AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, not the spec")
	}
	if u.Host == "" {
		return bad("no bucket (want s3://BUCKET[/PREFIX]?endpoint=HOST:PORT)")
	}
	cfg := S3Config{Bucket: u.Host, Prefix: strings.Trim(u.Path, "/")}
	q := u.Query()
	for k := range q {
		switch k {
		case "endpoint", "insecure", "region":
		default:
			return bad("unknown parameter %q (want endpoint, insecure, region)", k)
		}
	}
	cfg.Endpoint = q.Get("endpoint")
	if cfg.Endpoint == "" {
		return bad("no endpoint (add ?endpoint=HOST:PORT)")
	}
	if strings.Contains(cfg.Endpoint, "/") {
		return bad("endpoint %q must be HOST:PORT without a scheme or path", cfg.Endpoint)
	}
	switch q.Get("insecure") {
	case "", "0", "false":
	case "1", "true":
		cfg.Insecure = true
	default:
		return bad("insecure=%q (want 1 or 0)", q.Get("insecure"))
	}
	cfg.Region = q.Get("region")
	if cfg.Prefix != "" {
		if err := CheckKey(cfg.Prefix); err != nil {
			return bad("prefix %q: %v", cfg.Prefix, err)
		}
	}
	return cfg, nil
}

// StoreName names the store spec opens so that two nodes sharing a store
// name it alike and two nodes that do not, differently: S3 by endpoint,
// bucket and prefix; a directory by its absolute path. A directory, or an
// endpoint on loopback, is this machine's own, so its name carries
// machine (an ID of the host): /var/lib/dsec/blobstore on two machines is
// two stores. A spec Open refuses is named as it is.
func StoreName(spec, machine string) string {
	local := func(name string) string { return name + " on " + machine }
	switch {
	case spec == "":
		return ""
	case strings.HasPrefix(spec, "s3://"):
		cfg, err := ParseS3Spec(spec)
		if err != nil {
			return spec
		}
		name := "s3://" + cfg.Bucket + "/" + cfg.Prefix + "?endpoint=" + cfg.Endpoint
		host, _, err := net.SplitHostPort(cfg.Endpoint)
		if err != nil {
			host = cfg.Endpoint
		}
		if ip, err := netip.ParseAddr(host); host == "localhost" || (err == nil && ip.IsLoopback()) {
			return local(name)
		}
		return name
	case strings.Contains(spec, "://"):
		return spec
	}
	dir, err := filepath.Abs(strings.TrimPrefix(spec, "dir:"))
	if err != nil {
		return local(spec)
	}
	return local("dir:" + dir)
}
