#!/bin/sh
# The whole task, network first, the firewall rule by rule.
set -eu
for m in veth nf_tables loop; do modprobe "$m"; done
ip netns add lab
ip link add lab0 type veth peer name eth0
ip link set eth0 netns lab
ip addr add 198.18.100.1/30 dev lab0
ip link set lab0 up
ip netns exec lab ip addr add 198.18.100.2/30 dev eth0
ip netns exec lab ip link set eth0 up
ip netns exec lab nft add table inet guard
ip netns exec lab nft add chain inet guard input '{ type filter hook input priority 0; policy accept; }'
ip netns exec lab nft add rule inet guard input tcp dport 23 drop
mkdir -p /mnt/scratch /mnt/data
mount -t tmpfs -o size=16M tmpfs /mnt/scratch
dd if=/dev/zero of=/var/tmp/data.img bs=1M count=32 status=none
mkfs.ext4 -q -F /var/tmp/data.img
mount -t ext4 -o loop /var/tmp/data.img /mnt/data
printf 'ok\n' >/mnt/data/hello
