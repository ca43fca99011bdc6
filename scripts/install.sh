#!/usr/bin/env bash
# Installs into the virtualenv of VENV_PYTHON with uv, or with pip where uv cannot be installed or fails.
# usage: scripts/install.sh VENV_PYTHON PIP_INSTALL_ARGUMENTS...
#
# uv resolves to the same packages as pip here and installs them on every core: 9.5-13.5 s against 22.3 s for
# what `make run` needs from an empty cache on a 2-core VM, 6 s against 16 s for the test tools on top.
# uv reads no pip configuration, so pip's indexes, extra indexes and find-links (where the CPU build of
# torch lies) are handed to it, and every index is searched for the best version, as pip does.
set -euo pipefail
py=$1
shift
venv=$(dirname "$(dirname "$py")")
UV_VERSION=0.13.9

pip_setting() {  # pip's value for an option: its environment variable, else its configuration files
    local variable
    variable=PIP_$(tr 'a-z-' 'A-Z_' <<<"$1")
    if [ -n "${!variable:-}" ]; then echo "${!variable}"; else "$py" -m pip config get "global.$1" 2>/dev/null || true; fi
}

if "$py" -m pip install -q "uv==$UV_VERSION" >/dev/null 2>&1; then
    options=(--index-strategy unsafe-best-match)
    index=$(pip_setting index-url)
    [ -z "$index" ] || options+=(--index-url "$index")
    for url in $(pip_setting extra-index-url); do options+=(--extra-index-url "$url"); done
    for place in $(pip_setting find-links); do options+=(--find-links "$place"); done
    cert=$(pip_setting cert)
    [ -z "$cert" ] || export SSL_CERT_FILE=$cert
    # The cache beside the virtualenv, on its file system: files are linked, not copied, and go with it.
    if UV_CACHE_DIR=${UV_CACHE_DIR:-$venv/.uv-cache} "$venv/bin/uv" pip install -q --python "$py" "${options[@]}" "$@"; then
        exit 0
    fi
    echo "uv could not install $*; installing with pip" >&2
else
    echo "uv $UV_VERSION could not be installed; installing with pip" >&2
fi
"$py" -m pip install -q --no-compile "$@"
