# dsec build. `make` builds the three binaries into bin/; `make generate`
# regenerates the committed protobuf and Connect code under api/gen (it needs
# protoc and the well-known types: Debian's protobuf-compiler, libprotobuf-dev).
GO ?= go
BIN := bin
PROTOC_GEN_GO := google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
PROTOC_GEN_CONNECT := connectrpc.com/connect/cmd/protoc-gen-connect-go@v1.19.1

.PHONY: all build generate test clean

all: build

build:
	$(GO) build -o $(BIN)/dsecd ./cmd/dsecd
	$(GO) build -o $(BIN)/dsec ./cmd/dsec
	CGO_ENABLED=0 $(GO) build -ldflags '-s -w' -o $(BIN)/dsec-agent ./cmd/dsec-agent

generate:
	GOBIN=$(CURDIR)/$(BIN)/tools $(GO) install $(PROTOC_GEN_GO)
	GOBIN=$(CURDIR)/$(BIN)/tools $(GO) install $(PROTOC_GEN_CONNECT)
	rm -rf api/gen
	cd api && PATH=$(CURDIR)/$(BIN)/tools:$$PATH protoc -I . -I /usr/include \
		--go_out=. --go_opt=module=dsec.dev/dsec/api \
		--connect-go_out=. --connect-go_opt=module=dsec.dev/dsec/api \
		dsec/v1/dsec.proto dsec/v1/iam.proto dsec/agent/v1/agent.proto dsec/edge/v1/edge.proto \
		e2b/process/process.proto e2b/filesystem/filesystem.proto

test:
	./scripts/test.sh

clean:
	rm -rf $(BIN)
