module dsec.dev/dsec/sdk/go

go 1.26.0

replace dsec.dev/dsec/api => ../../api

require (
	connectrpc.com/connect v1.19.1
	dsec.dev/dsec/api v0.0.0
	github.com/google/go-cmp v0.7.0
	google.golang.org/protobuf v1.36.12
)
