#!/bin/sh
# build-busybox-base.sh OUTDIR
#
# Writes a tiny base root file system into OUTDIR from the static busybox
# (Debian's busybox-static): /bin/busybox plus a symlink per applet, /etc/passwd
# and /etc/group with root and nobody (65534), and the usual directories.
# Every object is owned by root with mtime 0, so importing the tree always
# gives the same layer digest. It builds the same tree as
# image.BuildBusyboxRootfs (internal/edge/image); keep the two in step.
#
#   scripts/build-busybox-base.sh /tmp/busybox-root
#   dsec layer import --kind base busybox:1 /tmp/busybox-root
set -eu

BUSYBOX=/bin/busybox

if [ $# -ne 1 ]; then
	echo "usage: $0 OUTDIR" >&2
	exit 2
fi
out=$1
if [ ! -x "$BUSYBOX" ]; then
	echo "$0: $BUSYBOX not found (install busybox-static)" >&2
	exit 1
fi

mkdir -p "$out"
for spec in .:755 bin:755 sbin:755 usr:755 usr/bin:755 usr/sbin:755 usr/lib:755 lib:755 \
	etc:755 root:700 home:755 tmp:1777 var:755 var/tmp:1777 run:755 \
	proc:555 sys:555 dev:755; do
	d=${spec%%:*}
	mkdir -p "$out/$d"
	chmod "${spec#*:}" "$out/$d"
done

cp "$BUSYBOX" "$out/bin/busybox"
chmod 755 "$out/bin/busybox"

printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$out/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$out/etc/group"
printf '127.0.0.1\tlocalhost\n::1\tlocalhost\n' >"$out/etc/hosts"
chmod 644 "$out/etc/passwd" "$out/etc/group" "$out/etc/hosts"

for applet in $("$BUSYBOX" --list); do
	case $applet in
	busybox | */*) continue ;;
	esac
	ln -sfn busybox "$out/bin/$applet"
done
ln -sfn /bin/busybox "$out/usr/bin/env"

chown -hR 0:0 "$out"
find "$out" -exec touch -h -d @0 {} +
