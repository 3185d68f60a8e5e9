#!/bin/sh
# build-bench-images.sh OUT_DIR [NAME...]
#
# Builds the images of `dsec bench storage` from Debian packages, without
# docker: one debootstrap minbase (scripts/build-debian-base.sh) shared as
# the base layer of every image, then per image a chroot `apt-get install`
# of its toolchain into an overlay upper directory over the base; that upper
# directory is the image's second layer. Each image gets /bench/step.sh, a
# small realistic step (compile and run a hello, run a tiny test) that
# touches a small part of the image.
#
# Results, resumable (an image whose OUT_DIR/NAME/index.json exists is
# skipped; so is a finished base or upper tree):
#
#   OUT_DIR/NAME/                OCI image layout (oci-layout, index.json,
#                                blobs/sha256/...), imported by the bench as
#                                bench-NAME:latest
#   OUT_DIR/.work/base/          the base root file system
#   OUT_DIR/.work/NAME/upper/    the image's own layer
#
# The OCI layouts are written by `dsec bench storage build-oci` (set DSEC to
# the dsec binary; default bin/dsec). The apt packages downloaded are kept in
# OUT_DIR/.work/apt-archives so that shared packages download once.
#
#   sudo scripts/build-bench-images.sh /var/cache/dsec/bench-images
set -eu

if [ $# -lt 1 ]; then
	echo "usage: $0 OUT_DIR [NAME...]" >&2
	exit 2
fi
out=$1
shift
if [ "$(id -u)" -ne 0 ]; then
	echo "$0: must run as root (debootstrap, chroot, overlay mounts)" >&2
	exit 1
fi
here=$(cd "$(dirname "$0")" && pwd)
DSEC=${DSEC:-$here/../bin/dsec}
PATH=$PATH:/usr/sbin:/sbin

ALL="python go java node cpp rust clang ruby"
names=${*:-$ALL}

# packages NAME prints the Debian packages of image NAME. Each list is picked
# to make the image at least 500 MB uncompressed, base included.
packages() {
	case $1 in
	python) echo python3-numpy python3-scipy python3-pandas python3-matplotlib python3-sklearn python3-pytest python3-dev ;;
	go) echo golang-go gcc libc6-dev golang-golang-x-tools-dev ;;
	java) echo default-jdk-headless maven ;;
	node) echo nodejs npm node-typescript build-essential ;;
	cpp) echo build-essential g++ cmake gdb libboost-dev ;;
	rust) echo rustc cargo rust-src gcc libc6-dev ;;
	clang) echo clang llvm lld libc6-dev libstdc++-12-dev ;;
	ruby) echo ruby-full ruby-dev build-essential bundler rake ruby-minitest libsqlite3-dev ;;
	*) echo "$0: unknown image $1" >&2; return 1 ;;
	esac
}

# step NAME prints /bench/step.sh of image NAME: a short shell script run in
# a sandbox; everything it writes goes to /tmp.
step() {
	echo '#!/bin/sh'
	echo 'set -eu'
	echo 'export HOME=/tmp TMPDIR=/tmp'
	echo 'cd /tmp'
	case $1 in
	python)
		cat <<'EOF'
python3 - <<'PY'
import unittest
import numpy as np
class T(unittest.TestCase):
    def test_sum(self):
        self.assertEqual(int(np.arange(100).sum()), 4950)
    def test_solve(self):
        a = np.array([[3.0, 1.0], [1.0, 2.0]])
        x = np.linalg.solve(a, np.array([9.0, 8.0]))
        self.assertTrue(np.allclose(x, [2.0, 3.0]))
unittest.main(argv=["step"], exit=True)
PY
EOF
		;;
	go)
		cat <<'EOF'
export GOCACHE=/tmp/gocache GOPATH=/tmp/go GOFLAGS=-mod=mod GO111MODULE=off
mkdir -p /tmp/hello
cat >/tmp/hello/main.go <<'GO'
package main

import "fmt"

func main() { fmt.Println("hello from go") }
GO
go build -o /tmp/hello/hello /tmp/hello/main.go
/tmp/hello/hello
EOF
		;;
	java)
		cat <<'EOF'
cat >/tmp/Hello.java <<'JAVA'
public class Hello {
    public static void main(String[] args) {
        java.util.List<Integer> l = new java.util.ArrayList<>();
        for (int i = 0; i < 10; i++) l.add(i * i);
        System.out.println("hello from java " + l);
    }
}
JAVA
javac -d /tmp /tmp/Hello.java
java -cp /tmp Hello
EOF
		;;
	node)
		cat <<'EOF'
cat >/tmp/t.js <<'JS'
const assert = require('assert');
const path = require('path');
assert.strictEqual([1, 2, 3].map((x) => x * 2).join(','), '2,4,6');
assert.strictEqual(path.join('a', 'b'), 'a/b');
console.log('hello from node', process.version);
JS
node /tmp/t.js
EOF
		;;
	cpp)
		cat <<'EOF'
