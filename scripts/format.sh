#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Formats the tree's C and C++ files with clang-format and .clang-format (every tracked file: nothing
# here is vendored).
#   scripts/format.sh            rewrites the files in place
#   scripts/format.sh --check    changes nothing; lists the files that differ and exits 1 if any do
set -euo pipefail
cd "$(dirname "$0")/.."
check=0
case "${1:-}" in
  --check) check=1 ;;
  "") ;;
  *) echo "usage: scripts/format.sh [--check]" >&2; exit 2 ;;
esac
clang_format=${CLANG_FORMAT:-clang-format}
command -v "$clang_format" >/dev/null || { echo "format.sh: $clang_format not found (apt-get install clang-format)" >&2; exit 2; }

mapfile -d '' files < <(git ls-files -z -- '*.c' '*.h' '*.cc' '*.cpp' '*.hpp')
if [ "$check" = 0 ]; then
  [ ${#files[@]} -eq 0 ] || "$clang_format" -i --style=file "${files[@]}"
  exit 0
fi
differ=()
for f in "${files[@]}"; do
  "$clang_format" --style=file "$f" | cmp -s - "$f" || differ+=("$f")
done
if [ ${#differ[@]} -gt 0 ]; then
  printf '%s\n' "${differ[@]}"
  echo "format.sh: ${#differ[@]} file(s) differ from .clang-format; run scripts/format.sh" >&2
  exit 1
fi
