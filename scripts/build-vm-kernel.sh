#!/bin/sh
# build-vm-kernel.sh [OUTDIR]
#
# Makes the guest kernel of the microvm backend from Debian's
# linux-image-amd64 package, without installing a kernel: the package is
# downloaded (apt-get download) and unpacked (dpkg-deb -x) in a temporary
# directory. OUTDIR (default /var/cache/dsec/vm-kernel) then holds
#
#   vmlinux      the uncompressed kernel, an ELF with a PVH entry point:
#                QEMU's -kernel boots it directly. Debian ships an xz
#                bzImage, whose unpacking costs about 3 s of a TCG boot;
#                the ELF is the xz stream inside it.
#   modules/     the guest's modules (NAME.ko, uncompressed), those named in
#                MODULES below and what they depend on (modules.dep)
#   manifest     "kernel VERSION", "package NAME=VERSION" and one
#                "module NAME" line per module, in the order the guest
#                loads them (every module after what it depends on)
#   config       the kernel's build configuration, for reference
#
# Package internal/vm/kernel reads the directory. A finished directory has
# its manifest; running the script again then does nothing (remove OUTDIR to
# take a newer kernel package). Needs apt-get, dpkg-deb, xz, depmod (kmod)
# and a current package index (apt-get update).
set -eu

out=${1:-/var/cache/dsec/vm-kernel}
case $out in
-*) echo "usage: $0 [OUTDIR]" >&2; exit 2 ;;
esac

# The modules the guest loads, in the order measured to load them all: the
# virtio transports (microvm's MMIO and PCI), disks, the agent's
# virtio-serial port, vsock, the network card, pmem for DAX layers, the
# layers' file systems (EROFS, overlayfs, ext4 for the writable disk) and the
# balloon. crc32c_generic is named because libcrc32c and ext4 ask the crypto
# API for crc32c at run time, which modules.dep does not record.
MODULES="virtio_ring virtio virtio_mmio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci
virtio_blk virtio_console vsock vmw_vsock_virtio_transport_common vmw_vsock_virtio_transport
virtio_net libnvdimm nd_virtio virtio_pmem nd_btt nd_pmem crc32c_generic libcrc32c erofs overlay
crc16 mbcache jbd2 ext4 virtio_balloon"

if [ -f "$out/manifest" ]; then
	echo "== VM kernel already built in $out ($(awk '$1 == "kernel" { print $2 }' "$out/manifest"))" >&2
	exit 0
fi
PATH=$PATH:/usr/sbin:/sbin
for tool in apt-get apt-cache dpkg-deb xz depmod; do
	command -v $tool >/dev/null || { echo "$0: $tool is not installed" >&2; exit 1; }
done

start=$(date +%s)
mkdir -p "$(dirname "$out")"
tmp=$(mktemp -d "$out.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# linux-image-amd64 is a metapackage: the kernel is the package it depends on.
pkg=$(apt-cache depends linux-image-amd64 | awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { print $2; exit }')
if [ -z "$pkg" ]; then
	echo "$0: linux-image-amd64 names no kernel package (run apt-get update?)" >&2
	exit 1
fi
echo "== apt-get download $pkg" >&2
# As root, apt-get would hand the download to its _apt user, who cannot
# write in a private temporary directory.
(cd "$tmp" && apt-get download -q -o APT::Sandbox::User="$(id -un)" "$pkg" >/dev/null)
dpkg-deb -x "$tmp"/"$pkg"_*.deb "$tmp/x"
pkgver=$(dpkg-deb -f "$tmp"/"$pkg"_*.deb Version)
# Modules are under lib/modules, or usr/lib/modules where /usr is merged.
base=$tmp/x
[ -d "$base/lib/modules" ] || base=$tmp/x/usr
ver=$(ls "$base/lib/modules")
vmlinuz=$tmp/x/boot/vmlinuz-$ver
moddir=$base/lib/modules/$ver
# The package has no modules.dep: its postinst makes it. depmod makes it
# here, in the unpacked tree.
depmod -b "$base" "$ver"

# The xz stream starts at its magic, FD 37 7A 58 5A 00; what follows it in
# the bzImage is not xz (--single-stream ignores it).
off=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$vmlinuz" | head -1 | cut -d: -f1)
if [ -z "$off" ]; then
	echo "$0: no xz stream in $vmlinuz" >&2
	exit 1
fi
mkdir -p "$tmp/out/modules"
tail -c +$((off + 1)) "$vmlinuz" | xz -dc --single-stream >"$tmp/out/vmlinux"
if [ "$(head -c 4 "$tmp/out/vmlinux" | od -An -tx1 | tr -d ' \n')" != 7f454c46 ]; then
	echo "$0: the xz stream of $vmlinuz is not an ELF kernel" >&2
	exit 1
fi
cp "$tmp/x/boot/config-$ver" "$tmp/out/config"

# order NAME prints the module file paths NAME needs, dependencies first,
# each once (modules.dep lists every dependency of a module, the last one to
# be loaded first).
awk -v want="$(echo $MODULES)" -v builtin="$moddir/modules.builtin" '
function base(p) { sub(/.*\//, "", p); sub(/\.ko(\.xz|\.zst|\.gz)?$/, "", p); gsub(/-/, "_", p); return p }
function visit(name,    n, d, i) {
	if (name in done) return
	done[name] = 1
	if (!(name in path)) {
		if (name in isbuiltin) return
		printf "module %s is neither in modules.dep nor built in\n", name > "/dev/stderr"
		bad = 1
		return
	}
	n = split(deps[name], d, " ")
	for (i = n; i >= 1; i--) visit(base(d[i]))
	print path[name]
}
FILENAME == builtin { isbuiltin[base($1)] = 1; next }
{
	p = $1; sub(/:$/, "", p)
	name = base(p)
	path[name] = p
	$1 = ""
	deps[name] = $0
}
END {
	n = split(want, w, " ")
	for (i = 1; i <= n; i++) visit(w[i])
	exit bad
}' "$moddir/modules.builtin" "$moddir/modules.dep" >"$tmp/order"

{
	echo "# dsec VM kernel, made by scripts/build-vm-kernel.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ)"
	echo "kernel $ver"
	echo "package $pkg=$pkgver"
} >"$tmp/out/manifest.tmp"
while read -r p; do
	name=$(basename "$p")
	case $name in
	*.ko.xz) name=${name%.xz}; xz -dc "$moddir/$p" >"$tmp/out/modules/$name" ;;
	*.ko.zst) name=${name%.zst}; zstd -qdc "$moddir/$p" >"$tmp/out/modules/$name" ;;
	*.ko.gz) name=${name%.gz}; gzip -dc "$moddir/$p" >"$tmp/out/modules/$name" ;;
	*) cp "$moddir/$p" "$tmp/out/modules/$name" ;;
	esac
	echo "module ${name%.ko}" >>"$tmp/out/manifest.tmp"
done <"$tmp/order"
mv "$tmp/out/manifest.tmp" "$tmp/out/manifest"

rm -rf "$out"
mv "$tmp/out" "$out"
echo "== VM kernel $ver built in $(($(date +%s) - start))s: $(du -sh "$out" | cut -f1) in $out ($(grep -c '^module ' "$out/manifest") modules)" >&2
