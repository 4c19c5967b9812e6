# Shell functions the slurm/ scripts share; sourced, never run.

die() {
    echo "error: $*" >&2
    exit 2
}
require() { # NAME WHAT: NAME must be set and non-empty
    [[ -n ${!1:-} ]] || die "$1 is not set: expected $2"
}
require_int() { # NAME: a positive integer
    [[ ${!1} =~ ^[1-9][0-9]*$ ]] || die "$1='${!1}': expected a positive integer"
}
quote() { # the words as one line that a shell splits back into the same words
    local out=() w
    for w in "$@"; do
        if [[ $w =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then out+=("$w"); else out+=("'${w//\'/\'\\\'\'}'"); fi
    done
    printf '%s\n' "${out[*]}"
}
dry_run_flag() { # SCRIPT ARG: true for --dry-run; -h/--help prints SCRIPT's header comment and exits
    case $2 in
        --dry-run) return 0 ;;
        -h | --help)
            sed -n '/^# /,/^set -euo/s/^#\( \|$\)//p' "$1"
            exit 0
            ;;
    esac
    return 1
}
