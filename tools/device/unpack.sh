#!/usr/bin/env bash
# Sourced by the device scripts: restores .device-bin/*.xz (packed by tools/device/pack.sh) into
# executables, with xz where the machine has it, else Python's lzma.
for packed in .device-bin/*.xz; do
    [ -e "$packed" ] || continue
    plain=${packed%.xz}
    [ -x "$plain" ] && [ "$plain" -nt "$packed" ] && continue
    if command -v xz >/dev/null; then
        xz -dc "$packed" >"$plain"
    else
        python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$packed" "$plain"
    fi
    chmod +x "$plain"
done
