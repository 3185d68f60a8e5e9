#!/bin/sh
# build-fncall-env.sh [--import] [OUTDIR]
#
# Builds the root file system of the fncall environment (the toolchains of
# the languages in internal/edge/fncall/languages.go) from Debian packages,
# without docker: a debootstrap minbase (scripts/build-debian-base.sh), then
# a chroot `apt-get install` of the toolchains, with documentation, man pages
# and translations left out by a dpkg path-exclude. OUTDIR defaults to
# /var/cache/dsec/fncall-env; it is the tree itself.
#
# Resumable: every finished step leaves a mark in OUTDIR/.dsec-build, and a
# finished tree has OUTDIR/etc/dsec-fncall-env (the versions it was built
# with) and no OUTDIR/.dsec-build. Running it again skips what is done.
#
# With --import, the finished tree is imported into the running dsecd as the
# environment fncall:latest (skipped when `dsec layer ls` lists it already;
# set DSEC to the dsec binary, default bin/dsec, and DSEC_ADDR as usual):
#
#   sudo scripts/build-fncall-env.sh --import /var/cache/dsec/fncall-env
#
# The Debian mirror and suite are those of build-debian-base.sh (this
# machine's apt sources; DEBIAN_MIRROR overrides). APT_ARCHIVES names a
# directory to keep downloaded packages in across builds (default: none,
# downloads are deleted).
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
out=${1:-/var/cache/dsec/fncall-env}

if [ "$(id -u)" -ne 0 ]; then
	echo "$0: must run as root (debootstrap, chroot, mounts)" >&2
	exit 1
fi
here=$(cd "$(dirname "$0")" && pwd)
DSEC=${DSEC:-$here/../bin/dsec}
PATH=$PATH:/usr/sbin:/sbin

# The toolchains, by language:
#   python, pytest  python3 (+ `python`), pytest, numpy, pandas,
#                   sortedcontainers. Not scipy: Debian's depends on pythran,
#                   which brings boost's headers, OpenBLAS and Python's
#                   headers, some 280 MB for a package few calls import.
#   c, cpp          gcc, g++ (and libc6-dev through them)
#   go, go_test     golang-go (Debian's Go, 1.19 on bookworm, whose package
#                   ships the standard library precompiled in GOROOT/pkg)
#   java            default-jdk-headless (OpenJDK 17), javatuples
#                   (SandboxFusion puts javatuples-1.2.jar on the class path)
#   nodejs          nodejs
#   rust            rustc
#   bash            bash (in the base)
PACKAGES="python3 python-is-python3 python3-pytest python3-numpy python3-pandas
python3-sortedcontainers gcc g++ libc6-dev golang-go default-jdk-headless
libjavatuples-java nodejs rustc"

state=$out/.dsec-build
release=$out/etc/dsec-fncall-env
start=$(date +%s)

# cleanup_mounts DIR unmounts everything at or under DIR (deepest first).
cleanup_mounts() {
	for m in $(awk -v d="$1" '$2 == d || index($2, d "/") == 1 { print $2 }' /proc/self/mounts | sort -r); do
		umount -l "$m" 2>/dev/null || true
	done
}

# in_tree CMD... runs a shell command in the tree, with /proc, /dev and /sys
# mounted for the length of the call.
in_tree() {
	trap 'cleanup_mounts "$out/proc"; cleanup_mounts "$out/dev"; cleanup_mounts "$out/sys"; cleanup_mounts "$out/var/cache/apt/archives"' EXIT
	mount -t proc proc "$out/proc"
	mount --rbind /dev "$out/dev"
	mount --make-rslave "$out/dev"
	mount -t sysfs sysfs "$out/sys"
	if [ -n "${APT_ARCHIVES:-}" ]; then
		mkdir -p "$APT_ARCHIVES/partial"
		mount --bind "$APT_ARCHIVES" "$out/var/cache/apt/archives"
	fi
	rc=0
	chroot "$out" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
		DEBIAN_FRONTEND=noninteractive sh -c "$1" || rc=$?
	cleanup_mounts "$out/var/cache/apt/archives"
	cleanup_mounts "$out/sys"
	cleanup_mounts "$out/dev"
	cleanup_mounts "$out/proc"
	trap - EXIT
	return $rc
}

