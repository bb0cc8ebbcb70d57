#!/usr/bin/env bash
# The test suite must leave its caller as it found it: terminal modes, signal dispositions, open file descriptors,
# process group and the terminal's foreground group. This records that state, runs a pytest command in the
# background (`&` then wait) and in the foreground, and after each checks nothing changed and this script goes on.
#
#   tests/suite_state_check.sh                       # a representative subset that exercises signals
#   tests/suite_state_check.sh tests/test_chat.py -k ctrl_c   # any pytest arguments
#
# With a terminal on stdin, job control is turned on (set -m) like an interactive shell: the background run gets its
# own process group, so a test that reads or reconfigures the terminal is stopped by SIGTTIN/SIGTTOU and reported.
# Exit status: 0 when nothing changed; 1 with one line per difference saying what changed.
set -u
PYTHON=${PYTHON:-python}
if [ $# -eq 0 ]; then
    set -- tests/test_chat.py tests/test_cli.py tests/test_hardening_cli.py tests/test_train_parallel.py \
        tests/test_server_cli.py
fi
tty_present=0
[ -t 0 ] && tty_present=1
[ "$tty_present" = 1 ] && set -m

state() {
    if [ "$tty_present" = 1 ]; then
        echo "stty: $(stty -g 2>&1)"
        echo "foreground group: $(ps -o tpgid= -p $$ | tr -d ' ')"
    fi
    echo "process group: $(ps -o pgid= -p $$ | tr -d ' ')"
    trap -p | sed 's/^/trap: /'
    for fd in /proc/$$/fd/*; do
        n=${fd##*/}
        # The fd ls opened for this listing is gone by the time we read it; skip links that no longer resolve.
        t=$(readlink "$fd" 2>/dev/null) || continue
        case "$t" in pipe:*|socket:*) t=${t%%:*} ;; esac  # inode numbers of pipes differ between $(...) calls
        echo "fd $n: $t"
    done
}

check() {  # $1: what ran; $2: its exit status
    local after
    after=$(state)
    if [ "$after" != "$before" ]; then
        diff <(echo "$before") <(echo "$after") | grep '^[<>]' | paste -sd ' ' |
            sed "s/^/suite_state_check: state changed after the $1 run: /"
        failed=1
    fi
    case "$2" in
        145|146|147|148|149|150) echo "suite_state_check: the $1 run was stopped (status $2: SIGTSTP/SIGTTIN/SIGTTOU)"
            failed=1 ;;
    esac
    echo "suite_state_check: $1 run done (pytest status $2), script continues"
}

before=$(state)
failed=0

# Background, as `pytest ... &` from a shell: with job control it is in its own process group, not the terminal's
# foreground one. A stopped job makes `wait` return with 128+signal; then kill it so nothing is left behind.
"$PYTHON" -m pytest -q -p no:cacheprovider "$@" &
pid=$!
wait "$pid"
status=$?
if [ "$status" -ge 145 ] && [ "$status" -le 150 ]; then
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
fi
check background "$status"

# Foreground, as `pytest ...` typed at the prompt.
"$PYTHON" -m pytest -q -p no:cacheprovider "$@"
check foreground $?

if [ "$failed" = 0 ]; then
    echo "suite_state_check: OK, state unchanged"
fi
exit "$failed"
