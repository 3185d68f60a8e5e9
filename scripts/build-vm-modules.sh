#!/bin/sh
# build-vm-modules.sh [--import] [OUTDIR]
#
# Builds a layer holding more of the microVM guest kernel's modules, for
# sandboxes whose work is the kernel's: root in a microvm sandbox may load a
# module, but the guest kernel directory (scripts/build-vm-kernel.sh) holds
# only what the guest's init loads to boot, and a sandbox's root has no
# /lib/modules of the guest kernel. This tree is one:
#
#   OUTDIR/usr/lib/modules/VERSION/   MODULES below and what they depend
#                                     on, uncompressed, with depmod's
#                                     indexes, so `modprobe veth` works in
#                                     the guest (kmod in the sandbox's base
#                                     layer) and `insmod FILE` without it
#
# The tree is under usr/, for a base with a merged /usr (Debian 12, Ubuntu
# 20.04 and later), where /lib is a symlink to usr/lib: a layer holding a
# directory lib/ would hide that symlink, and with it the base's libraries.
#
# VERSION and the package are those of the guest kernel directory's
# manifest ($DSEC_VM_KERNEL_DIR, default /var/cache/dsec/vm-kernel), so the
# modules match the kernel the guests boot: the same Debian package is
# downloaded again (about 70 MB; apt-get download, nothing installed) and
# unpacked in a temporary directory. OUTDIR defaults to
# /var/cache/dsec/vm-modules; a finished tree is marked by
# OUTDIR/usr/lib/modules/VERSION/dsec-vm-modules, and running the script again
# for the same kernel does nothing (another kernel's tree is replaced).
#
# The guest cannot load modules on demand (the kernel's modprobe helper runs
# in the guest's initramfs, not in the sandbox's root): load them by name.
#
# With --import, the tree is imported into the running dsecd as the toolkit
# layer vm-modules:VERSION (skipped when `dsec layer ls` lists it already;
# set DSEC to the dsec binary, default bin/dsec, and DSEC_ADDR as usual):
#
#   sudo scripts/build-vm-modules.sh --import
#   dsec create --isolation microvm debian:12+vm-modules:6.1.0-57-amd64
set -eu

usage() {
	echo "usage: $0 [--import] [OUTDIR]" >&2
	exit 2
}

import=0
case ${1:-} in
--import) import=1; shift ;;
-h|--help) usage ;;
-*) usage ;;
esac
[ $# -le 1 ] || usage
out=${1:-/var/cache/dsec/vm-modules}
kdir=${DSEC_VM_KERNEL_DIR:-/var/cache/dsec/vm-kernel}

# Network devices, netfilter (nftables, and iptables over it), traffic
# control, loop and RAM block devices, and file systems a task may mount.
MODULES="veth dummy bridge tun macvlan ipvlan vxlan 8021q wireguard
nf_tables nft_ct nft_nat nft_masq nft_reject_inet nft_compat nft_fib_inet nft_limit nft_log
nf_conntrack ip_tables iptable_filter iptable_nat xt_conntrack xt_tcpudp xt_MASQUERADE
sch_netem sch_htb sch_tbf cls_u32 act_mirred
loop zram brd
squashfs vfat isofs xfs fuse configfs"

if [ ! -f "$kdir/manifest" ]; then
	echo "$0: no guest kernel in $kdir (scripts/build-vm-kernel.sh builds it)" >&2
	exit 1
fi
ver=$(awk '$1 == "kernel" { print $2 }' "$kdir/manifest")
pkg=$(awk '$1 == "package" { print $2 }' "$kdir/manifest")
if [ -z "$ver" ] || [ -z "$pkg" ]; then
	echo "$0: $kdir/manifest names no kernel version or package" >&2
	exit 1
fi
PATH=$PATH:/usr/sbin:/sbin

if [ -f "$out/usr/lib/modules/$ver/dsec-vm-modules" ]; then
	echo "== guest modules of $ver already in $out" >&2
else
	for tool in apt-get dpkg-deb depmod modprobe xz; do
		command -v $tool >/dev/null || { echo "$0: $tool is not installed" >&2; exit 1; }
	done
	start=$(date +%s)
	mkdir -p "$(dirname "$out")"
	tmp=$(mktemp -d "$out.tmp.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
	echo "== apt-get download $pkg" >&2
	# As root, apt-get would hand the download to its _apt user, who cannot
	# write in a private temporary directory. PKG=VERSION is the manifest's.
	(cd "$tmp" && apt-get download -q -o APT::Sandbox::User="$(id -un)" "$pkg" >/dev/null)
	dpkg-deb -x "$tmp"/*.deb "$tmp/x"
	base=$tmp/x
	[ -d "$base/lib/modules/$ver" ] || base=$tmp/x/usr
	depmod -b "$base" "$ver"
	moddir=$base/lib/modules/$ver
	dst=$tmp/tree/usr/lib/modules/$ver
	mkdir -p "$dst"
	# modprobe resolves the dependencies: one "insmod FILE" line per module,
	# dependencies first; built-in ones print "builtin NAME".
	# shellcheck disable=SC2086
	modprobe -d "$base" -S "$ver" --show-depends -a $MODULES >"$tmp/deps"
	awk '$1 == "insmod" { print $2 }' "$tmp/deps" | sort -u | while read -r f; do
		rel=${f#"$moddir"/}
		mkdir -p "$dst/$(dirname "$rel")"
		case $rel in
		*.ko.xz) xz -dc "$f" >"$dst/${rel%.xz}" ;;
		*.ko.zst) zstd -qdc "$f" >"$dst/${rel%.zst}" ;;
		*.ko.gz) gzip -dc "$f" >"$dst/${rel%.gz}" ;;
		*) cp "$f" "$dst/$rel" ;;
		esac
	done
	cp "$moddir/modules.builtin" "$moddir/modules.builtin.modinfo" "$moddir/modules.order" "$dst/"
	depmod -b "$tmp/tree/usr" "$ver"
	echo "$pkg" >"$dst/dsec-vm-modules"
	rm -rf "$out"
	mv "$tmp/tree" "$out"
	echo "== guest modules of $ver in $(($(date +%s) - start))s: $(find "$out" -name '*.ko' | wc -l) modules, $(du -sh "$out" | cut -f1) in $out" >&2
fi

if [ "$import" = 1 ]; then
	dsec=${DSEC:-bin/dsec}
	name=vm-modules:$ver
	if "$dsec" layer ls | awk 'NR > 1 { print $1 }' | tr ',' '\n' | grep -qx "$name"; then
		echo "== $name already imported" >&2
	else
		"$dsec" layer import --kind toolkit "$name" "$out"
	fi
fi
