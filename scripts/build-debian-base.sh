#!/bin/sh
# build-debian-base.sh OUTDIR [SUITE]
#
# Bootstraps a minimal Debian root file system (debootstrap --variant=minbase,
# plus python3, ca-certificates, git, patch and procps) into OUTDIR, ready to be
# imported as a base layer. The Debian mirror is the one this machine's apt
# sources use (/etc/apt/sources.list, sources.list.d/*.list and *.sources);
# set DEBIAN_MIRROR to override it. SUITE defaults to this machine's
# VERSION_CODENAME from /etc/os-release. EXTRA_PACKAGES (comma-separated)
# adds packages to the bootstrap's list.
#
# Device nodes under OUTDIR/dev (which an import leaves out anyway: every
# sandbox gets its own /dev) and apt's caches and lists are removed. Debian
# ships setuid programs (su, passwd, mount...), so import it with setuid
# allowed:
#
#   sudo scripts/build-debian-base.sh /tmp/debian-root
#   dsec layer import --kind base --allow-setuid debian:12 /tmp/debian-root
set -eu

PACKAGES=python3,ca-certificates,git,patch,procps${EXTRA_PACKAGES:+,$EXTRA_PACKAGES}

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
	echo "usage: $0 OUTDIR [SUITE]" >&2
	exit 2
fi
out=$1
suite=${2:-}

if [ "$(id -u)" -ne 0 ]; then
	echo "$0: must run as root (debootstrap)" >&2
	exit 1
fi
if ! command -v debootstrap >/dev/null 2>&1 && [ ! -x /usr/sbin/debootstrap ]; then
	echo "$0: debootstrap not found (apt-get install debootstrap)" >&2
	exit 1
fi
PATH=$PATH:/usr/sbin:/sbin

if [ -z "$suite" ]; then
	suite=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
	if [ -z "$suite" ]; then
		echo "$0: no SUITE given and no VERSION_CODENAME in /etc/os-release" >&2
		exit 1
	fi
fi

# apt_sources prints "URI SUITE..." for every deb (binary) source of this
# machine, one-line .list format and deb822 .sources format alike.
apt_sources() {
	for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
		[ -f "$f" ] || continue
		# deb [opt=val ...] URI SUITE COMPONENT...
		sed -e 's/#.*//' -e 's/\[[^]]*\]//' "$f" | awk '$1 == "deb" && NF >= 3 { print $2, $3 }'
	done
	for f in /etc/apt/sources.list.d/*.sources; do
		[ -f "$f" ] || continue
		awk '
			function flush() {
				if (types ~ /(^| )deb( |$)/ && enabled != "no")
					for (i = 1; i <= nu; i++) print uris[i], suites
				types = ""; suites = ""; nu = 0; enabled = ""
			}
			/^[ \t]*#/ { next }
			/^[ \t]*$/ { flush(); next }
			{
				key = tolower($1); sub(/:$/, "", key)
				val = $0; sub(/^[^:]*:[ \t]*/, "", val)
				if (key == "types") types = val
				else if (key == "uris") { nu = split(val, uris, /[ \t]+/) }
				else if (key == "suites") suites = val
				else if (key == "enabled") enabled = tolower(val)
			}
			END { flush() }
		' "$f"
	done
}

# The mirror is the first network source carrying the suite itself (not
# SUITE-security or SUITE-updates).
mirror=${DEBIAN_MIRROR:-}
if [ -z "$mirror" ]; then
	mirror=$(apt_sources | awk -v s="$suite" '
		$1 ~ /^(https?|file):/ { for (i = 2; i <= NF; i++) if ($i == s) { print $1; exit } }')
fi
if [ -z "$mirror" ]; then
	echo "$0: no apt source of this machine serves suite $suite; set DEBIAN_MIRROR" >&2
	exit 1
fi

echo "building Debian $suite base in $out from $mirror" >&2
start=$(date +%s)
mkdir -p "$out"
debootstrap --variant=minbase --include="$PACKAGES" "$suite" "$out" "$mirror"

# What a layer need not carry: device nodes (the runtime provides /dev) and
# downloaded package files and indexes.
find "$out/dev" -mindepth 1 -maxdepth 1 -exec rm -rf {} +
rm -rf "$out"/var/cache/apt/archives/*.deb "$out"/var/cache/apt/*.bin "$out"/var/lib/apt/lists/*
mkdir -p "$out/var/lib/apt/lists/partial" "$out/var/cache/apt/archives/partial"
rm -rf "$out"/var/log/*.log "$out"/var/log/apt/* "$out"/tmp/* "$out"/var/tmp/*

# Anything else that cannot go into a layer would make the import fail;
# say so now, by name.
bad=$(find "$out" \( -type b -o -type p -o -type s -o \( -type c ! -path "$out/dev/*" \) \) -print | head -20)
if [ -n "$bad" ]; then
	echo "$0: special files left in the tree (remove them before importing):" >&2
	echo "$bad" >&2
	exit 1
fi

echo "done in $(($(date +%s) - start))s: $(du -sh "$out" | cut -f1) in $out" >&2
