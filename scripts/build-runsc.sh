#!/usr/bin/env bash
# build-runsc.sh [DIR]
#
# Builds gVisor's runsc from the gVisor Go module (its go-gettable branch,
# served by the Go module proxy) at the version pinned below, into DIR
# (default /var/cache/dsec/runsc): DIR/runsc, and DIR/VERSION naming the
# module version it was built from. Run again, it does nothing while
# DIR/VERSION names the pinned version. docs/gvisor.md says why this
# version and not Debian's runsc.
#
# Needs Go (the version gVisor's go.mod asks for or newer) and the module
# proxy; no C compiler (CGO_ENABLED=0).
set -euo pipefail

GVISOR_MODULE="gvisor.dev/gvisor"
GVISOR_VERSION="v0.0.0-20260905035102-160fafc42237"
. "$(dirname "$0")/lib/gomodule.sh"

usage() {
  echo "usage: $0 [DIR]" >&2
  exit 2
}
case "${1:-}" in -h | --help | -*) usage ;; esac
[ $# -le 1 ] || usage
out="${1:-/var/cache/dsec/runsc}"

if [ -x "$out/runsc" ] && [ "$(cat "$out/VERSION" 2>/dev/null)" = "$GVISOR_VERSION" ]; then
  echo "runsc already built: $out/runsc ($GVISOR_VERSION)"
  exit 0
fi
mkdir -p "$out"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
module_source "$GVISOR_MODULE" "$GVISOR_VERSION" "$tmp/src"
start=$(date +%s)
# runsc --version names the module version (it says VERSION_MISSING
# otherwise). Sidecar binaries (gvisor-bin/) are not built: this version's
# runsc runs its embedded copies when they are missing.
(cd "$tmp/src" && CGO_ENABLED=0 go build -trimpath \
  -ldflags "-X gvisor.dev/gvisor/runsc/version.version=go-$GVISOR_VERSION" \
  -o "$tmp/runsc" ./runsc)
"$tmp/runsc" --version >/dev/null
rm -f "$out/VERSION"
mv "$tmp/runsc" "$out/runsc.tmp"
mv "$out/runsc.tmp" "$out/runsc"
echo "$GVISOR_VERSION" >"$out/VERSION"
echo "built $out/runsc ($GVISOR_VERSION) in $(($(date +%s) - start)) s"
