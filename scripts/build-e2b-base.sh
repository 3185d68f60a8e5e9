#!/bin/sh
# build-e2b-base.sh [--import] [OUTDIR]
#
# Builds the root file system of the e2b-base environment, what E2B's `base`
# and `code-interpreter-v1` templates map to (internal/e2b DefaultTemplates):
# a Debian minbase (scripts/build-debian-base.sh) with bash, coreutils,
# sudo, python3, ca-certificates and procps, and E2B's user `user` (uid
# 1000, home /home/user, shell /bin/bash, in group sudo, sudo without a
# password). The code interpreter of port 49999 needs nothing beyond
# python3's standard library: its driver is sent in by the adapter.
# OUTDIR defaults to /var/cache/dsec/e2b-base; it is the tree itself.
#
# The tree is built next to OUTDIR and renamed into place when finished,
# marked by OUTDIR/etc/dsec-e2b-base (the versions it was built with).
# Running it again with a finished OUTDIR does nothing.
#
# With --import, the finished tree is imported into the running dsecd as
# the environment e2b-base:latest (skipped when `dsec layer ls` lists it
# already; set DSEC to the dsec binary, default bin/dsec, and DSEC_ADDR as
# usual):
#
#   sudo scripts/build-e2b-base.sh --import
#
# The Debian mirror and suite are those of build-debian-base.sh (this
# machine's apt sources; DEBIAN_MIRROR overrides).
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
out=${1:-/var/cache/dsec/e2b-base}
out=${out%/}

if [ "$(id -u)" -ne 0 ]; then
	echo "$0: must run as root (debootstrap, chroot)" >&2
	exit 1
fi
here=$(cd "$(dirname "$0")" && pwd)
DSEC=${DSEC:-$here/../bin/dsec}
PATH=$PATH:/usr/sbin:/sbin

# On top of build-debian-base.sh's python3, ca-certificates, git, patch and
# procps (bash and coreutils are in every minbase; named to be sure).
EXTRA=bash,coreutils,sudo

release=$out/etc/dsec-e2b-base
have_layer() { "$DSEC" layer ls | awk 'NR>1 {print $1}' | tr ',' '\n' | grep -qx "$1"; }

# The marker's first line names the recipe a tree was built by: a tree of
# an older recipe is built again.
recipe="# recipe 2: login shells take the uid from EUID"
if [ -f "$release" ] && [ "$(head -n 1 "$release")" != "$recipe" ]; then
	echo "== $out was built by an older recipe: building it again" >&2
	rm -rf "$out"
fi
if [ -f "$release" ]; then
	echo "== e2b-base already built in $out" >&2
else
	if [ -e "$out" ]; then
		echo "$0: $out exists and is not a finished e2b-base build; remove it or pick another OUTDIR" >&2
		exit 1
	fi
	start=$(date +%s)
	tmp=$out.build
	rm -rf "$tmp"
	mkdir -p "$(dirname "$out")"
	EXTRA_PACKAGES=$EXTRA sh "$here/build-debian-base.sh" "$tmp"

	# E2B's user: uid 1000, its own group, /home/user, bash, sudo without a
	# password (E2B's templates run `sudo apt-get ...` as user).
	chroot "$tmp" /usr/sbin/useradd --create-home --uid 1000 --user-group \
		--shell /bin/bash --groups sudo user
	echo 'user ALL=(ALL:ALL) NOPASSWD: ALL' >"$tmp/etc/sudoers.d/e2b-user"
	chmod 0440 "$tmp/etc/sudoers.d/e2b-user"
	chroot "$tmp" /usr/sbin/visudo -cq
	# Every commands.run of E2B's SDKs is a login shell (bash -l -c CMD),
	# which reads /etc/profile: let bash take its uid from $EUID rather
	# than fork id(1) for it (a millisecond of each command here); other
	# shells, which have no EUID, still ask id.
	sed -i 's/"$(id -u)"/"${EUID:-$(id -u)}"/g' "$tmp/etc/profile"
	grep -q 'EUID:-' "$tmp/etc/profile"
	rm -rf "$tmp"/var/log/*.log "$tmp"/tmp/* "$tmp"/var/tmp/*
	chmod 1777 "$tmp/tmp" "$tmp/var/tmp"

	{
		echo "$recipe"
		echo "# dsec e2b-base environment, built $(date -u +%Y-%m-%dT%H:%M:%SZ)"
		chroot "$tmp" dpkg-query -W -f '${db:Status-Abbrev} ${Package}=${Version}\n' \
			bash coreutils sudo python3 ca-certificates procps 2>/dev/null | awk '$1 == "ii" { print $2 }'
	} >"$tmp/etc/dsec-e2b-base"
	mv "$tmp" "$out"
	echo "== built in $(($(date +%s) - start))s: $(du -sh "$out" | cut -f1) in $out" >&2
fi

if [ "$import" = 1 ]; then
	if have_layer e2b-base:latest; then
		echo "== e2b-base:latest already imported" >&2
	else
		echo "== importing $out as e2b-base:latest" >&2
		"$DSEC" layer import --kind base --allow-setuid e2b-base:latest "$out"
	fi
fi
