# Sourced by the scripts that build a tool from its Go module
# (seaweedfs.sh, build-runsc.sh).

# module_source MODULE VERSION DEST: fetches MODULE@VERSION through the Go
# module proxy and copies its tree, writable, to DEST. Such tools are built
# inside that copy, so its own go.mod and go.sum pin every dependency
# (go install of a module refuses replace directives).
module_source() {
  local module="$1" version="$2" dest="$3" json dir
  json="$(go mod download -json "$module@$version")"
  dir="$(printf '%s\n' "$json" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",*$/\1/p')"
  if [ -z "$dir" ] || [ ! -d "$dir" ]; then
    echo "$(basename "$0"): module directory of $module@$version not found in: $json" >&2
    exit 1
  fi
  cp -r "$dir/." "$dest"
  chmod -R u+w "$dest"
}
