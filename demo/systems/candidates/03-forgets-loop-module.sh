#!/bin/sh
# Assumes the kernel loads the loop driver on demand: the loop mount fails
# and the script stops there.
set -eu
mkdir -p /mnt/scratch /mnt/data
mount -t tmpfs -o size=16m scratch /mnt/scratch
truncate -s 32M /var/tmp/data.img
mkfs.ext4 -q /var/tmp/data.img
mount -o loop /var/tmp/data.img /mnt/data
echo ok >/mnt/data/hello
modprobe -a veth nf_tables
ip netns add lab
ip link add lab0 type veth peer name eth0 netns lab
ip addr add 198.18.100.1/30 dev lab0
ip link set lab0 up
ip -n lab addr add 198.18.100.2/30 dev eth0
ip -n lab link set eth0 up
ip netns exec lab nft add table inet guard
