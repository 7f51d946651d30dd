#!/bin/sh
# The node's runc, minus CAP_SYS_RESOURCE (same purpose as ../runc-without-sys-resource,
# written for the node's shell and jq). Baked in only where the host needed the wrapper.
real=/usr/local/sbin/runc
strip() {
  [ -f "$1" ] || return 0
  jq -c "if $2.capabilities then $2.capabilities |= with_entries(.value |= (if type == \"array\" then map(select(. != \"CAP_SYS_RESOURCE\")) else . end)) else . end" "$1" > "$1.nosysres" && mv "$1.nosysres" "$1"
}
sub=""; bundle=.; proc=""; prev=""
for a in "$@"; do
  case "$prev" in --bundle|-b) bundle=$a ;; --process|-p) proc=$a ;; esac
  case "$a" in --bundle=*) bundle=${a#*=} ;; --process=*) proc=${a#*=} ;; esac
  if [ -z "$sub" ]; then case "$a" in create|run|exec) sub=$a ;; esac; fi
  prev=$a
done
case "$sub" in
  create|run) strip "$bundle/config.json" .process ;;
  exec) [ -n "$proc" ] && strip "$proc" "" ;;
esac
exec "$real" "$@"