# strip_docs removes what dpkg's path-exclude keeps out of later installs
# from the files already there (the base was bootstrapped without it).
strip_docs() {
	find "$out/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete 2>/dev/null || true
	find "$out/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
	rm -rf "$out"/usr/share/man/* "$out"/usr/share/info/* "$out"/usr/share/lintian/* \
		"$out"/usr/share/linda/*
	find "$out/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} + 2>/dev/null || true
}

have_layer() { "$DSEC" layer ls | awk 'NR>1 {print $1}' | tr ',' '\n' | grep -qx "$1"; }

if [ -f "$release" ] && [ ! -d "$state" ]; then
	echo "== fncall environment already built in $out" >&2
else
	# 1. The base. A directory that is neither ours nor empty is left alone.
	if [ ! -f "$state/base.done" ]; then
		if [ -d "$out" ] && [ -n "$(ls -A "$out")" ] && [ ! -d "$state" ]; then
			echo "$0: $out exists and is not a fncall environment build; remove it or pick another OUTDIR" >&2
			exit 1
		fi
		cleanup_mounts "$out"
		rm -rf "$out"
		mkdir -p "$out"
		sh "$here/build-debian-base.sh" "$out"
		mkdir -p "$out/etc/dpkg/dpkg.cfg.d"
		cat >"$out/etc/dpkg/dpkg.cfg.d/01-dsec-nodoc" <<'EOF'
# dsec fncall environment: no documentation, man pages or translations.
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/lintian/*
path-exclude=/usr/share/linda/*
path-exclude=/usr/share/locale/*
path-include=/usr/share/locale/locale.alias
EOF
		cat >"$out/etc/apt/apt.conf.d/01-dsec-slim" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
EOF
		strip_docs
		mkdir -p "$state"
		touch "$state/base.done"
		echo "== base: $(du -sh "$out" | cut -f1)" >&2
	fi

	# 2. The toolchains.
	if [ ! -f "$state/packages.done" ]; then
		echo "== apt-get install $(echo $PACKAGES)" >&2
		rm -f "$out/etc/resolv.conf"
		cp /etc/resolv.conf "$out/etc/resolv.conf"
		# update-alternatives (openjdk's postinst) fails when the directory
		# of a man page link it makes is missing, even with the page left out.
		mkdir -p "$out/usr/share/man/man1"
		in_tree "apt-get update -q && apt-get install -y -q $(echo $PACKAGES) && apt-get clean"
		rm -f "$out/etc/resolv.conf"
		touch "$state/packages.done"
	fi

	# 3. Warm what a first call would otherwise pay for, where it can be
	# done once, read-only for the calls:
	#  - Java's class data sharing archive (Debian builds it in a trigger;
	#    make sure it is there), so that a JVM maps the JDK's classes
	#    instead of parsing them.
	#  - Go's standard library, compiled into GOROOT/pkg by the package;
	#    check it is not stale, or every call's fresh GOCACHE would
	#    compile the standard library again.
	#  - Python's bytecode: Debian compiles it when a package installs.
	if [ ! -f "$state/warm.done" ]; then
		in_tree '
			set -e
			java_home=$(dirname "$(dirname "$(readlink -f /usr/bin/java)")")
			if [ ! -f "$java_home/lib/server/classes.jsa" ]; then
				java -Xshare:dump >/dev/null
			fi
			export HOME=/tmp GOCACHE=/tmp/gocache
			stale=$(go list -f "{{if .Stale}}{{.ImportPath}}{{end}}" std)
			if [ -n "$stale" ]; then
				echo "go: $(echo $stale | wc -w) stale standard packages; go install std" >&2
				go install std
			fi
			rm -rf /tmp/gocache
			python3 -m compileall -q /usr/lib/python3/dist-packages >/dev/null || true
		'
		# A seed of Go's build cache for go test: `go test` vets the
		# package, and vet wants facts about every package it imports,
		# which a fresh GOCACHE computes again (over a second for the
		# standard library under testing). The go_test language copies the
		# seed (a few MB) into the call's own cache first; one cache shared
		# by the calls could be poisoned by one of them.
		mkdir -p "$out/tmp/go-seed"
		cat >"$out/tmp/go-seed/seed_test.go" <<'GO'
package main

import (
	"bufio"
	"bytes"
	"container/heap"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/big"
	"os"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode"
)

var _ = []any{bufio.NewReader, bytes.Equal, heap.Init, json.Marshal, errors.New, fmt.Println,
	math.Abs, big.NewInt, os.Exit, reflect.DeepEqual, regexp.MustCompile, sort.Ints,
	strconv.Itoa, strings.Repeat, sync.NewCond, time.Now, unicode.IsDigit}

func TestSeed(t *testing.T) {}
GO
		in_tree '
			set -e
			rm -rf /usr/lib/dsec-fncall/go-build
			mkdir -p /usr/lib/dsec-fncall
			cd /tmp/go-seed
			HOME=/tmp/go-seed GOCACHE=/usr/lib/dsec-fncall/go-build go test seed_test.go >/dev/null
			chmod -R a+rX /usr/lib/dsec-fncall
		'
		rm -rf "$out/tmp/go-seed"
		touch "$state/warm.done"
	fi

	# 4. What the tree must not carry: downloaded packages and indexes, logs,
	# documentation, device nodes.
	strip_docs
	rm -rf "$out"/var/cache/apt/archives/*.deb "$out"/var/cache/apt/*.bin "$out"/var/lib/apt/lists/*
	mkdir -p "$out/var/lib/apt/lists/partial" "$out/var/cache/apt/archives/partial"
	# Go's own test suite and the standard library's test data: no build
	# reads them.
	rm -rf "$out"/usr/share/go-*/test
	find "$out"/usr/share/go-*/src -type d -name testdata -prune -exec rm -rf {} +
	rm -rf "$out"/var/log/*.log "$out"/var/log/apt/* "$out"/tmp/* "$out"/tmp/.[!.]* "$out"/var/tmp/* "$out"/root/.cache
	find "$out/dev" -mindepth 1 -maxdepth 1 -exec rm -rf {} +
	chmod 1777 "$out/tmp" "$out/var/tmp"
	bad=$(find "$out" \( -type b -o -type p -o -type s -o \( -type c ! -path "$out/dev/*" \) \) -print | head -20)
	if [ -n "$bad" ]; then
		echo "$0: special files left in the tree (remove them before importing):" >&2
		echo "$bad" >&2
		exit 1
	fi

	# The release file: what was built, for the runner and for people.
	{
		echo "# dsec fncall environment, built $(date -u +%Y-%m-%dT%H:%M:%SZ)"
		chroot "$out" dpkg-query -W -f '${db:Status-Abbrev} ${Package}=${Version}\n' \
			$PACKAGES 'golang-*-go' 'openjdk-*-jdk-headless' 2>/dev/null | awk '$1 == "ii" { print $2 }'
		chroot "$out" go version
	} >"$release.tmp"
	mv "$release.tmp" "$release"
	rm -rf "$state"
	echo "== built in $(($(date +%s) - start))s: $(du -sh "$out" | cut -f1) in $out" >&2
fi

if [ "$import" = 1 ]; then
	if have_layer fncall:latest; then
		echo "== fncall:latest already imported" >&2
	else
		echo "== importing $out as fncall:latest" >&2
		"$DSEC" layer import --kind base --allow-setuid fncall:latest "$out"
	fi
fi
