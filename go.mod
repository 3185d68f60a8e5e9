module dsec.dev/dsec

go 1.26.0

replace dsec.dev/dsec/api => ./api

require dsec.dev/dsec/api v0.0.0

require (
	connectrpc.com/connect v1.19.1 // indirect
	golang.org/x/sys v0.50.0 // indirect
	google.golang.org/protobuf v1.36.12 // indirect
)
