#!/usr/bin/env bash
# Runs a longer batch than one device call allows: the first call starts it in its own session (it
# outlives the call while the machine stays held), every call waits for it up to SECONDS and copies
# what it wrote so far into $OUT. Call again within the machine's warm time to go on waiting.
#   bash bench/gpu/bg.sh start 'commands...' [SECONDS]     then     bash bench/gpu/bg.sh wait [SECONDS]
set -u
J=/tmp/tether-bg; mkdir -p "$J/out"
if [ "$1" = start ]; then
  [ -e "$J/pid" ] && kill -0 "$(cat "$J/pid")" 2>/dev/null && { echo "already running"; exit 1; }
  rm -f "$J/done"
  setsid bash -c "export OUT=$J/out; $2; echo \$? > $J/done" > "$J/out/job.log" 2>&1 < /dev/null &
  echo $! > "$J/pid"; shift 2
else
  shift
fi
end=$((SECONDS + ${1:-540}))
while [ ! -e "$J/done" ] && [ $SECONDS -lt $end ]; do sleep 5; done
cp -r "$J/out/." "${OUT:-/tmp/out}/" 2>/dev/null
if [ -e "$J/done" ]; then echo "job ended rc=$(cat "$J/done")"; else echo "job still running: call wait again"; fi
cat "$J"/out/*.txt 2>/dev/null | tail -120
