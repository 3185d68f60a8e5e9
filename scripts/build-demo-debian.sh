#!/bin/sh
# build-demo-debian.sh [OUTDIR]
#
# Builds the demo's Debian base (scripts/build-debian-base.sh with the
# systems batch's tools: ip, nft, modprobe, mkfs.ext4) into OUTDIR, by
# default /var/cache/dsec/demo-debian, where scripts/demo.sh and
# scripts/bench-recording.sh look for it and which TestDemoRollouts imports
# when DSEC_DEMO_BASE_TREE names it (as CI sets, so its two passes share one
# debootstrap). The tree is built next to OUTDIR and renamed into place when
# finished, marked by OUTDIR/etc/dsec-demo-debian (its first line the layer
# the demo imports it as). Running it again with a finished OUTDIR does
# nothing.
set -eu

[ $# -le 1 ] || { echo "usage: $0 [OUTDIR]" >&2; exit 2; }
out=${1:-/var/cache/dsec/demo-debian}
out=${out%/}
here=$(cd "$(dirname "$0")" && pwd)

if [ -f "$out/etc/dsec-demo-debian" ]; then
	echo "== demo Debian base already built in $out" >&2
	exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
	echo "$0: must run as root (debootstrap)" >&2
	exit 1
fi
start=$(date +%s)
tmp=$out.build
rm -rf "$tmp"
mkdir -p "$(dirname "$out")"
EXTRA_PACKAGES=iproute2,nftables,kmod,e2fsprogs sh "$here/build-debian-base.sh" "$tmp" >/dev/null
echo "demo-debian:2" >"$tmp/etc/dsec-demo-debian"
rm -rf "$out"
mv "$tmp" "$out"
echo "== built in $(($(date +%s) - start))s: $(du -sh "$out" | cut -f1) in $out" >&2
