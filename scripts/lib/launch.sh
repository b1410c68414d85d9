# shellcheck shell=bash
# Helpers shared by the launchers (source it; it defines functions and nothing else).
#
#   parse_launcher_args "$@"   sets DRY_RUN (0 or 1) and LAUNCHER_ARGS (the arguments minus --dry-run)
#   launch CMD...              runs CMD (exec) or, with --dry-run, prints it instead
#
# The printed command is valid bash: every word is quoted with printf %q and each
# --flag starts a new continuation line, so it can be read, diffed and pasted.

parse_launcher_args() {
  DRY_RUN=0
  LAUNCHER_ARGS=()
  local arg
  for arg in "$@"; do
    if [ "$arg" = "--dry-run" ]; then
      DRY_RUN=1
    else
      LAUNCHER_ARGS+=("$arg")
    fi
  done
}

print_command() {
  local out="" word quoted
  for word in "$@"; do
    quoted="$(printf '%q' "$word")"
    if [ -z "$out" ]; then
      out="$quoted"
    elif [[ "$word" == --* ]]; then
      out+=$' \\\n  '"$quoted"
    else
      out+=" $quoted"
    fi
  done
  printf '%s\n' "$out"
}

launch() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    print_command "$@"
    exit 0
  fi
  exec "$@"
}
