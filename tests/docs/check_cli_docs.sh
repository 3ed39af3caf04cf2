#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The options a user can read about must be the options the programs take: every option a command's
# --help lists is in its man page (and, for tmsctl, in the README), and every option the man page
# and README name for a program is one its --help lists.
#   check_cli_docs.sh SOURCE_DIR TMSCTL TMSDISKD
set -euo pipefail
src=$1 tmsctl=$2 tmsdiskd=$3
status=0
complain() { echo "$*"; status=1; }

# The long options a --help lists ("  --job JOB  ..." and "  -h,--help ...").
help_options() { grep -oE '^ +(-[a-z], ?)?--[a-z][a-z0-9-]*' | grep -oE -- '--[a-z][a-z0-9-]*' | { grep -vx -- '--help' || true; }; }
# The long options a text names; man pages escape dashes (\-\-job).
named_options() { sed 's/\\-/-/g' | grep -oE -- '--[a-z][a-z0-9-]*[a-z0-9]' | { grep -vx -- '--help' || true; } | sort -u; }

ctl_help=$("$tmsctl" --help | help_options)
for cmd in status pause resume gc env run doctor; do
  ctl_help+=$'\n'$("$tmsctl" "$cmd" --help | help_options)
done
ctl_help=$(sort -u <<<"$ctl_help")
daemon_help=$("$tmsdiskd" --help | help_options | sort -u)

ctl_man=$(named_options <"$src/man/tmsctl.1")
daemon_man=$(sed -n '/^\.SH OPTIONS/,/^\.SH /p' "$src/man/tmsdiskd.8" | named_options)
ctl_readme=$(sed -n '/^### tmsctl/,/^### /p' "$src/README.md" | named_options)
# The README names daemon options in prose (`--allow-tmpfs`) and as config keys; the man page lists them.
daemon_readme=$(sed -n '/^### The daemon/,/^### tmsctl/p' "$src/README.md" | grep -v '^tmsctl\|`tmsctl' | named_options)

for o in $ctl_help; do
  grep -qx -- "$o" <<<"$ctl_man" || complain "man/tmsctl.1 does not mention $o (tmsctl --help lists it)"
  grep -qx -- "$o" <<<"$ctl_readme" || complain "README's tmsctl section does not mention $o (tmsctl --help lists it)"
done
for o in $daemon_help; do
  grep -qx -- "$o" <<<"$daemon_man" || complain "man/tmsdiskd.8 OPTIONS does not list $o (tmsdiskd --help lists it)"
done
# The other way: what the documents name must exist. tmsctl's page mentions the daemon's --private.
for o in $ctl_man; do
  grep -qx -- "$o" <<<"$ctl_help" || grep -q -- "tmsdiskd \\\\-\\\\-${o#--}" "$src/man/tmsctl.1" ||
    complain "man/tmsctl.1 names $o, which tmsctl does not take"
done
for o in $ctl_readme; do
  grep -qx -- "$o" <<<"$ctl_help" || complain "README's tmsctl section names $o, which tmsctl does not take"
done
for o in $daemon_man; do
  grep -qx -- "$o" <<<"$daemon_help" || complain "man/tmsdiskd.8 lists $o, which tmsdiskd does not take"
done
for o in $daemon_readme; do
  grep -qx -- "$o" <<<"$daemon_help" || complain "README's daemon section names $o, which tmsdiskd does not take"
done
[ $status -eq 0 ] && echo "tmsctl: $(wc -w <<<"$ctl_help") options, tmsdiskd: $(wc -w <<<"$daemon_help") options; --help, man pages and README agree"
exit $status