cat >/tmp/hello.cpp <<'CPP'
#include <iostream>
#include <vector>
#include <numeric>
int main() {
    std::vector<int> v(100);
    std::iota(v.begin(), v.end(), 0);
    std::cout << "hello from c++ " << std::accumulate(v.begin(), v.end(), 0) << std::endl;
}
CPP
g++ -O1 -o /tmp/hello /tmp/hello.cpp
/tmp/hello
EOF
		;;
	rust)
		cat <<'EOF'
cat >/tmp/hello.rs <<'RS'
fn main() {
    let v: Vec<u32> = (0..100).collect();
    println!("hello from rust {}", v.iter().sum::<u32>());
}
RS
rustc -O -o /tmp/hello /tmp/hello.rs
/tmp/hello
EOF
		;;
	clang)
		cat <<'EOF'
cat >/tmp/hello.c <<'C'
#include <stdio.h>
int main(void) { int s = 0; for (int i = 0; i < 100; i++) s += i; printf("hello from clang %d\n", s); return 0; }
C
clang -O2 -o /tmp/hello /tmp/hello.c
/tmp/hello
EOF
		;;
	ruby)
		cat <<'EOF'
cat >/tmp/t.rb <<'RB'
require 'minitest/autorun'
class TestHello < Minitest::Test
  def test_sum
    assert_equal 4950, (0...100).sum
  end
end
RB
ruby /tmp/t.rb
EOF
		;;
	esac
}

work=$out/.work
mkdir -p "$work/apt-archives/partial"
start=$(date +%s)

# The base, built once.
if [ ! -f "$work/base.done" ]; then
	rm -rf "$work/base"
	sh "$here/build-debian-base.sh" "$work/base"
	touch "$work/base.done"
fi

# cleanup_mounts DIR unmounts everything under DIR (deepest first).
cleanup_mounts() {
	for m in $(awk -v d="$1" '$2 == d || index($2, d "/") == 1 { print $2 }' /proc/self/mounts | sort -r); do
		umount -l "$m" 2>/dev/null || true
	done
}

# build_upper NAME installs NAME's packages into an overlay upper directory.
build_upper() {
	name=$1
	dir=$work/$name
	[ -f "$dir/upper.done" ] && return 0
	pkgs=$(packages "$name")
	echo "== $name: apt-get install $pkgs" >&2
	cleanup_mounts "$dir/merged"
	rm -rf "$dir"
	mkdir -p "$dir/upper" "$dir/ovlwork" "$dir/merged"
	mount -t overlay overlay -o "lowerdir=$work/base,upperdir=$dir/upper,workdir=$dir/ovlwork" "$dir/merged"
	trap 'cleanup_mounts "$dir/merged"' EXIT
	mount -t proc proc "$dir/merged/proc"
	mount --rbind /dev "$dir/merged/dev"
	mount -t sysfs sysfs "$dir/merged/sys"
	mount --bind "$work/apt-archives" "$dir/merged/var/cache/apt/archives"
	rm -f "$dir/merged/etc/resolv.conf"
	cp /etc/resolv.conf "$dir/merged/etc/resolv.conf"
	chroot "$dir/merged" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
		sh -c "apt-get update -q && apt-get install -y -q --no-install-recommends $pkgs"
	mkdir -p "$dir/merged/bench"
	step "$name" >"$dir/merged/bench/step.sh"
	chmod 0755 "$dir/merged/bench/step.sh"
	cleanup_mounts "$dir/merged"
	trap - EXIT
	# What the layer must not carry: apt's indexes and logs, the resolver copy.
	rm -rf "$dir/upper/var/lib/apt/lists" "$dir/upper/var/cache/apt" "$dir/upper/var/log" \
		"$dir/upper/etc/resolv.conf" "$dir/upper/tmp" "$dir/upper/var/tmp"
	rmdir "$dir/merged" 2>/dev/null || true
	rm -rf "$dir/ovlwork"
	touch "$dir/upper.done"
	echo "== $name: layer $(du -sh "$dir/upper" | cut -f1)" >&2
}

for name in $names; do
	packages "$name" >/dev/null
	if [ -f "$out/$name/index.json" ]; then
		echo "== $name: already built" >&2
		continue
	fi
	build_upper "$name"
done

# The OCI layouts; the base layer's tar.gz is written once and shared.
for name in $names; do
	if [ -f "$out/$name/index.json" ]; then
		continue
	fi
	echo "== $name: writing OCI layout" >&2
	"$DSEC" bench storage build-oci --base "$work/base" --base-cache "$work/base.tar.gz" \
		--layer "$work/$name/upper" --out "$out/$name" --name "bench-$name:latest"
done

echo "done in $(($(date +%s) - start))s" >&2
for name in $names; do
	[ -f "$out/$name/index.json" ] && echo "$name $(du -sb "$work/base" "$work/$name/upper" | awk '{ s += $1 } END { printf "%.0f MB uncompressed", s / 1e6 }')" >&2
done
exit 0
