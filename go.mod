module dsec.dev/dsec

go 1.26.0

replace dsec.dev/dsec/api => ./api

require (
	connectrpc.com/connect v1.19.1
	dsec.dev/dsec/api v0.0.0
	github.com/creack/pty v1.1.24
	github.com/google/go-cmp v0.7.0
	github.com/google/uuid v1.6.0
	github.com/opencontainers/runtime-spec v1.2.1
	github.com/spf13/cobra v1.10.2
	golang.org/x/sys v0.50.0
	golang.org/x/term v0.48.0
	google.golang.org/protobuf v1.36.12
	modernc.org/sqlite v1.62.0
)

require (
	github.com/dustin/go-humanize v1.1.0 // indirect
	github.com/inconshreveable/mousetrap v1.1.0 // indirect
	github.com/mattn/go-isatty v0.0.24 // indirect
	github.com/ncruces/go-strftime v1.1.0 // indirect
	github.com/remyoudompheng/bigfft v0.0.0-20230129092748-24d4a6f8daec // indirect
	github.com/spf13/pflag v1.0.9 // indirect
	modernc.org/libc v1.80.1 // indirect
	modernc.org/mathutil v1.7.1 // indirect
	modernc.org/memory v1.12.1 // indirect
)
