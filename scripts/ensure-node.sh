# ensure-node.sh: sourced (". scripts/ensure-node.sh") by the scripts that
# run the official E2B SDKs (.ci/run, demo.sh). Makes sure node 20.18.1 or
# newer and npm are on PATH: Debian's nodejs and npm when there is no node
# (Debian 13 ships 20); a node already installed is kept (NodeSource's
# bundles npm and conflicts with Debian's). When that node is older
# (Debian 12's is 18), node 20 from the npm registry's `node` package goes
# beside it, under /opt/dsec-node, and PATH is set to find it first.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
dsec_node_ok='const [a, b] = process.versions.node.split(".").map(Number); process.exit(a > 20 || (a === 20 && b >= 18) ? 0 : 1)'
if ! node -e "$dsec_node_ok"; then
  npm install --prefix /opt/dsec-node --no-audit --no-fund node@20 >/dev/null
  export PATH="/opt/dsec-node/node_modules/.bin:$PATH"
  node -e "$dsec_node_ok"
fi
unset dsec_node_ok
