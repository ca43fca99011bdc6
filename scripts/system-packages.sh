#!/usr/bin/env bash
# Makes sure the Debian packages the project needs are present: the WordNet corpus (wordnet-base), jemalloc
# (libjemalloc2, which the server preloads in glibc malloc's place where it is installed: server/memory.py) and,
# with --with-prometheus (the tests' and monitoring checks' setup), Prometheus with promtool (prometheus).
# Installs them with apt-get when missing and apt-get is usable; otherwise says what to install.
# WORDNET_DIR points at another WordNet 3.0 'dict' folder.
set -euo pipefail

wordnet_dir="${WORDNET_DIR:-/usr/share/wordnet}"
missing=()
[ -f "$wordnet_dir/data.noun" ] || missing+=(wordnet-base)
/sbin/ldconfig -p 2>/dev/null | grep 'libjemalloc\.so\.2 ' >/dev/null || missing+=(libjemalloc2)
if [ "${1:-}" = --with-prometheus ]; then
  command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
fi
[ ${#missing[@]} -eq 0 ] && exit 0

if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "installing Debian packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The package's own service is not ours to run; tests start their own Prometheus on loopback.
  if command -v service >/dev/null 2>&1; then service prometheus stop >/dev/null 2>&1 || true; fi
  exit 0
fi

for pkg in "${missing[@]}"; do
  case "$pkg" in
    wordnet-base) echo "WordNet 3.0 not found in $wordnet_dir: install Debian's 'wordnet-base' (sudo apt-get install wordnet-base) or run with WORDNET_DIR=/path/to/wordnet/dict." >&2 ;;
    prometheus) echo "prometheus/promtool not found: install Debian's 'prometheus' package (sudo apt-get install prometheus)." >&2 ;;
    libjemalloc2) echo "jemalloc not found: the server runs on glibc's malloc; Debian's 'libjemalloc2' (sudo apt-get install libjemalloc2) makes it faster." >&2 ;;
  esac
done
# Without WordNet nothing can be trained; without Prometheus only the monitoring checks need it, without jemalloc
# the server runs on glibc's malloc.
[[ " ${missing[*]} " == *" wordnet-base "* ]] && exit 1
exit 0
