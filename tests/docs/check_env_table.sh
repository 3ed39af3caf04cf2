#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The README's environment table must match the code: every variable the shipped code reads is in
# the table, and every variable the table's first column names is read somewhere.
#   check_env_table.sh SOURCE_DIR
set -euo pipefail
src=$1
# Read by the code: getenv("X") and the shim's env("X") helper, in everything that ships.
code=$(grep -rhoE '(getenv|env)\("[A-Z_][A-Z0-9_]*"' "$src"/interposer "$src"/daemon "$src"/tools "$src"/common \
         | sed -E 's/.*"([A-Z0-9_]+)"/\1/' | sort -u)
# And in the Python that ships (start-up module, tmsdisk package, torch_memory_saver compatibility):
# os.environ.get("X"), os.environ["X"], bool_env("X").
code=$(printf '%s\n%s\n' "$code" "$(grep -rhoE '(environ\.get\(|environ\[|bool_env\()"[A-Z_][A-Z0-9_]*"' "$src"/python \
         | sed -E 's/.*"([A-Z0-9_]+)"/\1/')" | sort -u)
# Also names passed through a list, e.g. {"TMSDISK_JOB", "TORCHELASTIC_RUN_ID", ...} in the shim.
code=$(printf '%s\n%s\n' "$code" "$(grep -rhoE '"(TMSDISK|TMS_DISK|TORCHELASTIC|SLURM|RAY)_[A-Z0-9_]*"' \
         "$src"/interposer "$src"/daemon "$src"/tools "$src"/common | tr -d '"')" | sort -u)
# Not ours to document: systemd's and the shell's.
ignore='^(PATH|JOURNAL_STREAM|NOTIFY_SOCKET)$'
table=$(sed -n '/^## Environment/,/^## /p' "$src/README.md" | grep '^|')
first=$(printf '%s\n' "$table" | tail -n +3 | cut -d'|' -f2 | grep -oE '`[A-Z_][A-Z0-9_]*`' | tr -d '`' | sort -u)
status=0
for v in $code; do
  [[ $v =~ $ignore ]] && continue
  # Here-strings, not pipes: grep -q exits at the first match, and under pipefail the writer's
  # SIGPIPE would make a match look like a failure.
  grep -q "\`$v\`" <<<"$table" || { echo "README environment table lacks $v (read by the code)"; status=1; }
done
for v in $first; do
  grep -qx "$v" <<<"$code" || { echo "README documents $v, which no code reads"; status=1; }
done
[ $status -eq 0 ] && echo "environment table matches the code ($(printf '%s\n' "$code" | grep -cvE "$ignore") variables)"
exit $status
