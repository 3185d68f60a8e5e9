#!/usr/bin/env bash
# Runs every dsec test: Go unit and end-to-end suites, the Go SDK's and the
# Python SDK's. Root-only tests skip unless run as root; with DSEC_TEST_ROOT=1
# (as CI sets) they fail instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/go/bin"

make build
export DSEC_BIN_DIR="$PWD/bin"

status=0
echo "== go vet"
go vet ./... || status=1
echo "== go test (dsec)"
# Every package of the module but the Go SDK, whose live tests start a dsecd
# of their own: it runs last, alone.
go test -count=1 -timeout 45m $(go list ./... | grep -vx 'dsec.dev/dsec/sdk/go') || status=1
# The same end-to-end suites again, through a cluster of one: dsecd edge
# behind dsecd apiserver, mutual TLS and a token between them and the tests.
echo "== go test (end-to-end suites through a cluster: apiserver -> edge)"
DSEC_TEST_CLUSTER=1 go test -count=1 -timeout 30m ./test/root || status=1
echo "== go test (sdk/go)"
go test -count=1 -timeout 20m ./sdk/go || status=1
if [ -d sdk/python/tests ]; then
  echo "== python unittest (sdk/python)"
  python3 -m unittest discover -s sdk/python/tests -t sdk/python -v || status=1
fi
exit $status
